"""Token-level length control (megapo/algorithms/token_length.py): DECS's decoupled token reward and Bingo's
significance-aware and dynamic length reward, each against its formula written out as a loop; the stages' bad
options refused at config time naming the field; a stages config with each validates and reads what it declares;
the trainer computes DECS's first_correct from the task's checker on each step's prefix and runs the stage; the
stages are split-invariant over whole groups; `megapo objectives --formulas` lists both with their papers."""

from __future__ import annotations

import math
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.sample import TrainSample
from megapo.algorithms.token_length import (BingoOptions, DecsOptions, bingo_advantages, decs_advantages,
                                            dynamic_weight, first_correct_ends)
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from algorithm_configs import make_cfg  # noqa: E402

F64 = torch.float64


# ----------------------------------------------------------------------------- DECS, against its formula


def decs_loop(rewards, correct, first, lengths, n, budget, beta, eps):
    """The formula written out: per group, r_{i,t} for t up to the group's longest response (a shorter one padded
    with R(1 + β)), then per position the mean and the unbiased std over the group."""
    out = []
    for g in range(0, len(rewards), n):
        idx = list(range(g, g + n))

        def r(i, t):
            redundant = correct[i] and 0 <= first[i] < lengths[i] and first[i] <= t < lengths[i]
            if redundant:
                return rewards[i] + beta * (1 - lengths[i] / max(budget, lengths[i]))
            return rewards[i] * (1 + beta)

        for i in idx:
            row = []
            for t in range(lengths[i]):
                col = [r(j, t) for j in idx]
                if n == 1:
                    row.append(col[0] / (1 + eps))
                else:
                    row.append((r(i, t) - sum(col) / n) / (statistics.stdev(col) + eps))
            out.append(row)
    return out


def test_decs_against_its_formula():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.5, 0.0]
    correct = [True, True, False, True, True, False]
    first = [2, 5, -1, -1, 1, -1]  # the second response's answer is at its end: no redundant token
    lengths = [6, 5, 7, 4, 3, 2]
    o = DecsOptions(beta=0.3)
    got = decs_advantages(rewards, correct, first, lengths, 3, 10, o)
    want = decs_loop(rewards, correct, first, lengths, 3, 10, 0.3, o.eps)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    # a correct response's prefix keeps more than its redundant tail; the tail pays more the longer the response
    assert got[0][:2].min() > got[0][2:].max()


def test_decs_group_of_one_and_a_response_past_the_budget():
    o = DecsOptions(beta=0.5)
    got = decs_advantages([1.0], [True], [1], [3], 1, 4, o)
    assert got[0].tolist() == pytest.approx(decs_loop([1.0], [True], [1], [3], 1, 4, 0.5, o.eps)[0], abs=1e-12)
    got = decs_advantages([1.0, 0.0], [True, False], [1, -1], [5, 2], 2, 4, o)  # L_max = L_0 for the first
    want = decs_loop([1.0, 0.0], [True, False], [1, -1], [5, 2], 2, 4, 0.5, o.eps)
    assert all(g.tolist() == pytest.approx(w, abs=1e-12) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="budget"):
        decs_advantages([1.0], [True], [1], [3], 1, 0, o)


class CharTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text] + [0]


def test_first_correct_ends_checks_each_step_prefix():
    texts = ["7\nso 7\n", "x\n7", "7", "8\n7"]
    check = lambda response, answer: float(response.strip().split("\n")[-1] == answer)  # the last line  # noqa: E731
    got = first_correct_ends([_ids(t) for t in texts], ["7"] * 4, [True, True, True, False], CharTokenizer(), check,
                             1.0, "\n")
    # "7\n" ends at token 2; "x\n7" first at its end (3 tokens, then eos: 4); "7" (then eos) at 2; an incorrect
    # response is not checked
    assert got == [2, 4, 2, -1]


# ----------------------------------------------------------------------------- Bingo, against its formula


def bingo_loop(rewards, correct, probs, n, step, o):
    lam = o.lambda_w_e / (math.pi / 2)
    if step > o.decay_start:
        lam = max(-2 * o.lambda_w_e / (math.pi / 2), -o.decay_rate * (step - o.decay_start))
    out = []
    for g in range(0, len(rewards), n):
        idx = list(range(g, g + n))
        ins = {i: sum(1 for p in probs[i] if p > o.threshold) for i in idx}
        sig = {i: len(probs[i]) - ins[i] for i in idx}
        ref_ins, ref_sig = sum(ins.values()) / n, sum(sig.values()) / n
        shaped = []
        for i in idx:
            rho_ins, rho_sig = (ins[i] / ref_ins, sig[i] / ref_sig) if ref_ins > 0 and ref_sig > 0 else (0.0, 0.0)
            c = math.cos(min(max(rho_ins, 0.0), math.pi / 2))
            if correct[i]:
                shaped.append(rewards[i] + o.lambda_c * c)
            else:
                shaped.append(rewards[i] + min(0.0, o.lambda_w_n * (c - 1) + lam * rho_sig - o.lambda_w_e))
        mean, std = sum(shaped) / n, statistics.stdev(shaped)
        out += [[(s - mean) / (std + 1e-6)] * len(probs[i]) for s, i in zip(shaped, idx)]
    return out


@pytest.mark.parametrize("step", [1, 50, 53, 500])
def test_bingo_against_its_formula(step):
    probs = [[0.95, 0.2, 0.99, 0.5], [0.3, 0.4], [0.97, 0.98, 0.1, 0.2, 0.3], [0.95, 0.91],
             [0.5, 0.2, 0.1], [0.99, 0.6, 0.2]]
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    correct = [True, True, False, False, True, False]
    o = BingoOptions(threshold=0.9, lambda_c=2.0, lambda_w_n=1.5, lambda_w_e=3.0, decay_start=50, decay_rate=0.5)
    got = bingo_advantages(rewards, correct, [torch.tensor(p, dtype=F64).log() for p in probs], 3, step, o)
    for g, w in zip(got, bingo_loop(rewards, correct, probs, 3, step, o)):
        assert g.tolist() == pytest.approx(w, abs=1e-12)


def test_bingo_dynamic_weight_encourages_then_decays():
    o = BingoOptions(lambda_w_e=5.0, decay_start=10, decay_rate=0.5)
    start = 5.0 / (math.pi / 2)
    assert [dynamic_weight(t, o) for t in (1, 10, 11, 14)] == pytest.approx([start, start, -0.5, -2.0])
    assert dynamic_weight(1000, o) == pytest.approx(-2 * start)  # the authors' floor


# ----------------------------------------------------------------------------- config time


@pytest.mark.parametrize("stage, field", [
    ({"name": "decs", "beta": -0.1}, "beta"),
    ({"name": "decs", "step_delimiter": ""}, "step_delimiter"),
    ({"name": "bingo", "threshold": 1.5}, "threshold"),
    ({"name": "bingo", "lambda_c": -1}, "lambda_c"),
    ({"name": "bingo", "decay_start": 2.5}, "decay_start"),
    ({"name": "bingo", "advantage": "no_such_estimator"}, "advantage"),
])
def test_bad_options_are_refused_naming_the_field(stage, field):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[stage])
    assert err.value.field == f"algorithm.stages[0].{field}"


def test_a_stages_config_with_each_validates_and_reads_what_it_declares():
    decs = make_cfg(stages=[{"name": "polarity", "polarity": "positive"}, {"name": "decs", "beta": 0.2}]).algorithm
    assert decs.stage_inputs() >= {"first_correct", "reward", "correct"} and not decs.needs_old_stats()
    bingo = make_cfg(stages=[{"name": "bingo"}]).algorithm
    assert bingo.stage_inputs() >= {"old_logp", "reward", "correct", "step"} and bingo.needs_old_stats()


# ----------------------------------------------------------------------------- the trainer's side


def _groups(texts, rewards, answer="7"):
    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    return [Group(Example("p", answer), [SimpleNamespace(output_ids=_ids(t)) for t in texts], list(rewards),
                  correct=[r >= 1 for r in rewards])]


def _batch(texts):
    return [TrainSample([5, 5] + _ids(t), 2, 0.3) for t in texts]


def test_the_trainer_finds_first_correct_and_runs_decs():
    """update.advantage_stages with decs listed: the task's checker (addition: exact_match) on each correct response's
    step prefixes gives a_i, and every token gets the formula's advantage; first_correct only when a stage asks."""
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    cfg = make_cfg(stages=[{"name": "decs", "beta": 0.4}], n_samples=3)
    texts, rewards = ["7\nok", "7", "9\nx"], [1.0, 1.0, 0.0]
    batch = _batch(texts)
    metrics = advantage_stages(None, batch, _groups(texts, rewards), cfg, 1, CharTokenizer(), StepTimer())
    lengths = [len(t) + 1 for t in texts]
    want = decs_loop(rewards, [True, True, False], [2, 2, -1], lengths, 3, cfg.rollout.max_new_tokens, 0.4, 1e-6)
    for x, w in zip(batch, want):
        assert x.advantage == pytest.approx(w, abs=1e-12)
    assert metrics["decs/redundant_frac"] == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="tokenizer"):
        advantage_stages(None, _batch(texts), _groups(texts, rewards), cfg, 1, None, StepTimer())


def test_the_trainer_runs_bingo_on_old_logp():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    cfg = make_cfg(stages=[{"name": "bingo", "threshold": 0.9}], n_samples=3)
    texts, rewards = ["7ab", "7", "9xyz"], [1.0, 1.0, 0.0]
    batch = _batch(texts)
    probs = [[0.95, 0.5, 0.99, 0.2], [0.3, 0.99], [0.2, 0.95, 0.5, 0.6, 0.7]]
    for x, p in zip(batch, probs):
        x.old_logp = [math.log(v) for v in p]
    metrics = advantage_stages(None, batch, _groups(texts, rewards), cfg, 4, None, StepTimer())
    for x, w in zip(batch, bingo_loop(rewards, [True, True, False], probs, 3, 4, BingoOptions(threshold=0.9))):
        assert x.advantage == pytest.approx(w, abs=1e-12)
    assert metrics["bingo/insignificant_frac"] == pytest.approx(4 / 11)


def test_split_invariance_over_whole_groups():
    """Each stage's statistics are a group's: the batch at once == its groups one at a time."""
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    correct = [r > 0 for r in rewards]
    first = [1, -1, 3, -1, -1, -1, 2, 1]
    lengths = [4, 3, 5, 2, 6, 3, 3, 4]
    o = DecsOptions()
    whole = decs_advantages(rewards, correct, first, lengths, 2, 8, o)
    parts = [a for g in range(0, 8, 2) for a in decs_advantages(rewards[g:g + 2], correct[g:g + 2], first[g:g + 2],
                                                                  lengths[g:g + 2], 2, 8, o)]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(whole, parts))
    logp = [torch.linspace(-2.0, -0.01, n, dtype=F64) for n in lengths]
    ob = BingoOptions(threshold=0.5)
    whole = bingo_advantages(rewards, correct, logp, 2, 3, ob)
    parts = [a for g in range(0, 8, 2) for a in bingo_advantages(rewards[g:g + 2], correct[g:g + 2], logp[g:g + 2],
                                                                   2, 3, ob)]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(whole, parts))


def test_objectives_lists_both_with_their_papers(capsys):
    from megapo.algorithms.pipeline import entry
    from megapo.cli import main

    assert main(["objectives", "--kind", "advantage_stage", "--formulas"]) == 0
    out = capsys.readouterr().out
    for name, words in (("decs", "Decoupled Rewards"), ("bingo", "Bingo")):
        e = entry(name)
        assert name in out and e.paper in out and words in e.paper and "Assumption" in e.formula

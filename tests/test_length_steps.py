"""The length rewards that read steps (megapo/algorithms/step_length.py: step_pruner, post_answer, grsp) against their
formulas written out here as plain loops over hand-made groups with steps, their split invariance, state, option
refusals, and the length stage's step splitting and prefix answer check (megapo/trainer/length_stage.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import entries
from megapo.algorithms.length import ScoredGroup, build_length_reward, check_shaped
from megapo.cli import main
from megapo.config import ConfigError, load_config
from megapo.engines.base import Sample
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.rollout import Group

BUDGET = 64
ROOT = Path(__file__).resolve().parents[1]


def _group(key, rewards, correct, steps, first=None):
    """A group whose response i has steps of steps[i] tokens (its length their sum)."""
    return ScoredGroup(key, None, torch.tensor(rewards, dtype=torch.float64), torch.tensor(correct),
                       torch.tensor([sum(s) for s in steps], dtype=torch.int64), torch.zeros(len(rewards), dtype=bool),
                       step_lengths=tuple(torch.tensor(s, dtype=torch.int64) for s in steps),
                       first_correct=torch.tensor(first, dtype=torch.int64) if first is not None else None)


GROUPS = [
    _group("a", [1.0, 1.0, 0.0, 1.0], [True, True, False, True], [[5, 5], [3, 3, 3, 3], [2], [4, 4, 20]],
           first=[10, 3, -1, 8]),
    _group("b", [0.0, 0.5, 0.0], [False, False, False], [[6, 6], [30], [1, 1, 1]], first=[-1, -1, -1]),
    _group("c", [1.0, 1.0, 1.0], [True, True, True], [[40, 2], [10, 10, 10, 10, 10, 10], [17]], first=[40, 10, 17]),
    _group("d", [1.0, 0.0], [True, False], [[8, 8, 8], [70, 1]], first=[24, 2]),
]


def _shape(name, options, groups, step=1):
    method = build_length_reward(name, options, BUDGET)
    return [r.tolist() for r in check_shaped(groups, method.shape(groups, step), name)], method


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-12), (got, want)


# ----------------------------------------------------------------------------- step_pruner


def _step_pruner_loop(g, beta, floor):
    """R' = max(R − β(K − K*), m) when correct (K* the fewest steps of a correct response), else 0."""
    rewards, correct, steps = g.rewards.tolist(), g.correct.tolist(), [len(s) for s in g.step_lengths]
    fewest = min((k for k, c in zip(steps, correct) if c), default=None)
    return [max(r - beta * (k - fewest), floor) if c else 0.0 for r, c, k in zip(rewards, correct, steps)]


def test_step_pruner_against_the_formula():
    got, method = _shape("step_pruner", {"penalty": 0.3, "min_reward": 0.2}, GROUPS)
    for g, row in zip(GROUPS, got):
        _close(row, _step_pruner_loop(g, 0.3, 0.2))
    assert got[0] == pytest.approx([1.0, 0.4, 0.0, 0.7]) and got[1] == [0.0, 0.0, 0.0]  # partial credit withheld
    assert method.metrics() == {"halted": 0.0}


def test_step_pruner_halts_from_the_step_after_a_step_over_the_limit():
    options = {"penalty": 0.3, "min_reward": 0.2, "max_step_len": 35}  # c (a 40-token step) and d (70) trigger
    got, method = _shape("step_pruner", options, GROUPS, step=3)
    _close(got[0], _step_pruner_loop(GROUPS[0], 0.3, 0.2))
    assert got[2] == [0.0] * 3 and got[3] == [0.0] * 2
    assert method.state_dict() == {"halted_from": 4} and method.metrics() == {"halted": 1.0}
    again = method.shape(GROUPS[:1], 3)  # the trigger step's other rounds: shaped as usual
    _close(again[0].tolist(), got[0])
    assert method.shape(GROUPS[:1], 4)[0].tolist() == [0.0] * 4  # every later step: no update
    resumed = build_length_reward("step_pruner", options, BUDGET)
    resumed.load_state_dict(json.loads(json.dumps(method.state_dict())))
    assert resumed.shape(GROUPS[:1], 5)[0].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="halted_from"):
        resumed.load_state_dict({"halted_from": "soon"})


# ----------------------------------------------------------------------------- post_answer


def test_post_answer_against_the_formula():
    alpha = 0.4
    got, _ = _shape("post_answer", {"alpha": alpha}, GROUPS)
    for g, row in zip(GROUPS, got):
        want = []
        for r, c, n, a in zip(g.rewards.tolist(), g.correct.tolist(), g.lengths.tolist(), g.first_correct.tolist()):
            want.append(r - alpha * (n - a) / n if c and a >= 0 else r)
        _close(row, want)
    # a: 10 tokens with the answer at 10 pays nothing; 12 tokens, answer after 3, pays 0.4·9/12
    assert got[0][0] == 1.0 and got[0][1] == pytest.approx(1 - 0.4 * 9 / 12)
    assert got[3][1] == 0.0  # an incorrect response keeps its reward whatever it wrote first


# ----------------------------------------------------------------------------- grsp


def _grsp_loop(g, coef, bins, weights):
    """S_i = Σ_k w[#{b: ℓ_k > b}]; z = (S − mean)/population std (0 if 0); R' = R − λz when correct."""
    scores = []
    for steps in g.step_lengths.__iter__():
        total = 0.0
        for n in steps.tolist():
            cluster = 0
            for b in bins:
                if n > b:
                    cluster += 1
            total += weights[cluster]
        scores.append(total)
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    out = []
    for r, c, s in zip(g.rewards.tolist(), g.correct.tolist(), scores):
        z = (s - mean) / std if std > 0 else 0.0
        out.append(r - coef * z if c else r)
    return out


def test_grsp_against_the_formula():
    options = {"coef": 0.2, "bins": [4, 12], "weights": [1.0, 0.6, 0.1]}
    got, _ = _shape("grsp", options, GROUPS)
    for g, row in zip(GROUPS, got):
        _close(row, _grsp_loop(g, 0.2, [4, 12], [1.0, 0.6, 0.1]))
    assert got[1] == [0.0, 0.5, 0.0]  # no correct response: unchanged
    # c: one 17-token segment (weight 0.1) against six 10-token ones (3.6): the fewer, longer segments earn more
    assert got[2][2] > got[2][0] > got[2][1]


@pytest.mark.parametrize("name,options", [
    ("step_pruner", {"penalty": 0.3, "max_step_len": 35}), ("post_answer", {}),
    ("grsp", {"bins": [4, 12], "weights": [1.0, 0.6, 0.1]}),
])
def test_split_invariant(name, options):
    """Each group is shaped from its own responses: one call on all groups = one call per group, in any order."""
    whole, _ = _shape(name, options, GROUPS, step=2)
    method = build_length_reward(name, options, BUDGET)
    parts = [method.shape([g], 2)[0].tolist() for g in reversed(GROUPS)][::-1]
    for a, b in zip(whole, parts):
        _close(a, b)


# ----------------------------------------------------------------------------- refusals and listing


@pytest.mark.parametrize("name,options,message", [
    ("step_pruner", {"penalty": -0.1}, "penalty: must be a finite number >= 0"),
    ("step_pruner", {"min_reward": 0}, "min_reward: must be a finite number > 0"),
    ("step_pruner", {"max_step_len": 2.5}, "max_step_len: must be an int"),
    ("step_pruner", {"step_delimiter": ""}, "step_delimiter: must be a non-empty string"),
    ("post_answer", {"alpha": 1.5}, "alpha: must be a finite number >= 0 and <= 1"),
    ("post_answer", {"step_delimiter": 3}, "step_delimiter:"),
    ("grsp", {"bins": [8, 4]}, "bins: must be a list of increasing ints > 0"),
    ("grsp", {"weights": [1.0, 0.5]}, "weights: must be a list of len(bins) + 1 = 3 numbers"),
    ("grsp", {"weights": [1.0, -0.5, 0.1]}, "weights[1]: must be a finite number >= 0"),
    ("grsp", {"coef": float("nan")}, "coef:"),
])
def test_bad_options_name_the_option(name, options, message):
    with pytest.raises(ValueError) as err:
        build_length_reward(name, options, BUDGET)
    assert str(err.value).startswith(message), str(err.value)


def test_a_group_without_steps_is_refused_naming_the_field():
    bare = ScoredGroup("z", None, torch.tensor([1.0]), torch.tensor([True]), torch.tensor([3]), torch.tensor([False]))
    for name, field in (("step_pruner", "step_lengths"), ("grsp", "step_lengths"), ("post_answer", "first_correct")):
        with pytest.raises(ValueError, match=f"^{field}: {name}"):
            build_length_reward(name, {}, BUDGET).shape([bare], 1)


def test_config_refusal_names_the_options_field():
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, ROOT / "megapo/configs/length_base.yaml",
                    ["data.length_reward=grsp", "data.length_reward_options={bins: [3, 2]}"])
    assert err.value.field == "data.length_reward_options" and "bins:" in str(err.value)


def test_objectives_formulas_list_them(capsys):
    assert main(["objectives", "--kind", "length_reward", "--formulas"]) == 0
    out = capsys.readouterr().out
    for e in entries("length_reward"):
        if e.name in ("step_pruner", "post_answer", "grsp"):
            assert e.name in out and e.paper in out
            assert e.formula.splitlines()[0].strip() in out


# ----------------------------------------------------------------------------- the length stage's steps


class CharTokenizer:
    """One token per character (id = its code point); id 0 the end of sequence, no text."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _sample(text, stop=True):
    ids = [ord(c) for c in text] + ([0] if stop else [])
    return Sample([1, 2], ids, [-0.1] * len(ids), "stop" if stop else "length", 0)


def test_the_stage_splits_steps_and_finds_the_first_correct_answer():
    """addition_cot's checker (the text after the last ';') on each step's prefix: '4;7;7' first answers at the
    second step (4 tokens with its ';'), then checks; '4;5;7' answers right only at its end."""
    cfg = load_config(RunConfig, ROOT / "megapo/configs/length_base.yaml",
                      ["rollout.n_samples=3", "data.reward=megapo.tasks.addition_cot:reward",
                       "data.length_reward=post_answer",
                       "data.length_reward_options={step_delimiter: ';', alpha: 0.5}"])
    stage = LengthStage(cfg, tokenizer=CharTokenizer())
    stage.begin_batch()
    group = Group(Example("3+4=", "7", difficulty=1), [_sample("4;7;7"), _sample("4;5;7"), _sample("4;5;6")],
                  [1.0, 1.0, 0.0])
    scored = stage.scored_group(group, "k")
    assert [s.tolist() for s in scored.step_lengths] == [[2, 2, 2]] * 3  # '4;' '7;' '7<eos>'
    assert scored.first_correct.tolist() == [4, 6, -1]
    out = stage.apply([group])[0]
    assert out.rewards == pytest.approx([1 - 0.5 * (6 - 4) / 6, 1.0, 0.0])
    with pytest.raises(ValueError, match="^data.length_reward: post_answer splits responses"):
        LengthStage(cfg)


def test_megapo_train_splits_steps_with_the_run_tokenizer(tmp_path, tiny_moe):
    """Two steps of `megapo train` with step_pruner and a 1-token step limit: the stage splits the responses with
    the run's tokenizer, a longer step halts the updates, and the second step's shaped rewards are all 0."""
    sys.path.insert(0, str(Path(__file__).parent))
    from train_runs import train_rows

    rows = train_rows(tmp_path, "step_pruner", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=2",
                      "rollout.n_samples=2", "rollout.max_new_tokens=4", "data.length_reward=step_pruner",
                      "data.length_reward_options={max_step_len: 1}")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["length/halted"] == 1.0 and rows[1]["reward/shaped"] == 0.0

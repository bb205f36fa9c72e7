"""A3PO (Tang et al. 2025, Rethinking Sample Polarity in Reinforcement Learning with Verifiable Rewards,
arXiv:2512.21625): the token stage a3po of megapo/algorithms/a3po.py, asymmetric token-level advantage shaping by
sample polarity (a positive response's lowest-π_old-probability tokens and a negative response's highest-probability
tokens scaled, the factors annealed over training).

Checked: the stage against its formula written out as a plain loop (sorting by hand, no torch.topk) over hand-made
log-probs, at several steps of the schedule; a hand example; float64 finite differences of the PPO loss on its
advantages; its thresholds taken once on the whole train batch, so 4 micro-batches x 2 DP shards of the loss give the
single-batch loss and gradient (and thresholds taken per shard would differ); the pipeline asks the old-log-prob pass
for π_old's log-probs but not its entropy; config refusals naming the field; `megapo objectives` lists it; one tiny
`megapo train` run.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms.a3po import a3po_advantages
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import objective_loops  # noqa: E402
from objective_loops import (assert_ppo_gradient_matches_fd, assert_ppo_split_invariant, close,  # noqa: E402
                             objectives_listing, old_pass_request)
import algorithm_configs  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)
F64 = torch.float64
LENGTHS = [6, 3, 8, 5, 2, 7, 4, 9]
ADV = [0.5, -0.5, -0.3, 0.9, -1.0, 1.0, 0.0, -0.2]  # one response with advantage 0


def rand_lists(seed, lengths, low=-4.0, high=0.0):
    return objective_loops.rand_lists(seed, lengths, low, high)


# ----------------------------------------------------------------------------- against a loop


def a3po_loop(adv, logp, frac=0.2, pos_scale=2.0, neg_scale=2.0, scale_end=1.0, anneal_steps=100, step=1):
    rows = [[adv[i]] * len(logp[i]) if not isinstance(adv[i], list) else list(adv[i]) for i in range(len(logp))]
    sign = [(1 if sum(r) > 0 else -1 if sum(r) < 0 else 0) for r in rows]
    pos = sorted(math.exp(x) for i, lp in enumerate(logp) if sign[i] > 0 for x in lp)
    neg = sorted((math.exp(x) for i, lp in enumerate(logp) if sign[i] < 0 for x in lp), reverse=True)
    tau_pos = pos[max(1, math.ceil(frac * len(pos) - 1e-9)) - 1] if pos else math.inf
    tau_neg = neg[max(1, math.ceil(frac * len(neg) - 1e-9)) - 1] if neg else -math.inf
    progress = 1.0 if scale_end is None else min(1.0, max(step - 1, 0) / anneal_steps)
    s_pos = pos_scale if scale_end is None else pos_scale + (scale_end - pos_scale) * progress
    s_neg = neg_scale if scale_end is None else neg_scale + (scale_end - neg_scale) * progress
    out = []
    for i, lp in enumerate(logp):
        row = []
        for t, x in enumerate(lp):
            p, w = math.exp(x), 1.0
            if sign[i] > 0 and p <= tau_pos:
                w = s_pos
            if sign[i] < 0 and p >= tau_neg:
                w = s_neg
            row.append(rows[i][t] * w)
        out.append(row)
    return out


@pytest.mark.parametrize("options, step", [
    ({}, 1), ({}, 51), ({}, 300),
    ({"frac": 0.5, "pos_scale": 3.0, "neg_scale": 0.5, "scale_end": 1.5, "anneal_steps": 10}, 4),
    ({"frac": 1.0, "pos_scale": 1.5, "scale_end": None, "anneal_steps": 0}, 9),
    ({"frac": 0.05, "neg_scale": 4.0}, 2),
])
def test_a3po_against_a_loop(options, step):
    logp = rand_lists(1, LENGTHS)
    got = a3po_advantages(advantages=ADV, old_logp=logp, step=step, **options)
    want = a3po_loop(ADV, logp, step=step, **options)
    close(got, want)
    if options.get("pos_scale", 2.0) != 1.0 and step < 100:  # some tokens are scaled, some not
        ratios = {round(g / a, 12) for gs, a in zip(got, ADV) if a != 0 for g in gs.tolist()}
        assert len(ratios) > 1 or options.get("frac") == 1.0


def test_a3po_per_token_input_against_a_loop():
    """An earlier stage's per-token advantages: the polarity is the sign of their sum."""
    logp = rand_lists(2, LENGTHS)
    adv = [[0.3 * ((-1) ** t) + (0.1 if i % 2 else -0.1) for t in range(n)] for i, n in enumerate(LENGTHS)]
    got = a3po_advantages(advantages=adv, old_logp=logp, step=3, frac=0.3)
    close(got, a3po_loop(adv, logp, frac=0.3, step=3))


def test_a3po_hand_example():
    """ρ = 1/3: of the positive response's three tokens (p = 0.9, 0.1, 0.5) the rarest is doubled; of the negative
    responses' three (0.8, 0.3 | 0.6) the likeliest is doubled; the zero-advantage response is untouched. Half way
    through a 4-step schedule (step 3) the factor is 1.5."""
    logp = [[math.log(0.9), math.log(0.1), math.log(0.5)], [math.log(0.8), math.log(0.3)], [math.log(0.6)],
            [math.log(0.2)]]
    got = a3po_advantages(advantages=[1.0, -1.0, -0.5, 0.0], old_logp=logp, frac=1 / 3)
    assert [g.tolist() for g in got] == [pytest.approx([1.0, 2.0, 1.0]), pytest.approx([-2.0, -1.0]),
                                         pytest.approx([-0.5]), pytest.approx([0.0])]
    mid = a3po_advantages(advantages=[1.0, -1.0, -0.5, 0.0], old_logp=logp, frac=1 / 3, anneal_steps=4, step=3)
    assert mid[0].tolist() == pytest.approx([1.0, 1.5, 1.0]) and mid[1].tolist() == pytest.approx([-1.5, -1.0])
    end = a3po_advantages(advantages=[1.0, -1.0, -0.5, 0.0], old_logp=logp, frac=1 / 3, anneal_steps=4, step=5)
    assert end[0].tolist() == pytest.approx([1.0, 1.0, 1.0])  # the schedule's end: plain advantages


def test_inputs_missing_or_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match=r"old_logp\[1\]"):
        a3po_advantages(advantages=[1.0, -1.0], old_logp=[[-0.1], None])
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        a3po_advantages(advantages=[1.0, [1.0, 2.0]], old_logp=[[-0.1], [-0.2, -0.3, -0.4]])
    with pytest.raises(ValueError, match="advantages"):
        a3po_advantages(advantages=[1.0], old_logp=[[-0.1], [-0.2]])


# ----------------------------------------------------------------------------- the loss: gradient and split


def test_the_loss_on_its_advantages_matches_finite_differences():
    logp = rand_lists(3, LENGTHS)
    shaped = [a.tolist() for a in a3po_advantages(advantages=ADV, old_logp=logp, frac=0.3, step=7)]
    assert_ppo_gradient_matches_fd(logp, shaped, LENGTHS, seed=4)


def test_thresholds_are_the_whole_batch_and_the_loss_splits():
    """τ₊ and τ₋ are taken over the whole train batch's positive / negative tokens: the stage runs once before the
    split (thresholds taken per DP shard differ), and 4 micro-batches x 2 DP shards of the loss with those
    advantages give the single-batch loss and gradient, 1e-12."""
    logp = rand_lists(5, LENGTHS)
    logp[5] = [x - 3.0 for x in logp[5]]  # shard 1 holds the batch's rarest positive tokens
    logp[7] = [min(0.0, x + 3.5) for x in logp[7]]  # and its likeliest negative ones
    whole = a3po_advantages(advantages=ADV, old_logp=logp, frac=0.25)
    shard = a3po_advantages(advantages=ADV[:4], old_logp=logp[:4], frac=0.25)
    assert any(a.tolist() != pytest.approx(b.tolist(), rel=1e-9) for a, b in zip(whole[:4], shard))
    assert_ppo_split_invariant(logp, [a.tolist() for a in whole], LENGTHS, seed=6)


# ----------------------------------------------------------------------------- in the pipeline


def test_the_stage_in_the_pipeline_sets_advantages_and_metrics():
    from megapo.trainer.update import token_stages

    logp = [[math.log(0.9), math.log(0.1), math.log(0.5)], [math.log(0.8), math.log(0.3)]]
    batch = [{"tokens": [9, 9, 1, 2, 3], "prompt_len": 2, "advantage": 1.0, "old_logp": logp[0]},
             {"tokens": [9, 9, 5, 6], "prompt_len": 2, "advantage": -1.0, "old_logp": logp[1]}]
    cfg = make_cfg(stages=[{"name": "polarity", "neg_scale": 0.5}, {"name": "a3po", "frac": 0.34}])
    metrics = token_stages(batch, cfg, step=1)
    # (polarity is a sequence stage: it ran before the old-log-prob pass; here only a3po runs)
    assert batch[0]["advantage"] == pytest.approx([1.0, 2.0, 2.0], rel=1e-13)  # k₊ = ⌈0.34·3⌉ = 2
    assert batch[1]["advantage"] == pytest.approx([-2.0, -1.0], rel=1e-13)
    assert metrics["a3po/scaled_frac"] == pytest.approx(3 / 5) and metrics["a3po/pos_scale"] == 2.0


@pytest.mark.parametrize("stages, stats, entropy", [
    ([], False, False),
    ([{"name": "a3po"}], True, False),
])
def test_the_old_log_prob_pass_runs_without_entropy(stages, stats, entropy):
    cfg = make_cfg(stages=stages)
    a = cfg.algorithm
    assert (a.needs_old_stats(), a.needs_old_entropy(), a.needs_reference()) == (stats, entropy, False)
    if not stages:
        return
    asked, sample = old_pass_request(cfg)
    assert asked == [False]
    assert sample.get("old_logp") is not None and sample.get("old_entropy") is None


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("options, field, words", [
    ({"frac": 0}, "frac", "> 0"),
    ({"frac": 1.5}, "frac", "<= 1"),
    ({"pos_scale": -1}, "pos_scale", ">= 0"),
    ({"neg_scale": float("inf")}, "neg_scale", "finite"),
    ({"scale_end": -0.5}, "scale_end", ">= 0"),
    ({"anneal_steps": 0}, "anneal_steps", "scale_end: null"),
    ({"anneal_steps": 2.5}, "anneal_steps", "an int"),
    ({"scale_end": None}, "scale_end", "anneal_steps"),
])
def test_bad_options_refused_at_config_time(options, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "polarity"}, {"name": "a3po", **options}])
    assert err.value.field == f"algorithm.stages[1].{field}" and words in str(err.value)


def test_unknown_option_and_gae_are_refused():
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "a3po", "rho": 0.2}])
    assert err.value.field == "algorithm.stages[0]" and "unknown option" in str(err.value)
    with pytest.raises(ConfigError) as err:
        make_cfg(advantage="gae", stages=[{"name": "a3po"}])
    assert err.value.field == "algorithm.stages[0]" and "sequence_advantage" in str(err.value)


def test_objectives_lists_it_with_paper_and_formula(capsys):
    row, out, inputs = objectives_listing(capsys, "a3po")
    assert "Rethinking Sample Polarity" in row and "arXiv:2512.21625" in row
    assert "τ₊ = the k₊-th smallest p" in out and "Assumption:" in out
    assert inputs == ["token", "sequence_advantage,old_logp,step"]


# ----------------------------------------------------------------------------- one tiny run


def test_megapo_train_with_a3po(tmp_path, tiny_moe):
    """Two steps of `megapo train` (the Megatron learner on CPU) with a3po after polarity: the old-log-prob pass gives
    π_old's log-probs, the stage logs its metrics, and its factor follows the schedule."""
    rows = train_rows(tmp_path, "a3po", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "rollout.max_new_tokens=6",
                      "algorithm.stages=[{name: polarity, neg_scale: 0.5}, {name: a3po, frac: 0.3, anneal_steps: 2}]")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["a3po/pos_scale"] for r in rows] == [2.0, 1.5]
    for r in rows:
        assert 0.0 <= r["a3po/scaled_frac"] <= 1.0 and math.isfinite(r["train/loss"])

"""Entropy credit: the token stages erpo (entropy-aware gating of critical decision pivots, bucket-normalised over
token progress windows, anchored to the outcome) and aepo (high window-entropy tokens, a difficulty-level entropy
reward and KL coefficient) of megapo/algorithms/entropy_credit.py.

Checked: each stage against its formula written out as a plain loop over hand-made entropies; aepo's batch threshold
taken once on the whole train batch, so 4 micro-batches x 2 DP shards of the loss with its advantages give the
single-batch loss and gradient (and a threshold taken per shard would differ); erpo's statistics per group (a
group's result does not depend on the batch around it); the pipeline asks the old-log-prob pass for π_old's entropy
(and π_ref only for aepo's KL term) only when such a stage is listed; config refusals naming the field; `megapo
objectives` lists them; one tiny `megapo train` run.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms.entropy_credit import entropy_credit_advantages
from megapo.config import ConfigError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import objective_loops  # noqa: E402
from objective_loops import assert_ppo_split_invariant, close, old_pass_request  # noqa: E402
import algorithm_configs  # noqa: E402
from train_runs import train_rows  # noqa: E402

make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)
F64 = torch.float64


def rand_lists(seed, lengths, low=0.0, high=2.0):
    return objective_loops.rand_lists(seed, lengths, low, high)


# ----------------------------------------------------------------------------- erpo against a loop


def erpo_loop(adv, entropy, group_size, buckets=10, threshold=1.5, amplify=1.0, anchor="sequence"):
    out = []
    for g0 in range(0, len(entropy), group_size):
        members = range(g0, g0 + group_size)
        total, count = [0.0] * buckets, [0] * buckets
        for i in members:
            n = len(entropy[i])
            for t in range(n):
                b = (buckets * t) // n
                total[b] += entropy[i][t]
                count[b] += 1
        for i in members:
            n = len(entropy[i])
            gates = []
            for t in range(n):
                b = (buckets * t) // n
                m = total[b] / count[b]
                rel = entropy[i][t] / m if m > 0 else 0.0
                gates.append(1.0 + amplify * (1.0 if rel >= threshold else 0.0))
            mean = sum(gates) / n if n else 1.0
            row = []
            for t in range(n):
                a = adv[i][t] if isinstance(adv[i], list) else adv[i]
                row.append(a * (gates[t] / mean if anchor == "sequence" else gates[t]))
            out.append(row)
    return out


@pytest.mark.parametrize("options", [{}, {"buckets": 3, "threshold": 1.2, "amplify": 2.0},
                                     {"buckets": 1, "anchor": "none"}, {"buckets": 7, "threshold": 0.9}])
def test_erpo_against_a_loop(options):
    lengths = [7, 4, 9, 1, 5, 6]
    entropy = rand_lists(1, lengths)
    entropy[1][2] = 0.0
    adv = [0.8, -0.6, 1.2, -1.2, 0.0, 0.5]
    got = entropy_credit_advantages("erpo", advantages=adv, entropy=entropy, group_size=2, **options)
    want = erpo_loop(adv, entropy, 2, **options)
    close(got, want)
    # some tokens are pivots, some not (the test exercises both branches of the gate)
    gates = [g / a for gs, a in zip(got, adv) if a != 0 for g in gs.tolist()]
    assert len({round(x, 12) for x in gates}) > 1


def test_erpo_hand_example_and_anchor():
    """One group of two, B = 2: the buckets' mean entropies are 1 and 2; the one token at 2x its bucket mean is the
    pivot; with anchor=sequence the response's advantages sum to its outcome advantage x length."""
    entropy = [[1.0, 1.0, 3.0, 1.0], [1.0, 1.0]]  # bucket 0: 1,1,1 (mean 1); bucket 1: 3,1,1 (mean 5/3)
    got = entropy_credit_advantages("erpo", advantages=[2.0, -1.0], entropy=entropy, group_size=2, buckets=2,
                                    threshold=1.5, amplify=1.0)
    assert got[0].tolist() == pytest.approx([2 * 4 / 5, 2 * 4 / 5, 2 * 8 / 5, 2 * 4 / 5], rel=1e-14)
    assert got[1].tolist() == pytest.approx([-1.0, -1.0], rel=1e-14)  # no pivot: the plain advantage
    assert float(got[0].sum()) == pytest.approx(2.0 * 4, rel=1e-14)
    raw = entropy_credit_advantages("erpo", advantages=[2.0, -1.0], entropy=entropy, group_size=2, buckets=2,
                                    anchor="none")
    assert raw[0].tolist() == pytest.approx([2.0, 2.0, 4.0, 2.0], rel=1e-14)


def test_erpo_per_token_input_and_groups_are_independent():
    lengths = [5, 3, 4, 6]
    entropy = rand_lists(2, lengths)
    adv = [[0.1 * (t + 1) for t in range(n)] for n in lengths]  # an earlier stage's per-token advantages
    got = entropy_credit_advantages("erpo", advantages=adv, entropy=entropy, group_size=2, buckets=2)
    close(got, erpo_loop(adv, entropy, 2, buckets=2))
    alone = entropy_credit_advantages("erpo", advantages=adv[2:], entropy=entropy[2:], group_size=2, buckets=2)
    close(alone, [g.tolist() for g in got[2:]], tol=0)


# ----------------------------------------------------------------------------- aepo against a loop


def aepo_loop(adv, entropy, correct, group_size, old=None, ref=None, window=5, hwe_frac=0.2, easy_above=0.75,
              hard_below=0.25, bonus=(-0.1, 0.0, 0.1), kl=(0.0, 0.0, 0.0)):
    windows = []
    for h in entropy:
        row = []
        for t in range(len(h)):
            span = h[t: min(t + window, len(h))]
            row.append(sum(span) / len(span))
        windows.append(row)
    flat = sorted((x for row in windows for x in row), reverse=True)
    k = max(1, math.ceil(hwe_frac * len(flat) - 1e-9))
    tau = flat[k - 1]
    out = []
    for g0 in range(0, len(entropy), group_size):
        rate = sum(bool(c) for c in correct[g0:g0 + group_size]) / group_size
        level = 0 if rate >= easy_above else 2 if rate <= hard_below else 1
        for i in range(g0, g0 + group_size):
            row = []
            for t in range(len(entropy[i])):
                a = adv[i][t] if isinstance(adv[i], list) else adv[i]
                a += bonus[level] * (1.0 if windows[i][t] >= tau else 0.0)
                if old is not None:
                    a -= kl[level] * (old[i][t] - ref[i][t])
                row.append(a)
            out.append(row)
    return out, tau


LENGTHS = [6, 3, 8, 5, 2, 7, 4, 9]
CORRECT = [True, True, True, False, False, False, True, False]  # pass rates 1 (easy), 1/2, 0 (hard), 1/2


@pytest.mark.parametrize("options", [{}, {"window": 1, "hwe_frac": 0.5}, {"window": 3, "hwe_frac": 1.0},
                                     {"window": 20, "hwe_frac": 0.05, "bonus_easy": -0.3, "bonus_medium": 0.2,
                                      "bonus_hard": 0.7, "easy_above": 0.5, "hard_below": 0.0}])
def test_aepo_against_a_loop(options):
    entropy = rand_lists(3, LENGTHS)
    adv = [0.5, 0.5, -0.3, 0.9, -1.0, 1.0, 0.2, -0.2]
    got = entropy_credit_advantages("aepo", advantages=adv, entropy=entropy, group_size=2, correct=CORRECT,
                                    **options)
    names = {"window", "hwe_frac", "easy_above", "hard_below"}
    kw = {k: v for k, v in options.items() if k in names}
    bonus = tuple(options.get(f"bonus_{lv}", d) for lv, d in (("easy", -0.1), ("medium", 0.0), ("hard", 0.1)))
    want, _ = aepo_loop(adv, entropy, CORRECT, 2, bonus=bonus, **kw)
    close(got, want)


def test_aepo_kl_term_against_a_loop():
    entropy = rand_lists(4, LENGTHS)
    old = rand_lists(5, LENGTHS, -3.0, 0.0)
    ref = rand_lists(6, LENGTHS, -3.0, 0.0)
    adv = [[0.05 * t for t in range(n)] for n in LENGTHS]
    opts = {"kl_easy": 0.3, "kl_medium": 0.1, "kl_hard": 0.0, "bonus_hard": 0.25}
    got = entropy_credit_advantages("aepo", advantages=adv, entropy=entropy, group_size=2, correct=CORRECT,
                                    old_logp=old, ref_logp=ref, **opts)
    want, _ = aepo_loop(adv, entropy, CORRECT, 2, old, ref, bonus=(-0.1, 0.0, 0.25), kl=(0.3, 0.1, 0.0))
    close(got, want)
    with pytest.raises(ValueError, match=r"ref_logp\[0\]"):
        entropy_credit_advantages("aepo", advantages=adv, entropy=entropy, group_size=2, correct=CORRECT,
                                  old_logp=old, **opts)


def test_aepo_hand_example():
    """Window 2, ρ = 1/4 of 8 tokens: the two highest window entropies (1.5 at the first response's start, 1.0 at
    the second's end) are the HWE tokens; an easy group's response loses 0.1 there, a hard group's gains 0.1."""
    entropy = [[2.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    # windows: [1.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 1.0]: top 2 of 8 -> 1.5 and 1.0
    easy = entropy_credit_advantages("aepo", advantages=[1.0, 1.0], entropy=entropy, group_size=2,
                                     correct=[True, True], window=2, hwe_frac=0.25)
    assert easy[0].tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0]) and easy[1].tolist() == pytest.approx(
        [1.0, 1.0, 1.0, 0.9])
    hard = entropy_credit_advantages("aepo", advantages=[0.0, 0.0], entropy=entropy, group_size=2,
                                     correct=[False, False], window=2, hwe_frac=0.25)
    assert hard[0].tolist() == pytest.approx([0.1, 0, 0, 0]) and hard[1].tolist() == pytest.approx([0, 0, 0, 0.1])


def test_inputs_missing_or_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="entropy"):
        entropy_credit_advantages("erpo", advantages=[1.0, 1.0], entropy=[[0.1], None], group_size=2)
    with pytest.raises(ValueError, match=r"advantages\[1\]"):
        entropy_credit_advantages("erpo", advantages=[1.0, [1.0, 2.0]], entropy=[[0.1], [0.2, 0.3, 0.4]],
                                  group_size=2)
    with pytest.raises(ValueError, match="correct"):
        entropy_credit_advantages("aepo", advantages=[1.0, 1.0], entropy=[[0.1], [0.2]], group_size=2)
    with pytest.raises(ValueError, match="groups of 2"):
        entropy_credit_advantages("erpo", advantages=[1.0], entropy=[[0.1]], group_size=2)


# ----------------------------------------------------------------------------- batch statistics and the split


def test_aepo_threshold_is_the_whole_batch_and_the_loss_splits():
    """aepo's τ is a quantile of the whole train batch's window entropies: the stage runs once before the split (a
    τ taken per DP shard differs), and 4 micro-batches x 2 DP shards of the loss with those advantages give the
    single-batch loss and gradient."""
    entropy = rand_lists(7, LENGTHS)
    entropy[4] = [x + 3.0 for x in entropy[4]]  # shard 1 holds the batch's highest entropies
    adv = [0.5, 0.5, -0.3, 0.9, -1.0, 1.0, 0.2, -0.2]
    kw = {"group_size": 2, "hwe_frac": 0.25, "bonus_medium": 0.3}
    whole = entropy_credit_advantages("aepo", advantages=adv, entropy=entropy, correct=CORRECT, **kw)
    shard = entropy_credit_advantages("aepo", advantages=adv[:4], entropy=entropy[:4], correct=CORRECT[:4], **kw)
    assert any(a.tolist() != pytest.approx(b.tolist(), rel=1e-9) for a, b in zip(whole[:4], shard))
    old = rand_lists(8, LENGTHS, -3.0, 0.0)
    assert_ppo_split_invariant(old, whole, LENGTHS, seed=9)


# ----------------------------------------------------------------------------- in the pipeline


def test_the_stages_in_the_pipeline_set_advantages_and_metrics():
    from megapo.trainer.update import token_stages

    entropy = [[1.0, 1.0, 3.0, 1.0], [1.0, 1.0]]
    batch = [{"tokens": [9, 9, 1, 2, 3, 4], "prompt_len": 2, "advantage": 2.0, "old_logp": [-1.0] * 4,
              "old_entropy": entropy[0]},
             {"tokens": [9, 9, 5, 6], "prompt_len": 2, "advantage": -1.0, "old_logp": [-1.0] * 2,
              "old_entropy": entropy[1]}]
    cfg = make_cfg(stages=[{"name": "erpo", "buckets": 2}, {"name": "aepo", "window": 2, "hwe_frac": 0.125}])
    metrics = token_stages(batch, cfg, step=1, correct=[False, False])
    first = [2 * 4 / 5, 2 * 4 / 5, 2 * 8 / 5, 2 * 4 / 5]
    # aepo after erpo: windows [1, 2, 2, 1], [1, 1]; top 1 of 6: the first 2.0 (ties: both 2.0 are >= τ)
    assert batch[0]["advantage"] == pytest.approx([first[0], first[1] + 0.1, first[2] + 0.1, first[3]], rel=1e-13)
    assert batch[1]["advantage"] == pytest.approx([-1.0, -1.0], rel=1e-13)
    assert metrics["erpo/adv_shift"] == pytest.approx((0.4 + 0.4 + 1.2 + 0.4) / 6, rel=1e-13)
    assert metrics["aepo/adv_shift"] == pytest.approx(0.2 / 6, rel=1e-13)


@pytest.mark.parametrize("stages, entropy, reference", [
    ([], False, False),
    ([{"name": "polarity"}], False, False),
    ([{"name": "erpo"}], True, False),
    ([{"name": "aepo"}], True, False),
    ([{"name": "aepo", "kl_hard": 0.1}], True, True),
])
def test_the_old_log_prob_pass_keeps_the_entropy_only_for_these_stages(stages, entropy, reference):
    cfg = make_cfg(stages=stages)
    a = cfg.algorithm
    assert (a.needs_old_stats(), a.needs_old_entropy(), a.needs_reference()) == (entropy, entropy, reference)
    if not stages:
        return
    asked, sample = old_pass_request(cfg)
    assert asked == [entropy]
    assert (sample.get("old_entropy") is not None) == entropy


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("stages, field, words", [
    ([{"name": "erpo", "buckets": 0}], "algorithm.stages[0].buckets", ">= 1"),
    ([{"name": "erpo", "buckets": 2.5}], "algorithm.stages[0].buckets", "an int"),
    ([{"name": "erpo", "threshold": 0}], "algorithm.stages[0].threshold", "> 0"),
    ([{"name": "erpo", "amplify": -1}], "algorithm.stages[0].amplify", ">= 0"),
    ([{"name": "erpo", "anchor": "batch"}], "algorithm.stages[0].anchor", "sequence"),
    ([{"name": "polarity"}, {"name": "aepo", "window": 0}], "algorithm.stages[1].window", ">= 1"),
    ([{"name": "aepo", "hwe_frac": 0}], "algorithm.stages[0].hwe_frac", "> 0"),
    ([{"name": "aepo", "hwe_frac": 1.5}], "algorithm.stages[0].hwe_frac", "<= 1"),
    ([{"name": "aepo", "easy_above": 1.2}], "algorithm.stages[0].easy_above", "<= 1"),
    ([{"name": "aepo", "hard_below": 0.8}], "algorithm.stages[0].hard_below", "< 0.75"),
    ([{"name": "aepo", "bonus_hard": float("nan")}], "algorithm.stages[0].bonus_hard", "finite"),
    ([{"name": "aepo", "kl_easy": -0.1}], "algorithm.stages[0].kl_easy", ">= 0"),
    ([{"name": "aepo", "target": 3}], "algorithm.stages[0]", "unknown option"),
])
def test_bad_options_refused_at_config_time(stages, field, words):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=stages)
    assert err.value.field == field and words in str(err.value)


def test_no_sequence_advantage_under_gae_is_refused():
    for name in ("erpo", "aepo"):
        with pytest.raises(ConfigError) as err:
            make_cfg(advantage="gae", stages=[{"name": name}])
        assert err.value.field == "algorithm.stages[0]" and "sequence_advantage" in str(err.value)


def test_objectives_lists_them_with_paper_and_formula(capsys):
    from megapo.cli import main

    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    for name, words in (("erpo", "Token-Level Entropy-Regulated Policy Optimization"),
                        ("aepo", "Difficulty-Aware Token-Level Entropy Shaping")):
        row = next(line for line in out.splitlines() if line.split()[:1] == [name] and not line.startswith(" "))
        assert words in row
    assert "g_{i,t} = 1 + α·1[Ĥ_{i,t} ≥ κ]" in out and "assumption:" in out
    assert main(["objectives", "--stages"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["erpo"] == ["token", "sequence_advantage,old_entropy"]
    assert rows["aepo"] == ["token", "sequence_advantage,old_entropy,correct"]


# ----------------------------------------------------------------------------- one tiny run


def test_megapo_train_with_erpo_and_aepo(tmp_path, tiny_moe):
    """Two steps of `megapo train` (the Megatron learner on CPU) with erpo then aepo: the old-log-prob pass keeps
    π_old's entropy and both stages log their metrics."""
    rows = train_rows(tmp_path, "erpo_aepo", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "rollout.max_new_tokens=6",
                      "algorithm.stages=[{name: erpo, buckets: 2}, {name: aepo, window: 2}]")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["erpo/adv_shift"]) and math.isfinite(r["aepo/adv_shift"])
        assert math.isfinite(r["train/loss"])

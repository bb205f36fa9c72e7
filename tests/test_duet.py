"""DUET (arXiv:2605.08441): the pre-rollout allocation against a loop written out here, the surrogate's tracker and
its checkpoint round trip, the abort rule's importance weights (unbiased by enumeration), the trainer's plumbing
(per-prompt counts, Group.weights -> token_weight), refusals naming the field, and one `megapo train` step."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from megapo.algorithms.duet import (Duet, DuetOptions, abort_weights, allocate_rollouts, informativeness,
                                    marker_end, total_rollouts, undecided)
from megapo.algorithms.length import ScoredGroup, build_group_filter
from megapo.algorithms.registry import entries
from megapo.cli import main
from megapo.config import ConfigError, load_config
from megapo.engines.base import Sample
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.rollout import Group, generate_counts

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/stability_base.yaml"


# ----------------------------------------------------------------------------- (i) the allocation


def _allocation_loop(scores, total, floor):
    """The rule written out: everyone gets the floor; the spare R is shared in proportion to the scores, each share
    rounded down; the rollouts left go one at a time to the largest remaining fraction (the earlier prompt on a
    tie)."""
    spare = total - floor * len(scores)
    mass = 0.0
    for u in scores:
        mass += u
    counts, fractions = [], []
    for u in scores:
        share = spare * u / mass
        whole = int(math.floor(share))
        counts.append(floor + whole)
        fractions.append(share - whole)
    given = 0
    for c in counts:
        given += c
    taken = [False] * len(scores)
    while given < total:
        best = None
        for i in range(len(scores)):
            if not taken[i] and (best is None or fractions[i] > fractions[best]):
                best = i
        counts[best] += 1
        taken[best] = True
        given += 1
    return counts


@pytest.mark.parametrize("values, total, floor", [
    ([0.5, 0.1, 0.9, 0.0, 1.0, 0.3], 48, 2),
    ([0.5] * 7, 50, 2),  # ties: the 50 − 7·7 = 1 left over goes to the first prompt
    ([0.2, 0.8, 0.5, 0.5], 9, 2),
    ([0.0, 1.0, 0.0], 6, 2),  # nothing spare: the floor only
    ([0.3, 0.7, 0.6, 0.01, 0.99], 64, 1),
])
def test_allocation_against_the_loop_sums_to_the_budget_above_the_floor(values, total, floor):
    scores = informativeness(values, 0.01)
    assert scores == [v * (1 - v) + 0.01 for v in values]
    counts = allocate_rollouts(scores, total, floor)
    assert counts == _allocation_loop(scores, total, floor)
    assert sum(counts) == total and min(counts) >= floor


def test_ties_go_to_the_earlier_prompt_and_the_most_informative_gets_most():
    assert allocate_rollouts([1.0] * 3, 3 * 2 + 2, 2) == [3, 3, 2]
    # spare 18 by u = 0.26, 0.01, 0.01: shares 16.71, 0.64, 0.64; the 2 left: the first, then the tie's earlier one
    assert allocate_rollouts(informativeness([0.5, 0.0, 1.0], 0.01), 24, 2) == [19, 3, 2]
    assert total_rollouts(64, 8, 1.0) == 512 and total_rollouts(64, 8, 0.5) == 256
    with pytest.raises(ValueError, match="^budget:"):
        allocate_rollouts([1.0, 1.0], 3, 2)


# ----------------------------------------------------------------------------- (ii) the abort rule


def test_marker_end_and_which_responses_the_rule_judges():
    assert marker_end(["a", "\\bo", "xed{", "7", "}"], "\\boxed{") == 3
    assert marker_end(["ab", "c"], "bc") == 2 and marker_end(["x"], "y") == -1
    # H + G = 4: marker at 3 kept; marker at 5 (too late) judged; ended at 4 without one kept; 6 without one judged
    assert undecided([6, 6, 4, 6, 3], [3, 5, -1, -1, -1], 4) == [False, True, False, True, False]


def test_the_weights_are_unbiased_by_enumeration():
    """E over the abort draws of Σ_i w_i g_i equals Σ_i g_i exactly: every keep / abort pattern of the judged
    responses enumerated with its probability q^k (1 − q)^(m − k)."""
    g = [Fraction(3), Fraction(-5, 2), Fraction(7, 4), Fraction(1, 3), Fraction(-2)]
    judged = [True, False, True, True, False]
    for q in (0.25, 0.5, 0.125):
        expected = Fraction(0)
        for pattern in itertools.product([True, False], repeat=sum(judged)):
            keeps = iter(pattern)
            uniforms = [(0.0 if next(keeps) else 0.999) if j else 0.5 for j in judged]
            w = abort_weights(judged, uniforms, q)
            k = sum(pattern)
            prob = Fraction(q) ** k * (1 - Fraction(q)) ** (len(pattern) - k)
            expected += prob * sum(Fraction(x) * gi for x, gi in zip(w, g))
            assert all(x in (0.0, 1 / q) for x, j in zip(w, judged) if j)
            assert all(x == 1.0 for x, j in zip(w, judged) if not j)
        assert expected == sum(g)


# ----------------------------------------------------------------------------- the filter: tracker and resume


def _scored(key, correct, lengths, ends=None, difficulty=None):
    c = torch.tensor(correct, dtype=torch.bool)
    return ScoredGroup(key, difficulty, c.to(torch.float64), c, torch.tensor(lengths), torch.zeros(len(correct),
                       dtype=torch.bool), marker_end=None if ends is None else torch.tensor(ends))


def test_the_tracker_update_against_the_beta_rule():
    f = build_group_filter("duet", {"decay": 0.8, "prior": 0.5, "prior_count": 2.0}, 16)
    f.select([_scored("a", [1, 0, 1], [3, 3, 3])], 1)
    assert f.tracker.values["a"][:2] == [1.0 + 2, 1.0 + 1]  # α_0 = β_0 = 1, then + Σc, + Σ(1 − c)
    f.select([_scored("a", [1, 1], [3, 3])], 2)
    assert f.tracker.values["a"][:2] == pytest.approx([0.8 * 3 + 2, 0.8 * 2 + 0])
    v = (0.8 * 3 + 2) / (0.8 * 5 + 2)
    assert f.value("a", None) == pytest.approx(v)
    # a prompt not seen yet: its level's pooled tracker, else the run's (here a's verdicts alone, one visit a round)
    assert f.value("new", 3) == pytest.approx(v)
    f.select([_scored("b", [0, 0, 0, 1], [3] * 4, difficulty=3), _scored("c", [1, 1], [3] * 2, difficulty=3)], 3)
    level = (1 + 3) / (1 + 3 + 1 + 3)  # the level-3 pool's first visit: both groups' verdicts at once
    run = (0.8 * (0.8 * 3 + 2) + 3) / (0.8 * (0.8 * 5 + 2) + 6)
    assert f.value("new", 3) == pytest.approx(level) and f.value("new", 4) == pytest.approx(run)
    assert f.value("b", 3) == pytest.approx(2 / 6)
    counts = f.allocate(["a", "new", "other"], 4, [None, 3, 5])  # B = 12, floor 2: the spare 6 by u = v(1 − v) + eps
    assert counts == _allocation_loop([u * (1 - u) + 0.01 for u in (v, level, run)], 12, 2)


def test_a_group_the_aborts_leave_below_the_floor_leaves_the_round():
    f = build_group_filter("duet", {"marker": "}", "horizon": 2, "keep_prob": 1e-9}, 16)
    # H + G = 2: the first two responses run past it without a marker (aborted: q is tiny), the third has one
    kept = f.select([_scored("a", [0, 0, 1], [6, 6, 6], [-1, 5, 2]),
                     _scored("b", [0, 1, 1], [6, 2, 6], [-1, -1, 1])], 1)
    assert [k.tolist() for k in kept] == [[], [1, 2]]
    assert [w.tolist() for w in f.weights] == [[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
    assert f.metrics()["duet_groups_dropped"] == 1 and f.metrics()["duet_aborted"] == 3
    assert f.metrics()["duet_tokens_charged"] == 2 + 2 + 6 + 2 + 2 + 6  # an aborted response costs H + G
    assert f.tracker.values["a"][:2] == [1.0 + 1, 1.0 + 2]  # the aborted count as failures


def _plan(step):
    """Two rounds a step of three prompts: verdicts, lengths and marker ends that change with the step."""
    out = []
    for r in range(2):
        groups = []
        for i in range(3):
            n = 2 + (step + i + r) % 3
            correct = [(step * 7 + i * 3 + j + r) % 3 == 0 for j in range(n)]
            lengths = [4 + (step + j) % 6 for j in range(n)]
            ends = [(j % 4) + 1 if (i + j) % 3 else -1 for j in range(n)]
            groups.append(_scored(f"p{(step + i) % 5}", correct, lengths, ends))
        out.append(groups)
    return out


def _drive(f: Duet, steps) -> list:
    record = []
    for step in steps:
        for groups in _plan(step):
            record.append(f.allocate([g.prompt_key for g in groups], 3))
            kept = f.select(groups, step)
            record.append(([k.tolist() for k in kept], [w.tolist() for w in f.weights]))
    return record


def test_a_resumed_filter_allocates_and_aborts_as_the_unstopped_one():
    options = {"marker": "}", "horizon": 3, "grace": 1, "keep_prob": 0.5}
    whole = build_group_filter("duet", options, 16)
    whole.seed = 5
    first = build_group_filter("duet", options, 16)
    first.seed = 5
    record = _drive(whole, range(1, 7))
    head = _drive(first, range(1, 4))
    resumed = build_group_filter("duet", options, 16)
    resumed.seed = 5
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + _drive(resumed, range(4, 7)) == record
    assert resumed.state_dict() == whole.state_dict()
    assert any(0.0 in w for _, ws in record[1::2] for w in ws) and any(2.0 in w for _, ws in record[1::2] for w in ws)
    other = build_group_filter("duet", options, 16)
    other.seed = 6
    assert _drive(other, range(1, 7)) != record  # the draws follow train.seed
    with pytest.raises(ValueError, match="^length state: duet"):
        resumed.load_state_dict({"tracker": {}})


# ----------------------------------------------------------------------------- the trainer's side


class CharTokenizer:
    """One token per character (id = its code point); id 0 the end of sequence, no text."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 else chr(i) for i in ids)


def _sample(text, stop=True):
    ids = [ord(c) for c in text] + ([0] if stop else [])
    return Sample([1, 2], ids, [-0.1] * len(ids), "stop" if stop else "length", 0)


def _cfg(*overrides) -> RunConfig:
    return load_config(RunConfig, CONFIG, ["data.group_filter=duet", "data.dynamic_sampling=false", *overrides])


def test_the_length_stage_finds_markers_drops_aborted_and_keeps_weights():
    cfg = _cfg("data.group_filter_options={marker: '#', horizon: 2, grace: 1, keep_prob: 0.5}", "train.seed=3")
    stage = LengthStage(cfg, tokenizer=CharTokenizer())
    stage.begin_batch()
    texts = ["a#1", "abcdef", "ab", "abc#ef", "xyzuvw", "q#"]
    group = Group(Example("1+1=", "2"), [_sample(t) for t in texts], [1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    [out] = stage.apply([group])
    # judged (no '#' in the first 3 tokens, longer than 3): 'abcdef', 'abc#ef', 'xyzuvw'; each aborted or at 1/q = 2
    weights = dict(zip([texts[i] for i in out.sample_ids], out.weights))
    assert {t: weights[t] for t in ("a#1", "ab", "q#")} == {"a#1": 1.0, "ab": 1.0, "q#": 1.0}
    assert all(weights.get(t, 0.0) in (0.0, 2.0) for t in ("abcdef", "abc#ef", "xyzuvw"))
    assert len(out.samples) == len(out.weights) == len(out.sample_ids) == 3 + stage.filter.judged - stage.filter.aborted
    assert stage.metrics()["length/duet_judged"] == 3
    counts = stage.rollout_counts([Example("1+1=", "2"), Example("2+2=", "4")], 8)
    assert sum(counts) == 16 and min(counts) >= 2
    with pytest.raises(ValueError, match="^data.group_filter_options.marker"):
        LengthStage(cfg)  # the marker is found in decoded text: needs the tokenizer


def test_without_a_marker_no_weights_and_per_prompt_counts_reach_the_engine():
    stage = LengthStage(_cfg())
    stage.begin_batch()
    [out] = stage.apply([Group(Example("1+1=", "2"), [_sample("2"), _sample("3")], [1.0, 0.0])])
    assert out.weights is None and len(out.samples) == 2

    class Engine:
        def generate(self, prompts, params):
            assert params.n == 1
            self.prompts = prompts
            return [[Sample(p, [len(self.prompts)], [0.0], "stop", 0)] for p in prompts]

    from megapo.engines.base import SamplingParams

    engine = Engine()
    drawn = generate_counts(engine, SamplingParams(n=8), [[5], [6, 6], [7]], [3, 1, 2])
    assert engine.prompts == [[5], [5], [5], [6, 6], [7], [7]]
    assert [[s.prompt_ids for s in g] for g in drawn] == [[[5]] * 3, [[6, 6]], [[7]] * 2]


def test_group_weights_become_every_token_weight():
    from megapo.trainer.update import train_samples

    cfg = _cfg()
    groups = [Group(Example("1+1=", "2"), [_sample("2"), _sample("33")], [1.0, 0.0], weights=[1.0, 2.0]),
              Group(Example("2+2=", "4"), [_sample("4"), _sample("5"), _sample("44")], [1.0, 0.0, 1.0])]
    batch = train_samples(groups, cfg)
    assert [s.token_weight for s in batch] == [[1.0] * 2, [2.0] * 3, [1.0] * 2, [1.0] * 2, [1.0] * 3]
    # groups of different sizes: each group's own GRPO advantages
    assert batch[0].advantage > 0 > batch[1].advantage and batch[2].advantage == pytest.approx(batch[4].advantage)
    assert all(s.token_weight is None for s in train_samples([Group(g.example, g.samples, g.rewards)
                                                              for g in groups], cfg))


# ----------------------------------------------------------------------------- config and registry


@pytest.mark.parametrize("options, field", [
    ("{budget_scale: 0}", "data.group_filter_options.budget_scale"),
    ("{budget_scale: -1}", "data.group_filter_options.budget_scale"),
    ("{budget_scale: 0.2}", "data.group_filter_options.budget_scale"),  # 0.2 × 8 = 1.6 < 2 per prompt
    ("{min_rollouts: 0}", "data.group_filter_options.min_rollouts"),
    ("{min_rollouts: 1}", "data.group_filter_options.min_rollouts"),  # grpo compares two or more
    ("{keep_prob: 0}", "data.group_filter_options.keep_prob"),
    ("{keep_prob: 1.5}", "data.group_filter_options.keep_prob"),
    ("{marker: '#'}", "data.group_filter_options.horizon"),
    ("{marker: '#', horizon: 6, grace: 2}", "data.group_filter_options.horizon"),  # H + G >= max_new_tokens 8
    ("{horizon: 3}", "data.group_filter_options.marker"),
    ("{decay: 1.5}", "data.group_filter_options.decay"),
    ("{budget: 3}", "data.group_filter_options"),
    # the prompt-feature surrogate's (tests/test_duet_surrogate.py)
    ("{surrogate: bogus}", "data.group_filter_options.surrogate"),
    ("{surrogate: features, feature_buckets: 0}", "data.group_filter_options.feature_buckets"),
    ("{surrogate: features, feature_lr: 0}", "data.group_filter_options.feature_lr"),
    ("{surrogate: features, feature_steps: 0}", "data.group_filter_options.feature_steps"),
    ("{surrogate: features, feature_l2: -1}", "data.group_filter_options.feature_l2"),
    ("{surrogate: features, feature_count: -0.5}", "data.group_filter_options.feature_count"),
])
def test_bad_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError) as err:
        _cfg(f"data.group_filter_options={options}")
    assert err.value.field == field, str(err.value)


def test_refusals_of_the_combination_name_the_field():
    with pytest.raises(ConfigError) as err:
        _cfg("train.mode=async")
    assert err.value.field == "data.group_filter", str(err.value)
    with pytest.raises(ConfigError) as err:  # groups of different sizes: no batch-level estimator
        _cfg("algorithm.advantage=spo")
    assert err.value.field == "data.group_filter", str(err.value)
    # the round's budget below the floor: 0.1875 × 8 = 1.5 rounds to 2 per prompt, but 0.1875 × 2 × 8 = 3 < 2·2
    with pytest.raises(ConfigError) as err:
        _cfg("data.group_filter_options={budget_scale: 0.1875}", "data.prompts_per_step=2", "train.mini_batches=1")
    assert err.value.field == "data.group_filter_options.budget_scale", str(err.value)
    assert _cfg("data.group_filter_options={budget_scale: 0.5}").data.group_filter == "duet"


def test_objectives_list_it_with_its_paper_and_formula(capsys):
    assert main(["objectives", "--kind", "group_filter", "--formulas"]) == 0
    out = capsys.readouterr().out
    [e] = [e for e in entries("group_filter") if e.name == "duet"]
    assert "arXiv:2605.08441" in e.paper and "DUET: Optimize Token-Budget Allocation" in e.paper
    assert e.name in out and e.formula.splitlines()[0].strip() in out and "Assumption:" in e.formula
    assert DuetOptions().keep_prob == 0.05


def test_one_training_step_with_duet(tmp_path, tiny_moe):
    """megapo train with the allocation and the abort rule on (a one-character marker the tiny model's responses
    sometimes hold): the weights reach the learner's token_weight and the step's loss is finite."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "duet", f"model.path={tiny_moe}", "train.steps=1", "data.group_filter=duet",
                      "data.group_filter_options={marker: 'a', horizon: 1, grace: 1, keep_prob: 0.5}")
    row = rows[0]
    assert row["step"] == 1 and math.isfinite(row["train/loss"]), sorted(row)
    assert row["length/duet_rollouts_min"] >= 2 and "length/duet_aborted" in row, sorted(row)

"""Sequence-level advantage estimators drpo and canon (megapo/algorithms/subgroup_advantages.py) and length rewards
hmpo and lead (megapo/algorithms/length.py) against their formulas written out here as plain float64 loops; split
invariance where the estimator is per group (4 micro-batches x 2 DP shards == one batch); config-time refusals
naming the field; their listing in `megapo objectives`. None has a gradient path (they shape rewards or advantages
before the loss), so there is no finite-difference check."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import compute_advantages, entries
from megapo.algorithms.length import ScoredGroup, build_length_reward, check_shaped
from megapo.cli import main
from megapo.config import ConfigError, load_config

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from algorithm_configs import make_cfg  # noqa: E402

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
BUDGET = 64

# 16 prompts x 6 samples: binary and partial rewards, all-correct and all-wrong groups, tied lengths
REWARDS = [[float((p * 7 + i * 3) % 5 < 2 + p % 3) for i in range(6)] for p in range(16)]
REWARDS[3] = [1.0] * 6
REWARDS[4] = [0.0] * 6
REWARDS[5] = [0.75, 0.25, 1.0, 0.0, 0.5, 0.6]
LENGTHS = [[1 + (p * 13 + i * 29) % 60 for i in range(6)] for p in range(16)]
LENGTHS[6] = [10, 10, 20, 20, 10, 30]


def _t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def _split_equals_whole(name, **options):
    """4 micro-batches x 2 DP shards of prompts, each estimated alone, give the one-batch advantages."""
    r, lengths = _t(REWARDS), _t(LENGTHS, torch.int64)
    whole = compute_advantages(name, r, lengths=lengths, **options)
    parts = [compute_advantages(name, r[i:i + 2], lengths=lengths[i:i + 2], **options) for i in range(0, 16, 2)]
    assert torch.allclose(torch.cat(parts), whole, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- drpo


def drpo_loop(rewards, lengths, lam=0.1, max_len=0, correct_threshold=0.5):
    out = []
    for rs, ls in zip(rewards, lengths):
        n, l_max = len(rs), max_len or max(ls)
        pos = [i for i in range(n) if rs[i] >= correct_threshold]
        neg = [i for i in range(n) if rs[i] < correct_threshold]
        if not pos or not neg:
            out.append([0.0] * n)
            continue
        w = {i: math.exp((1 - ls[i] / l_max) / lam) for i in pos}
        total = sum(w.values())
        out.append([n * w[i] / total if i in w else -n / len(neg) for i in range(n)])
    return out


@pytest.mark.parametrize("opts", [{}, {"max_len": 64}, {"max_len": 64, "lam": 1.0},
                                  {"max_len": 40, "lam": 0.5, "correct_threshold": 0.6}])
def test_drpo_against_the_loop(opts):
    got = compute_advantages("drpo", _t(REWARDS), lengths=_t(LENGTHS, torch.int64), **opts)
    assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in drpo_loop(REWARDS, LENGTHS, **opts)]
    flat = compute_advantages("drpo", _t(REWARDS).flatten(), group_size=6,
                              lengths=_t(LENGTHS, torch.int64).flatten(), **opts)
    assert torch.equal(flat, got.flatten())


def test_drpo_never_pushes_a_correct_response_down():
    """The decoupling: however long, a correct response's advantage is >= 0; the incorrect ones share −n."""
    got = compute_advantages("drpo", _t(REWARDS), lengths=_t(LENGTHS, torch.int64), max_len=64)
    for rs, row in zip(REWARDS, got.tolist()):
        assert all(a >= 0 for r, a in zip(rs, row) if r >= 0.5)
        if 0 < sum(r >= 0.5 for r in rs) < len(rs):
            assert sum(a for r, a in zip(rs, row) if r < 0.5) == pytest.approx(-len(rs), rel=1e-12)
            assert sum(a for r, a in zip(rs, row) if r >= 0.5) == pytest.approx(len(rs), rel=1e-12)


def test_drpo_split_invariant():
    _split_equals_whole("drpo", max_len=64, lam=0.3)


# ----------------------------------------------------------------------------- canon


def canon_loop(rewards, lengths, mu=1.0):
    out = []
    for rs, ls in zip(rewards, lengths):
        n = len(rs)
        order = sorted(range(n), key=lambda i: (ls[i], i))
        low, high = set(order[:n // 2]), set(order[n // 2:])
        mean = {"low": sum(rs[i] for i in low) / len(low), "high": sum(rs[i] for i in high) / len(high)}
        row = []
        for i in range(n):
            own, other = ("low", "high") if i in low else ("high", "low")
            row.append(mu * (rs[i] - mean[other]) + (1 - mu) * (rs[i] - mean[own]))
        out.append(row)
    return out


@pytest.mark.parametrize("mu", [1.0, 0.3, 0.0])
@pytest.mark.parametrize("n", [6, 5, 2])
def test_canon_against_the_loop(mu, n):
    rewards, lengths = [r[:n] for r in REWARDS], [ln[:n] for ln in LENGTHS]
    got = compute_advantages("canon", _t(rewards), lengths=_t(lengths, torch.int64), mu=mu)
    assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in canon_loop(rewards, lengths, mu)]


def test_canon_halfway_is_dr_grpo_and_ties_keep_response_order():
    r, lengths = _t(REWARDS), _t(LENGTHS, torch.int64)
    assert torch.allclose(compute_advantages("canon", r, lengths=lengths, mu=0.5), compute_advantages("dr_grpo", r),
                          rtol=0, atol=1e-15)
    # lengths 10, 10, 20, 20, 10, 30: the lower half is responses 0, 1, 4 (the three 10s)
    row = compute_advantages("canon", _t([[1.0, 0.0, 0.0, 0.0, 1.0, 1.0]]),
                             lengths=_t([LENGTHS[6]], torch.int64)).tolist()[0]
    low, high = 2 / 3, 1 / 3
    assert row == pytest.approx([1 - high, -high, -low, -low, 1 - high, 1 - low], rel=1e-12)


def test_canon_split_invariant():
    _split_equals_whole("canon", mu=0.7)


@pytest.mark.parametrize("name, options", [("drpo", {"max_len": 64}), ("canon", {})])
def test_estimators_need_lengths(name, options):
    with pytest.raises(ValueError, match=rf"^lengths: {name} reads"):
        compute_advantages(name, _t(REWARDS), **options)


# ----------------------------------------------------------------------------- estimator options at config time


BAD_ESTIMATOR = [
    ("drpo", {"max_len": -1}, "max_len"), ("drpo", {"max_len": 2.5}, "max_len"), ("drpo", {"max_len": 8, "lam": 0}, "lam"),
    ("drpo", {"max_len": 8, "correct_threshold": "half"}, "correct_threshold"),
    ("canon", {"mu": 1.5}, "mu"), ("canon", {"mu": True}, "mu"), ("canon", {"metric": "entropy"}, "metric"),
    ("canon", {"metric": "tokens"}, "metric"), ("canon", {"alpha": 1.0}, "unknown option"),
    ("hapo_tga", {"fallback": 0}, "fallback"), ("hapo_tga", {"eps": "1e-6"}, "eps"),
]


@pytest.mark.parametrize("name, options, field", BAD_ESTIMATOR, ids=[f"{n}-{f}" for n, _, f in BAD_ESTIMATOR])
def test_bad_estimator_options_refused_at_config_time(name, options, field):
    with pytest.raises(ConfigError) as err:
        make_cfg(advantage=name, advantage_options=options)
    assert err.value.field == "algorithm.advantage_options", str(err.value)
    assert str(err.value.message).startswith(field), str(err.value)


def test_good_estimator_options_load():
    make_cfg(advantage="drpo", advantage_options={"max_len": 8, "lam": 0.2})
    make_cfg(advantage="canon", advantage_options={"mu": 0.5})


# ----------------------------------------------------------------------------- hmpo


def _group(key, rewards, lengths, threshold=0.5):
    return ScoredGroup(key, None, _t(rewards), _t(rewards) >= threshold, _t(lengths, torch.int64),
                       torch.zeros(len(rewards), dtype=torch.bool))


def _groups(count=16, offset=0):
    return [_group(f"p{p}", REWARDS[p], [x + offset for x in LENGTHS[p]]) for p in range(count)]


def hmpo_loop(groups, weight=0.5, max_len=BUDGET):
    out = []
    for g in groups:
        rs, ls, cs = g.rewards.tolist(), g.lengths.tolist(), g.correct.tolist()
        correct_lengths = [ln for ln, c in zip(ls, cs) if c]
        if not correct_lengths:
            out.append(rs)
            continue
        b = statistics.median(correct_lengths)
        row = []
        for r, ln in zip(rs, ls):
            if ln <= b:
                f = 1.0
            elif max_len <= b:
                f = 0.0
            else:
                f = 0.5 * (1 + math.cos(math.pi * min(1.0, (ln - b) / (max_len - b))))
            row.append(r * (1 - weight + weight * f))
        out.append(row)
    return out


@pytest.mark.parametrize("opts", [{}, {"weight": 0.8, "max_len": 40}, {"weight": 0.0}, {"max_len": 20}])
def test_hmpo_against_the_loop(opts):
    groups = _groups()
    method = build_length_reward("hmpo", opts, BUDGET)
    got = [r.tolist() for r in check_shaped(groups, method.shape(groups, 1), "hmpo")]
    assert got == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in hmpo_loop(groups, **opts)]


def test_hmpo_keeps_correctness_first_and_split_invariant():
    groups = _groups()
    method = build_length_reward("hmpo", {"weight": 0.9}, BUDGET)
    whole = method.shape(groups, 1)
    for g, r in zip(groups, whole):
        assert bool((r[g.rewards == 0] == 0).all())  # an incorrect 0/1 response stays 0 whatever its length
        assert bool((r[g.rewards == 1] >= 0.1 - 1e-15).all())
    parts = [r for i in range(0, 16, 2) for r in build_length_reward("hmpo", {"weight": 0.9}, BUDGET).shape(
        groups[i:i + 2], 1)]
    assert all(torch.equal(a, b) for a, b in zip(parts, whole))


# ----------------------------------------------------------------------------- lead


def lead_loop(calls, weight=0.5, momentum=0.5):
    """calls: lists of groups; returns the shaped rewards of every call and the efficiency weights."""
    targets, shaped, weights = {}, [], []
    for groups in calls:
        rates = [sum(g.correct.tolist()) / g.size for g in groups]
        instability = sum(4 * p * (1 - p) for p in rates) / len(rates)
        lam = weight * (1 - instability * (1 - sum(rates) / len(rates)))
        weights.append(lam)
        out = []
        for g in groups:
            rs, ls, cs = g.rewards.tolist(), g.lengths.tolist(), g.correct.tolist()
            correct_lengths = [ln for ln, c in zip(ls, cs) if c]
            if correct_lengths:
                s = max(min(correct_lengths), 1)
                t = targets.get(g.prompt_key)
                targets[g.prompt_key] = s if t is None else (1 - momentum) * t + momentum * s
            t = targets.get(g.prompt_key)
            out.append([r + lam * max(-1.0, 1 - abs(ln - t) / t) if (t is not None and c) else r
                        for r, ln, c in zip(rs, ls, cs)])
        shaped.append(out)
    return shaped, weights


def _lead_calls():
    return [_groups(8), _groups(16, offset=3)[4:], _groups(6, offset=-1)]


@pytest.mark.parametrize("opts", [{}, {"weight": 1.5, "momentum": 0.2}, {"momentum": 1.0}])
def test_lead_against_the_loop_over_three_calls(opts):
    calls = _lead_calls()
    method = build_length_reward("lead", opts, BUDGET)
    want, weights = lead_loop(calls, **opts)
    for step, (groups, rows, lam) in enumerate(zip(calls, want, weights), start=1):
        got = [r.tolist() for r in check_shaped(groups, method.shape(groups, step), "lead")]
        assert got == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in rows]
        assert method.metrics()["efficiency_weight"] == pytest.approx(lam, rel=1e-12)


def test_lead_state_round_trip_and_order():
    """A resumed run (targets through JSON) shapes as the unstopped one; the groups' order does not matter (the
    weight is a batch statistic of the call, so the call's split does: lead is batch-level, like laconic)."""
    calls = _lead_calls()
    unstopped = build_length_reward("lead", {}, BUDGET)
    unstopped.shape(calls[0], 1)
    resumed = build_length_reward("lead", {}, BUDGET)
    resumed.load_state_dict(json.loads(json.dumps(unstopped.state_dict())))
    a, b = unstopped.shape(calls[1], 2), resumed.shape(list(reversed(calls[1])), 2)
    assert all(torch.equal(x, y) for x, y in zip(a, reversed(b)))
    with pytest.raises(ValueError, match="length state: lead"):
        resumed.load_state_dict({"targets": {"p0": -1}})


# ----------------------------------------------------------------------------- length options at config time


@pytest.mark.parametrize("name, options, message", [
    ("hmpo", {"weight": 1.0}, "weight: must be < 1"), ("hmpo", {"weight": -0.1}, "weight:"),
    ("hmpo", {"max_len": 2.5}, "max_len:"), ("lead", {"weight": float("inf")}, "weight:"),
    ("lead", {"momentum": 0}, "momentum:"), ("lead", {"momentum": 1.5}, "momentum:"),
    ("lead", {"target": 10}, "options: unknown option(s) ['target']"),
])
def test_bad_length_options_name_the_option(name, options, message):
    with pytest.raises(ValueError) as err:
        build_length_reward(name, options, BUDGET)
    assert str(err.value).startswith(message), str(err.value)


@pytest.mark.parametrize("overrides", [("data.length_reward=hmpo", "data.length_reward_options={weight: 1.0}"),
                                       ("data.length_reward=lead", "data.length_reward_options={momentum: 0}")])
def test_bad_length_options_refused_at_config_time(overrides):
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, ROOT / "megapo/configs/length_base.yaml", ["rollout.n_samples=4", *overrides])
    assert err.value.field == "data.length_reward_options", err.value


# ----------------------------------------------------------------------------- listing


def test_listed_with_paper_formula_and_assumptions(capsys):
    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    by_name = {(e.kind, e.name): e for e in entries()}
    for key in (("advantage", "drpo"), ("advantage", "canon"), ("length_reward", "hmpo"), ("length_reward", "lead")):
        e = by_name[key]
        assert e.paper in out and "arXiv:" in e.paper, key
        assert e.formula.splitlines()[0].strip() in out and "Assumption:" in e.formula, key
        for option in e.option_names():
            assert option in out

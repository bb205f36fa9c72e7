"""Advantage estimators, KL estimators and length shaping vs formulas written out here."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megapo.algorithms import compute_advantages, kl_penalty, shape_rewards

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.25, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_grpo():
    a = compute_advantages("grpo", _t(REWARDS), eps=1e-6)
    for g, row in zip(REWARDS, a.tolist()):
        mu, sd = statistics.mean(g), statistics.stdev(g)
        assert row == pytest.approx([(r - mu) / (sd + 1e-6) for r in g], rel=1e-12)


def test_grpo_flat_with_group_size_and_population_std():
    flat = [x for g in REWARDS for x in g]
    a = compute_advantages("grpo", _t(flat), group_size=4, unbiased=False, eps=0.0)
    expected = [(r - statistics.mean(g)) / statistics.pstdev(g) for g in REWARDS for r in g]
    assert a.tolist() == pytest.approx(expected, rel=1e-12)


def test_dr_grpo():
    a = compute_advantages("dr_grpo", _t(REWARDS))
    for g, row in zip(REWARDS, a.tolist()):
        assert row == pytest.approx([r - sum(g) / len(g) for r in g], rel=1e-12)


def test_rloo():
    a = compute_advantages("rloo", _t(REWARDS))
    for g, row in zip(REWARDS, a.tolist()):
        expected = [g[i] - sum(g[j] for j in range(len(g)) if j != i) / (len(g) - 1) for i in range(len(g))]
        assert row == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_reinforce_pp_baseline():
    a = compute_advantages("reinforce_pp_baseline", _t(REWARDS), eps=1e-8)
    centred = [r - statistics.mean(g) for g in REWARDS for r in g]
    mu, sd = statistics.mean(centred), statistics.stdev(centred)
    assert [x for row in a.tolist() for x in row] == pytest.approx(
        [(c - mu) / (sd + 1e-8) for c in centred], rel=1e-10, abs=1e-12)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: compute_advantages("nope", _t(REWARDS)), "name"),
        (lambda: compute_advantages("grpo", _t([1.0, 2.0, 3.0]), group_size=2), "group_size"),
        (lambda: compute_advantages("grpo", _t([1.0, 2.0]),), "group_size"),
        (lambda: compute_advantages("grpo", _t([[1.0], [2.0]])), "group_size"),
        (lambda: compute_advantages("grpo", _t([[1.0, float("nan")]])), "rewards"),
        (lambda: compute_advantages("rloo", _t(REWARDS), eps=1.0), "options"),
        (lambda: compute_advantages("grpo", _t(REWARDS), group_size=3), "group_size"),
    ],
)
def test_advantage_bad_input(call, argument):
    with pytest.raises(ValueError, match=rf"^{argument}"):
        call()


def test_kl_estimators():
    lp = [-0.5, -1.2, -2.0, -0.1]
    ref = [-0.7, -1.0, -2.5, -0.1]
    k1 = kl_penalty(_t(lp), _t(ref), "k1").tolist()
    k2 = kl_penalty(_t(lp), _t(ref), "k2").tolist()
    k3 = kl_penalty(_t(lp), _t(ref), "k3").tolist()
    for i, (a, b) in enumerate(zip(lp, ref)):
        assert k1[i] == pytest.approx(a - b)
        assert k2[i] == pytest.approx(0.5 * (a - b) ** 2)
        assert k3[i] == pytest.approx(math.exp(b - a) - (b - a) - 1)
        assert k3[i] >= 0


def test_kl_estimators_are_unbiased_for_categorical():
    """k1 and k3 averaged over exact samples y ~ p give KL(p‖q) (sum over a small vocabulary)."""
    p = [0.5, 0.3, 0.2]
    q = [0.2, 0.5, 0.3]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    lp, lq = _t([math.log(x) for x in p]), _t([math.log(x) for x in q])
    for est in ("k1", "k3"):
        assert (kl_penalty(lp, lq, est) * _t(p)).sum().item() == pytest.approx(kl, rel=1e-12)
    with pytest.raises(ValueError, match="^kl_estimator"):
        kl_penalty(lp, lq, "k4")
    with pytest.raises(ValueError, match="^ref_logp"):
        kl_penalty(lp, lq[:2], "k1")


def test_dapo_overlong():
    L_max, L_cache = 20, 8
    lengths = [0, 5, 12, 13, 16, 19, 20, 21, 40]
    rewards = [1.0] * len(lengths)
    out = shape_rewards("dapo_overlong", _t(rewards), torch.tensor(lengths), max_len=L_max, cache_len=L_cache)

    def penalty(L):
        if L <= L_max - L_cache:
            return 0.0
        if L <= L_max:
            return ((L_max - L_cache) - L) / L_cache
        return -1.0

    assert out.tolist() == pytest.approx([1.0 + penalty(L) for L in lengths])
    assert out[6].item() == pytest.approx(0.0)  # exactly -1 at L_max
    with pytest.raises(ValueError, match="^cache_len"):
        shape_rewards("dapo_overlong", _t(rewards), torch.tensor(lengths), max_len=20, cache_len=30)
    with pytest.raises(ValueError, match="^max_len"):
        shape_rewards("dapo_overlong", _t(rewards), torch.tensor(lengths), cache_len=3)


def test_length_penalty():
    out = shape_rewards("length_penalty", _t([1.0, 0.0]), torch.tensor([10, 30]), coef=0.01)
    assert out.tolist() == pytest.approx([1.0 - 0.1, -0.3])
    out = shape_rewards("length_penalty", _t([1.0, 0.0]), torch.tensor([10, 30]), coef=0.5, max_len=40)
    assert out.tolist() == pytest.approx([1.0 - 0.125, -0.375])
    with pytest.raises(ValueError, match="^lengths"):
        shape_rewards("length_penalty", _t([1.0, 0.0]), torch.tensor([10]), coef=0.5)

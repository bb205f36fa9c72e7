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


def test_reinforce_pp_baseline_whitened_over_responses():
    a = compute_advantages("reinforce_pp_baseline", _t(REWARDS), eps=1e-8, whiten="response", unbiased=True)
    centred = [r - statistics.mean(g) for g in REWARDS for r in g]
    mu, sd = statistics.mean(centred), statistics.stdev(centred)
    assert [x for row in a.tolist() for x in row] == pytest.approx(
        [(c - mu) / (sd + 1e-8) for c in centred], rel=1e-10, abs=1e-12)


LENGTHS = [[3, 1, 7, 2], [5, 5, 1, 4], [2, 9, 3, 6]]  # response tokens of each sample of REWARDS


def test_reinforce_pp_baseline_whitens_over_tokens_by_default():
    """OpenRLHF's reinforce_baseline: the group-centred return sits on every response token, and the
    tokens of the whole batch are whitened (population variance): a response counts once per token."""
    a = compute_advantages("reinforce_pp_baseline", _t(REWARDS), lengths=torch.tensor(LENGTHS), eps=0.0)
    centred = [[r - statistics.mean(g) for r in g] for g in REWARDS]
    tokens = [c for row, lens in zip(centred, LENGTHS) for c, n in zip(row, lens) for _ in range(n)]
    mu, sd = statistics.mean(tokens), statistics.pstdev(tokens)
    assert a.flatten().tolist() == pytest.approx([(c - mu) / sd for row in centred for c in row], rel=1e-12)
    by_response = compute_advantages("reinforce_pp_baseline", _t(REWARDS), eps=0.0, whiten="response")
    assert not torch.allclose(a, by_response)  # the lengths matter: the two forms differ here
    flat = compute_advantages("reinforce_pp_baseline", _t(REWARDS).flatten(), group_size=4,
                              lengths=torch.tensor(LENGTHS).flatten(), eps=0.0)
    assert torch.allclose(flat, a.flatten(), rtol=1e-12, atol=0)


def test_token_whitening_needs_lengths():
    with pytest.raises(ValueError, match=r"^lengths: .*whiten='response'"):
        compute_advantages("reinforce_pp_baseline", _t(REWARDS))
    with pytest.raises(ValueError, match=r"^lengths: expected the rewards' shape"):
        compute_advantages("reinforce_pp_baseline", _t(REWARDS), lengths=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match=r"^whiten"):
        compute_advantages("reinforce_pp_baseline", _t(REWARDS), lengths=torch.tensor(LENGTHS), whiten="batch")


# Why each estimator needs two samples per prompt: grpo divides by the std of the group (undefined for
# one sample), rloo by n-1 (no sample left out), dr_grpo and reinforce_pp_baseline subtract the group
# mean (one sample is its own baseline: every advantage 0, nothing to learn); drpo and canon compare two
# subgroups of the group (correct vs incorrect, shorter vs longer half), each needing a response.
MIN_GROUP = {"grpo": 2, "rloo": 2, "dr_grpo": 2, "reinforce_pp_baseline": 2, "riskpo": 2, "drpo": 2, "canon": 2,
             "hapo_tga": 2}


@pytest.mark.parametrize("name", sorted(MIN_GROUP))
def test_group_of_one_is_one_rule_in_one_place(name, tmp_path, tiny_moe):
    """compute_advantages and the run config refuse the same group sizes: the registry's min_group."""
    from megapo.algorithms import entries
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    # a new estimator must say its minimum; the group-free ones (spo: tests/test_spo.py) need one sample
    assert {e.name for e in entries("advantage")} == set(MIN_GROUP) | {"spo"}
    need = MIN_GROUP[name]
    rewards = _t([[1.0, 0.0, 0.5][:need - 1]] * 3)
    with pytest.raises(ValueError, match=rf"^group_size: {name} needs at least {need} samples per group, got 1"):
        compute_advantages(name, rewards, lengths=torch.ones(rewards.shape, dtype=torch.long))
    ok = compute_advantages(name, _t(REWARDS)[:, :need], lengths=torch.tensor(LENGTHS)[:, :need])
    assert bool(torch.isfinite(ok).all())

    def config(n: int):
        return load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition",
                                             f"algorithm.advantage={name}", f"rollout.n_samples={n}",
                                             "data.dynamic_sampling=false", f"train.output_dir={tmp_path / 'run'}"])

    with pytest.raises(ConfigError) as err:
        config(need - 1)
    assert err.value.field == "rollout.n_samples" and f"n_samples >= {need}, got {need - 1}" in str(err.value)
    assert config(need).rollout.n_samples == need


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


def test_hapo_token_group_average_weighs_each_token():
    """HAPO's Token Level Group Average: the group's mean and population std over its response tokens (a response of
    L tokens counts L times), written out as a loop over the tokens; the third group has one long outlier whose
    |A| reaches the fallback, so it takes GRPO's advantages (the authors' code)."""
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.25, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    lengths = [[3, 9, 2, 5], [4, 4, 1, 7], [30, 30, 30, 1]]
    a = compute_advantages("hapo_tga", _t(rewards), lengths=torch.tensor(lengths), eps=1e-6, fallback=5.0)
    for g, ls, row in zip(rewards, lengths, a.tolist()):
        tokens = [r for r, n in zip(g, ls) for _ in range(n)]
        mu, sd = statistics.mean(tokens), statistics.pstdev(tokens)
        tga = [(r - mu) / (sd + 1e-6) for r in g]
        want = tga if max(abs(x) for x in tga) < 5.0 else [(r - statistics.mean(g)) / (statistics.stdev(g) + 1e-6)
                                                             for r in g]
        assert row == pytest.approx(want, rel=1e-12)
    assert a[2].tolist() == pytest.approx([(r - 0.25) / (0.5 + 1e-6) for r in rewards[2]], rel=1e-12)  # fell back
    assert abs(a[0, 1].item() - a[0, 2].item()) < 1e-12  # equal rewards, equal advantages: the lengths only weigh


@pytest.mark.parametrize("opts, field", [({"fallback": 0}, "fallback"), ({"eps": -1.0}, "eps"),
                                          ({"fallback": float("inf")}, "fallback")])
def test_hapo_token_group_average_refuses_bad_options(opts, field):
    with pytest.raises(ValueError, match=field):
        compute_advantages("hapo_tga", _t(REWARDS), lengths=torch.ones(3, 4), **opts)
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages("hapo_tga", _t(REWARDS))

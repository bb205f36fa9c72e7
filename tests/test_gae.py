"""GAE, VAPO's decoupled and length-adaptive λ and the clipped value loss against loops written from the formulas
in float64 (megapo/algorithms/gae.py)."""

from __future__ import annotations

import pytest
import torch

from megapo.algorithms.gae import clipped_value_loss, decoupled_gae, gae, length_adaptive_lambda


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 3, 7]
    T = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.float64)
    rewards = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * mask
    return rewards, values, mask, lengths


def loop_gae(rewards, values, lengths, gamma, lams):
    """A_t = Σ_{l=0}^{n-1-t} (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} - V_t, V_n = 0."""
    adv = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        lam = float(lams[b]) if hasattr(lams, "__len__") else lams
        delta = [float(rewards[b, t]) + gamma * (float(values[b, t + 1]) if t + 1 < n else 0.0) - float(values[b, t])
                 for t in range(n)]
        for t in range(n):
            adv[b, t] = sum((gamma * lam) ** l * delta[t + l] for l in range(n - t))
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_sum_written_out(gamma, lam):
    rewards, values, mask, lengths = batch()
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv = loop_gae(rewards, values, lengths, gamma, lam)
    assert torch.allclose(adv, want_adv, atol=1e-12)
    assert torch.allclose(ret, (want_adv + values) * mask, atol=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_lambda_one_gives_monte_carlo_returns_and_lambda_zero_td():
    rewards, values, mask, lengths = batch(1)
    _, ret = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    for b, n in enumerate(lengths):  # R_t = Σ γ^l r_{t+l}: the values cancel
        for t in range(n):
            mc = sum(0.9 ** l * float(rewards[b, t + l]) for l in range(n - t))
            assert abs(float(ret[b, t]) - mc) < 1e-12
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.0)
    b, t = 0, 2
    assert abs(float(adv[b, t]) - (float(rewards[b, t]) + 0.9 * float(values[b, t + 1]) - float(values[b, t]))) < 1e-12


def test_decoupled_gae_uses_each_lambda_for_its_side():
    rewards, values, mask, lengths = batch(2)
    policy, critic = decoupled_gae(rewards, values, mask, gamma=1.0, lam_policy=0.9, lam_critic=1.0)
    want_policy = loop_gae(rewards, values, lengths, 1.0, 0.9)
    want_critic_adv = loop_gae(rewards, values, lengths, 1.0, 1.0)
    assert torch.allclose(policy, want_policy, atol=1e-12)
    assert torch.allclose(critic, (want_critic_adv + values) * mask, atol=1e-12)


def test_length_adaptive_lambda_per_row():
    rewards, values, mask, lengths = batch(3)
    lams = length_adaptive_lambda(torch.tensor(lengths), alpha=0.5)
    assert torch.allclose(lams, torch.tensor([1 - 1 / (0.5 * n) for n in lengths], dtype=torch.float64))
    lams = lams.clamp(min=0.0)
    adv, _ = gae(rewards, values, mask, 1.0, lams)
    want = loop_gae(rewards, values, lengths, 1.0, lams)
    assert torch.allclose(adv, want, atol=1e-12)


def test_clipped_value_loss_matches_its_formula():
    g = torch.Generator().manual_seed(4)
    values, old, returns = (torch.randn(3, 6, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2], dtype=torch.float64)
    eps = 0.2
    total, count = 0.0, 0
    for b in range(3):
        for t in range(6):
            if mask[b, t]:
                v, vo, r = float(values[b, t]), float(old[b, t]), float(returns[b, t])
                vc = vo + min(max(v - vo, -eps), eps)
                total += 0.5 * max((v - r) ** 2, (vc - r) ** 2)
                count += 1
    assert abs(float(clipped_value_loss(values, old, returns, mask, eps)) - total / count) < 1e-12
    unclipped = 0.5 * float((((values - returns) ** 2) * mask).sum() / mask.sum())
    assert abs(float(clipped_value_loss(values, old, returns, mask, 0.0)) - unclipped) < 1e-12


def test_bad_inputs_name_the_argument():
    rewards, values, mask, _ = batch()
    with pytest.raises(ValueError, match="gamma"):
        gae(rewards, values, mask, gamma=1.5)
    with pytest.raises(ValueError, match="lambda"):
        gae(rewards, values, mask, lam=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        gae(rewards[:, :3], values, mask)

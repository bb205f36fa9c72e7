"""Generalized advantage estimation and the critic's clipped value loss, on padded [B, T] response tokens.

    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    policy_adv, critic_returns = decoupled_gae(rewards, values, mask, lam_policy=..., lam_critic=1.0)   # VAPO
    loss = clipped_value_loss(values, old_values, returns, mask, clip=0.2)

Token t of row b is a response token where mask[b, t] is 1; rows are right-padded (mask 1...1 0...0). The value
after a row's last token is 0 (the episode ends there). Rewards are per token: an outcome reward sits on the last
token, dense (process or per-token) rewards elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Schulman et al. 2016, High-Dimensional Continuous Control Using Generalized Advantage Estimation
    (arXiv:1506.02438). δ_t = r_t + γ·V_{t+1} − V_t (V after the last token 0); A_t = Σ_l (γλ)^l · δ_{t+l} over the
    row's remaining tokens, i.e. A_t = δ_t + γλ·A_{t+1}; returns R_t = A_t + V_t (the critic's target). Returns
    (advantages, returns), 0 at padding. `lam`: a number, or one per row ([B], e.g. length_adaptive_lambda)."""
    _check(rewards, values, mask, gamma, lam)
    lam = torch.as_tensor(lam, dtype=values.dtype, device=values.device)
    m = mask.to(values.dtype)
    v = values * m
    next_v = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)  # 0 past the end: padding holds 0
    delta = (rewards + gamma * next_v - v) * m
    adv = torch.zeros_like(delta)
    running = delta.new_zeros(delta.shape[0])
    for t in range(delta.shape[1] - 1, -1, -1):  # the recursion runs backwards over time
        running = delta[:, t] + gamma * lam * running * m[:, t]
        adv[:, t] = running
    adv = adv * m
    return adv, (adv + v) * m


def decoupled_gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam_policy: float = 0.95,
                  lam_critic: float = 1.0) -> tuple[Tensor, Tensor]:
    """Yuan et al. 2025, VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning Tasks
    (arXiv:2504.05118), decoupled GAE: the policy's advantages from GAE with λ_policy, the critic's targets from
    GAE with λ_critic (1.0: Monte-Carlo returns, unbiased for the long-horizon value). Returns (policy advantages,
    critic returns)."""
    policy_adv, _ = gae(rewards, values, mask, gamma, lam_policy)
    _, critic_returns = gae(rewards, values, mask, gamma, lam_critic)
    return policy_adv, critic_returns


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's length-adaptive GAE: λ_policy = 1 − 1/(α·l) for a response of l tokens (so that Σ (γλ)^t stays
    near α·l; long responses keep their late rewards)."""
    if alpha <= 0:
        raise ValueError(f"alpha: must be > 0, got {alpha}")
    return 1.0 - 1.0 / (alpha * lengths.clamp(min=1).to(torch.float64))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.2) -> Tensor:
    """PPO's clipped value loss (Schulman et al. 2017, arXiv:1707.06347; as in OpenAI baselines): per token
    L_t = ½·max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, −ε, ε) − R_t)²), averaged over the masked tokens;
    clip ≤ 0 turns clipping off (½·(V − R)²)."""
    m = mask.to(values.dtype)
    plain = (values - returns) ** 2
    if clip > 0:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        plain = torch.maximum(plain, clipped)
    return 0.5 * (plain * m).sum() / m.sum().clamp(min=1)


def _check(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam) -> None:
    if rewards.shape != values.shape or mask.shape != values.shape:
        raise ValueError(f"rewards {list(rewards.shape)}, values {list(values.shape)} and mask {list(mask.shape)} "
                         "must have one shape [B, T]")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: must be in [0, 1], got {gamma}")
    lam_t = torch.as_tensor(lam, dtype=torch.float64)
    if bool(((lam_t < 0) | (lam_t > 1)).any()):
        raise ValueError(f"lambda: must be in [0, 1], got {lam}")

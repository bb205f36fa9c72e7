"""KL estimators between two log-prob tensors, and the entropy bonus.

With samples y ~ π (the policy that generated them) and log r = log π_ref(y) - log π(y):
  k1 = -log r                 (unbiased for KL(π‖π_ref), can be negative)
  k2 = ½·(log r)²             (biased, low variance; its gradient is that of the reverse KL)
  k3 = (r - 1) - log r        (unbiased, always >= 0)
Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html).

Used as a loss term: `policy_loss(..., ref_logp=..., kl_coef=0.001, kl_estimator="k3")`;
as a reward penalty: `reward - beta * kl_penalty(logp, ref_logp, "k1").sum(-1)` (detached).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register

_PAPER = "Schulman 2020, Approximating KL divergence (blog, joschu.net/blog/kl-approx.html)"


@register("k1", "kl", "token", _PAPER)
def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π(y) - log π_ref(y)."""
    return logp - ref_logp


@register("k2", "kl", "token", _PAPER)
def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½·(log π(y) - log π_ref(y))²."""
    return 0.5 * (logp - ref_logp) ** 2


@register("k3", "kl", "token", _PAPER)
def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@register("entropy", "kl", "token", "Williams & Peng 1991, entropy regularisation")
def entropy_bonus(entropy: Tensor) -> Tensor:
    """bonus_t = -H_t as a loss term (minimising it raises entropy); scaled by entropy_coef."""
    return -entropy


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate `estimator` in ("k1", "k2", "k3"); same shape as the inputs."""
    if estimator == "entropy":
        raise ValueError("kl_estimator: 'entropy' is not a KL estimator; choose k1, k2 or k3")
    fn = get("kl", estimator, argument="kl_estimator").fn
    if not isinstance(logp, Tensor) or not isinstance(ref_logp, Tensor):
        raise ValueError("logp/ref_logp: expected torch.Tensors")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp: shape {tuple(ref_logp.shape)} does not match logp's {tuple(logp.shape)}")
    return fn(logp, ref_logp)

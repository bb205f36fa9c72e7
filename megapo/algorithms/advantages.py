"""Advantage estimators over groups of n responses per prompt.

Input: rewards [P, n] (P prompts, n samples each) or flat [P·n] with `group_size=n`, samples of a
prompt contiguous. Output: one advantage per response, same shape as the input; the caller
broadcasts it over the response's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register


@dataclass
class StdOptions:
    eps: float = 1e-6
    unbiased: bool = True  # std with n-1 (torch.std's default)


@dataclass
class NoOptions:
    pass


@register("grpo", "advantage", "group", "Shao et al. 2024, DeepSeekMath / GRPO (arXiv:2402.03300)", StdOptions)
def grpo(r: Tensor, o: StdOptions) -> Tensor:
    """A_i = (R_i - mean_g(R)) / (std_g(R) + eps) within each group g."""
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True, unbiased=o.unbiased) + o.eps)


@register("dr_grpo", "advantage", "group", "Liu et al. 2025, Dr. GRPO (arXiv:2503.20783)", NoOptions)
def dr_grpo(r: Tensor, o: NoOptions) -> Tensor:
    """A_i = R_i - mean_g(R)  (no division by the std)."""
    return r - r.mean(-1, keepdim=True)


@register(
    "rloo", "advantage", "group",
    "Ahmadian et al. 2024, Back to Basics: REINFORCE-style optimization (RLOO, arXiv:2402.14740)",
    NoOptions,
)
def rloo(r: Tensor, o: NoOptions) -> Tensor:
    """A_i = R_i - (1/(n-1))·Σ_{j≠i} R_j  (leave-one-out baseline)."""
    n = r.shape[-1]
    return r - (r.sum(-1, keepdim=True) - r) / (n - 1)


@register(
    "reinforce_pp_baseline", "advantage", "batch",
    "Hu et al. 2025, REINFORCE++ (arXiv:2501.03262), with group-mean baseline",
    StdOptions,
)
def reinforce_pp_baseline(r: Tensor, o: StdOptions) -> Tensor:
    """A'_i = R_i - mean_g(R); then whiten over the whole batch: A_i = (A'_i - mean(A'))/(std(A') + eps)."""
    a = r - r.mean(-1, keepdim=True)
    return (a - a.mean()) / (a.std(unbiased=o.unbiased) + o.eps)


_MIN_GROUP = {"grpo": 2, "rloo": 2}


def compute_advantages(name: str, rewards: Tensor, *, group_size: int | None = None, **options) -> Tensor:
    """Advantages of estimator `name` for `rewards` ([P, n], or flat [P·n] with group_size)."""
    entry = get("advantage", name)
    opts = entry.make_options(options)
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards: expected a floating torch.Tensor")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: NaN or inf")
    shape = rewards.shape
    if rewards.dim() == 1:
        if group_size is None or not isinstance(group_size, int) or group_size < 1:
            raise ValueError("group_size: a positive int is required for flat [P*n] rewards")
        if rewards.numel() % group_size:
            raise ValueError(f"group_size: {group_size} does not divide the {rewards.numel()} rewards")
        grouped = rewards.view(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size: {group_size} differs from rewards.shape[1] = {rewards.shape[1]}")
        grouped = rewards
    else:
        raise ValueError(f"rewards: expected [P, n] or [P*n], got shape {tuple(shape)}")
    if grouped.shape[1] < _MIN_GROUP.get(name, 1) or grouped.numel() < 2 and name == "reinforce_pp_baseline":
        raise ValueError(f"group_size: {name} needs at least 2 samples per group, got {grouped.shape[1]}")
    return entry.fn(grouped, opts).reshape(shape)

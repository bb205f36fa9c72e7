"""Advantage estimators over groups of n responses per prompt.

Input: rewards [P, n] (P prompts, n samples each) or flat [P·n] with `group_size=n`, samples of a
prompt contiguous; `lengths` (response tokens per sample, same shape) for estimators that weigh
tokens. Output: one advantage per response, same shape as the input; the caller broadcasts it over
the response's tokens. Each estimator registers `min_group`, the fewest samples per prompt it is
defined for; compute_advantages refuses fewer, and the run config asks the same number.
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


WHITEN = ("token", "response")


@dataclass
class WhitenOptions:
    eps: float = 1e-6
    unbiased: bool = False  # population std, as OpenRLHF's token whitening
    whiten: str = "token"  # token: each response weighted by its length (OpenRLHF); response: each once

    def __post_init__(self):
        if self.whiten not in WHITEN:
            raise ValueError(f"whiten: must be one of {', '.join(WHITEN)}, got {self.whiten!r}")


@register("grpo", "advantage", "group", "Shao et al. 2024, DeepSeekMath / GRPO (arXiv:2402.03300)", StdOptions,
          min_group=2)  # the std of one sample is undefined
def grpo(r: Tensor, o: StdOptions, lengths: Tensor | None) -> Tensor:
    """A_i = (R_i - mean_g(R)) / (std_g(R) + eps) within each group g."""
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True, unbiased=o.unbiased) + o.eps)


@register("dr_grpo", "advantage", "group", "Liu et al. 2025, Dr. GRPO (arXiv:2503.20783)", NoOptions,
          min_group=2)  # one sample is its own baseline: every advantage 0
def dr_grpo(r: Tensor, o: NoOptions, lengths: Tensor | None) -> Tensor:
    """A_i = R_i - mean_g(R)  (no division by the std)."""
    return r - r.mean(-1, keepdim=True)


@register(
    "rloo", "advantage", "group",
    "Ahmadian et al. 2024, Back to Basics: REINFORCE-style optimization (RLOO, arXiv:2402.14740)",
    NoOptions, min_group=2,  # no one left out to be the baseline
)
def rloo(r: Tensor, o: NoOptions, lengths: Tensor | None) -> Tensor:
    """A_i = R_i - (1/(n-1))·Σ_{j≠i} R_j  (leave-one-out baseline)."""
    n = r.shape[-1]
    return r - (r.sum(-1, keepdim=True) - r) / (n - 1)


@register(
    "reinforce_pp_baseline", "advantage", "batch",
    "Hu et al. 2025, REINFORCE++ (arXiv:2501.03262), with group-mean baseline; whiten='token' as its "
    "authors' OpenRLHF (reinforce_baseline)",
    WhitenOptions, min_group=2,  # the group-mean baseline of one sample is itself: every advantage 0
)
def reinforce_pp_baseline(r: Tensor, o: WhitenOptions, lengths: Tensor | None) -> Tensor:
    """A'_i = R_i - mean_g(R); then whiten over the batch: A_i = (A'_i - m)/(s + eps), where m and s
    are the mean and std of A' over every response token (whiten="token", default: response i counts
    |y_i| times, OpenRLHF's masked whitening) or over the responses (whiten="response": each once);
    unbiased: s with N-1."""
    a = r - r.mean(-1, keepdim=True)
    if o.whiten == "response":
        return (a - a.mean()) / (a.std(unbiased=o.unbiased) + o.eps)
    if lengths is None:
        raise ValueError("lengths: reinforce_pp_baseline whitens over tokens (whiten='token'): pass each "
                         "response's token count, or whiten='response'")
    w = lengths.to(a.dtype)
    n = w.sum()
    mean = (w * a).sum() / n
    var = (w * (a - mean) ** 2).sum() / (n - 1 if o.unbiased else n)
    return (a - mean) / (var.sqrt() + o.eps)


def compute_advantages(name: str, rewards: Tensor, *, group_size: int | None = None, lengths: Tensor | None = None,
                       **options) -> Tensor:
    """Advantages of estimator `name` for `rewards` ([P, n], or flat [P·n] with group_size); `lengths`:
    response tokens per sample, shaped like `rewards` (used by token-weighted estimators)."""
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
    if grouped.shape[1] < entry.min_group:
        raise ValueError(f"group_size: {name} needs at least {entry.min_group} samples per group, got "
                         f"{grouped.shape[1]}")
    return entry.fn(grouped, opts, _lengths(lengths, shape, grouped.shape)).reshape(shape)


def _lengths(lengths, shape, grouped_shape) -> Tensor | None:
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths)
    if tuple(lengths.shape) != tuple(shape):
        raise ValueError(f"lengths: expected the rewards' shape {tuple(shape)}, got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()):
        raise ValueError("lengths: every response has at least one token")
    return lengths.reshape(grouped_shape)

"""Length shaping: reward transforms applied per response before advantages are computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register


@dataclass
class OverlongOptions:
    max_len: int = 0  # L_max, the generation budget (required)
    cache_len: int = 0  # L_cache, width of the soft interval (required)
    factor: float = 1.0  # penalty at L_max

    def __post_init__(self):
        if not (isinstance(self.max_len, int) and self.max_len > 0):
            raise ValueError(f"max_len: must be a positive int, got {self.max_len!r}")
        if not (isinstance(self.cache_len, int) and 0 < self.cache_len <= self.max_len):
            raise ValueError(f"cache_len: must be an int in (0, max_len], got {self.cache_len!r}")


@dataclass
class LengthOptions:
    coef: float = 0.0  # penalty per token (or per max_len when given)
    max_len: int | None = None

    def __post_init__(self):
        if self.max_len is not None and not (isinstance(self.max_len, int) and self.max_len > 0):
            raise ValueError(f"max_len: must be a positive int, got {self.max_len!r}")


@register(
    "dapo_overlong", "shaping", "sequence",
    "Yu et al. 2025, DAPO (arXiv:2503.14476), soft overlong punishment",
    OverlongOptions,
)
def dapo_overlong(rewards: Tensor, lengths: Tensor, o: OverlongOptions) -> Tensor:
    """R' = R + p(L): p = 0 for L <= L_max - L_cache; p = ((L_max - L_cache) - L)/L_cache·factor
    for L_max - L_cache < L <= L_max (linear from 0 to -factor); p = -factor for L > L_max."""
    free = o.max_len - o.cache_len
    lengths = lengths.to(rewards.dtype)
    penalty = ((free - lengths) / o.cache_len).clamp(min=-1.0, max=0.0) * o.factor
    return rewards + penalty


@register("length_penalty", "shaping", "sequence", "plain linear length penalty", LengthOptions)
def length_penalty(rewards: Tensor, lengths: Tensor, o: LengthOptions) -> Tensor:
    """R' = R - coef·L  (or R - coef·L/max_len when max_len is given)."""
    lengths = lengths.to(rewards.dtype)
    scale = lengths / o.max_len if o.max_len is not None else lengths
    return rewards - o.coef * scale


def shape_rewards(name: str, rewards: Tensor, lengths: Tensor, **options) -> Tensor:
    """Apply shaping `name` to per-response rewards given each response's length (same shape)."""
    entry = get("shaping", name)
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards: expected a floating torch.Tensor")
    if not isinstance(lengths, Tensor) or lengths.shape != rewards.shape:
        raise ValueError(f"lengths: expected a tensor of rewards' shape {tuple(rewards.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths: must be >= 0")
    return entry.fn(rewards, lengths, entry.make_options(options))

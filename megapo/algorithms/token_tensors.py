"""A train batch's per-response-token values as float64 tensors, checked against the responses' lengths: the
shared input step of the token stages that work one sample at a time (self_distill, entropy_credit); and the
batch's groups of contiguous samples."""

from __future__ import annotations

import torch
from torch import Tensor


def per_token_values(name: str, values: list | None, lengths: list[int]) -> list[Tensor]:
    """One float64 tensor per sample of exactly its response's length; ValueError naming `name`[i] otherwise."""
    out = []
    for i, (v, n) in enumerate(zip(values if values is not None else [None] * len(lengths), lengths)):
        if v is None or len(v) != n:
            raise ValueError(f"{name}[{i}]: expected {n} values (one per response token), got "
                             f"{None if v is None else len(v)}")
        out.append(torch.as_tensor(v, dtype=torch.float64).reshape(-1))
    return out


def per_token_advantages(advantages: list, lengths: list[int]) -> list[Tensor]:
    """One float64 tensor per sample: a sequence advantage repeated per token, or an earlier stage's per-token."""
    out = []
    for i, (a, n) in enumerate(zip(advantages, lengths)):
        a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
        if a.numel() not in (1, n):
            raise ValueError(f"advantages[{i}]: {a.numel()} values for {n} response tokens")
        out.append(a.expand(n).clone())
    return out


def group_ranges(n: int, group_size: int) -> list[range]:
    """The sample indices of each group of a batch of `n` samples in contiguous groups of `group_size`; ValueError
    when group_size does not divide n."""
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the batch's {n} samples")
    return [range(lo, lo + group_size) for lo in range(0, n, group_size)]

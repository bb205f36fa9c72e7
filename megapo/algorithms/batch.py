"""Checking token inputs and bringing padded and packed batches to one form.

Every loss in this package is written once, on a padded [S, T] view (one sequence per row, `mask`
marking the tokens that count). A packed batch (1-D [N] tensors plus `cu_seqlens` [S+1]) is
scattered into that view, differentiably, so padded and packed inputs give the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Layout:
    """Where the input's tokens sit in the padded [S, T] view (None: input was already padded)."""

    seq_id: Tensor | None = None  # [N] row of each packed token
    pos: Tensor | None = None  # [N] column of each packed token
    shape: tuple[int, int] = (0, 0)

    def to_padded(self, x: Tensor) -> Tensor:
        if self.seq_id is None:
            return x
        out = x.new_zeros(self.shape)
        # index_put (not in place on a leaf) keeps the scatter differentiable
        return out.index_put((self.seq_id, self.pos), x)

    def to_input(self, x: Tensor) -> Tensor:
        """Back from [S, T] to the caller's layout."""
        if self.seq_id is None:
            return x
        return x[self.seq_id, self.pos]


@dataclass
class TokenBatch:
    """Token tensors on the padded [S, T] view; padding positions hold 0 and mask False."""

    logp: Tensor
    old_logp: Tensor  # detached
    advantages: Tensor
    mask: Tensor  # bool
    rollout_logp: Tensor | None = None  # detached
    extra: dict[str, Tensor] = field(default_factory=dict)

    @property
    def fmask(self) -> Tensor:
        return self.mask.to(self.logp.dtype)

    @property
    def lengths(self) -> Tensor:
        """[S] number of valid tokens per sequence (as the float dtype)."""
        return self.fmask.sum(-1)

    @property
    def positions(self) -> Tensor:
        """[S, T] 1-based index of each valid token among its sequence's valid tokens."""
        return torch.cumsum(self.fmask, -1)

    def seq_mean(self, x: Tensor) -> Tensor:
        """[S] masked mean over each sequence's valid tokens (0 for an empty sequence)."""
        return (x * self.fmask).sum(-1) / self.lengths.clamp(min=1)

    def seq_sum(self, x: Tensor) -> Tensor:
        return (x * self.fmask).sum(-1)

    def token_mean(self, x: Tensor) -> Tensor:
        """Masked mean over all valid tokens of this batch (used for metrics)."""
        return (x * self.fmask).sum() / self.fmask.sum()


def check_tensor(name: str, x, ref_shape: tuple[int, ...] | None = None, floating: bool = True) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating tensor, got dtype {x.dtype}")
    if ref_shape is not None and tuple(x.shape) != tuple(ref_shape):
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not match logp's {tuple(ref_shape)}")


def check_cu_seqlens(cu_seqlens, n_tokens: int) -> Tensor:
    if not isinstance(cu_seqlens, Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [S+1] with S >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens: expected an integer tensor, got dtype {cu_seqlens.dtype}")
    cu = cu_seqlens.long()
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: must start at 0, starts at {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens: must be non-decreasing")
    if int(cu[-1]) != n_tokens:
        raise ValueError(f"cu_seqlens: ends at {int(cu[-1])} but the packed tensors hold {n_tokens} tokens")
    return cu


def packed_layout(cu: Tensor, device) -> Layout:
    cu = cu.to(device)
    lens = cu[1:] - cu[:-1]
    n_seq = lens.numel()
    seq_id = torch.repeat_interleave(torch.arange(n_seq, device=device), lens)
    pos = torch.arange(int(cu[-1]), device=device) - cu[:-1][seq_id]
    width = max(int(lens.max()), 1)
    return Layout(seq_id=seq_id, pos=pos, shape=(n_seq, width))


def make_layout(logp: Tensor, cu_seqlens) -> Layout:
    """Check the padded/packed form of `logp` and return its layout."""
    if logp.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: only for packed 1-D inputs; logp is padded [B, T]")
        return Layout(shape=tuple(logp.shape))
    if logp.dim() == 1:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens: required when logp is packed 1-D [N]")
        return packed_layout(check_cu_seqlens(cu_seqlens, logp.numel()), logp.device)
    raise ValueError(f"logp: expected [B, T] (padded) or [N] (packed), got shape {tuple(logp.shape)}")


def check_mask(mask, shape) -> Tensor:
    if not isinstance(mask, Tensor):
        raise ValueError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp's {tuple(shape)}")
    bmask = mask if mask.dtype == torch.bool else mask != 0
    if not bool(bmask.any()):
        raise ValueError("mask: no valid token (all zeros)")
    return bmask


def check_finite_at_tokens(name: str, x: Tensor, bmask: Tensor) -> None:
    if not bool(torch.isfinite(x[bmask]).all()):
        raise ValueError(f"{name}: NaN or inf at a valid (mask=1) token")


def build(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
    cu_seqlens=None,
    extra: dict[str, Tensor] | None = None,
) -> tuple[TokenBatch, Layout]:
    """Validate the inputs (ValueError naming the argument) and return them on the [S, T] view."""
    check_tensor("logp", logp)
    layout = make_layout(logp, cu_seqlens)
    shape = tuple(logp.shape)
    check_tensor("old_logp", old_logp, shape)
    check_tensor("advantages", advantages, shape)
    if rollout_logp is not None:
        check_tensor("rollout_logp", rollout_logp, shape)
    extra = dict(extra or {})
    for key, value in extra.items():
        check_tensor(key, value, shape)
    bmask = check_mask(mask, shape)
    named = [("logp", logp), ("old_logp", old_logp), ("advantages", advantages)]
    if rollout_logp is not None:
        named.append(("rollout_logp", rollout_logp))
    named += list(extra.items())
    for key, value in named:
        check_finite_at_tokens(key, value.detach(), bmask)

    def view(x: Tensor) -> Tensor:
        # zero the padding so that nothing from it (not even a NaN) reaches a loss or a gradient
        return layout.to_padded(torch.where(bmask, x, torch.zeros((), dtype=x.dtype, device=x.device)))

    pmask = layout.to_padded(bmask.to(logp.dtype)) > 0 if layout.seq_id is not None else bmask
    batch = TokenBatch(
        logp=view(logp),
        old_logp=view(old_logp.detach()),
        advantages=view(advantages.detach()),
        mask=pmask,
        rollout_logp=None if rollout_logp is None else view(rollout_logp.detach()),
        extra={k: view(v) for k, v in extra.items()},
    )
    return batch, layout

"""Loss aggregation: from per-token losses [S, T] to one scalar.

With `global_tokens` / `global_seqs` (the counts over the whole batch: every micro-batch on every
DP rank) the result is this shard's share of the full-batch loss: summing the shards' results gives
the full-batch loss, so the gradient does not depend on how the batch was split. Without them the
local counts are used (correct only when this shard is the whole batch).

loss_agg="auto" (the config's default) is the objective's own: the aggregation its paper uses,
registered with it (`megapo objectives` shows it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.registry import get, register


@dataclass
class Norm:
    """The normalisers an aggregation may use."""

    global_tokens: float | None = None
    global_seqs: float | None = None
    max_len: float | None = None  # seq-mean-token-sum-norm's constant


def _seqs(b: TokenBatch, n: Norm):
    # local count: sequences that have at least one valid token
    return n.global_seqs if n.global_seqs is not None else (b.lengths > 0).sum()


@register("token-mean", "aggregation", "token", "DAPO, Yu et al. 2025 (arXiv:2503.14476)")
def token_mean(loss: Tensor, b: TokenBatch, n: Norm) -> Tensor:
    """Σ_i Σ_t ℓ_{i,t} / N_tokens (N_tokens = global_tokens when given)."""
    denom = n.global_tokens if n.global_tokens is not None else b.fmask.sum()
    return (loss * b.fmask).sum() / denom


@register("seq-mean-token-mean", "aggregation", "sequence", "Shao et al. 2024, GRPO (arXiv:2402.03300)")
def seq_mean_token_mean(loss: Tensor, b: TokenBatch, n: Norm) -> Tensor:
    """Σ_i (1/|y_i|)·Σ_t ℓ_{i,t} / N_seqs (N_seqs = global_seqs when given)."""
    return b.seq_mean(loss).sum() / _seqs(b, n)


@register("seq-mean-token-sum", "aggregation", "sequence", "sequence-sum REINFORCE (e.g. VESPO, arXiv:2602.10693)")
def seq_mean_token_sum(loss: Tensor, b: TokenBatch, n: Norm) -> Tensor:
    """Σ_i Σ_t ℓ_{i,t} / N_seqs (N_seqs = global_seqs when given)."""
    return b.seq_sum(loss).sum() / _seqs(b, n)


@register(
    "seq-mean-token-sum-norm", "aggregation", "sequence",
    "Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO, arXiv:2503.20783)",
)
def seq_mean_token_sum_norm(loss: Tensor, b: TokenBatch, n: Norm) -> Tensor:
    """Σ_i Σ_t ℓ_{i,t} / (L·N_seqs) with L the constant option max_len (the generation budget), so
    no sequence's tokens are re-weighted by its length."""
    if n.max_len is None:
        raise ValueError("max_len: required by loss_agg='seq-mean-token-sum-norm' (a constant, e.g. the generation budget)")
    return b.seq_sum(loss).sum() / (n.max_len * _seqs(b, n))


AUTO = "auto"


def resolve(loss_agg: str | None, objective: str) -> str:
    """The aggregation to use: `loss_agg`, or for "auto" (or None) the objective's registered default."""
    if loss_agg is None or loss_agg == AUTO:
        return get("objective", objective).loss_agg
    get("aggregation", loss_agg, argument="loss_agg")
    return loss_agg


def aggregate(loss: Tensor, b: TokenBatch, loss_agg: str, norm: Norm) -> Tensor:
    return get("aggregation", loss_agg, argument="loss_agg").fn(loss, b, norm)

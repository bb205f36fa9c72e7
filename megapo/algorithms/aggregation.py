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

import torch
from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.registry import get, register


@dataclass
class Norm:
    """The normalisers an aggregation may use."""

    global_tokens: float | None = None
    global_seqs: float | None = None
    max_len: float | None = None  # seq-mean-token-sum-norm's constant
    polarity: PolarityCounts | None = None  # balanced's counts over the whole batch


@dataclass(frozen=True)
class PolarityCounts:
    """Sequences and their tokens by the sign of the sequence's advantage (balanced aggregation)."""

    pos_seqs: float
    neg_seqs: float
    pos_tokens: float
    neg_tokens: float


def sequence_polarity(advantage_sums: Tensor) -> Tensor:
    """[S] +1 / -1 / 0: the sign of each sequence's Σ_t A_{i,t}, summed in float64 (a scalar advantage
    broadcast over the tokens has its own sign; a sequence whose advantages sum to 0 counts in neither)."""
    return torch.sign(advantage_sums.to(torch.float64))


def polarity_counts(advantage_sums: Tensor, lengths: Tensor) -> PolarityCounts:
    """The counts `balanced` normalises by, from every sequence of the batch: Σ_t A_{i,t} and |y_i| per
    sequence. The learner computes them once per step over all micro-batches and DP ranks."""
    sign = sequence_polarity(advantage_sums)
    lengths = lengths.to(torch.float64)
    pos, neg = sign > 0, sign < 0
    return PolarityCounts(float(pos.sum()), float(neg.sum()), float(lengths[pos].sum()), float(lengths[neg].sum()))


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


@register(
    "balanced", "aggregation", "sequence",
    "Zeng et al. 2026, Balanced Aggregation: Understanding and Fixing Aggregation Bias in GRPO "
    "(arXiv:2605.04077), BA: token means within the positive and negative subsets, weighted by their "
    "sequence counts",
)
def balanced(loss: Tensor, b: TokenBatch, n: Norm) -> Tensor:
    """L = (S₊/S)·Σ_{A_i>0} Σ_t ℓ_{i,t} / T₊ + (S₋/S)·Σ_{A_i<0} Σ_t ℓ_{i,t} / T₋, S± the numbers of
    sequences with positive / negative advantage, T± their tokens, S = S₊ + S₋ (global counts when given:
    Norm.polarity). A sequence's sign is that of Σ_t A_{i,t}; sequences with A_i = 0 count in neither and
    add nothing (KL and entropy terms aggregated this way skip them too). An empty side adds 0."""
    adv_sums = (b.advantages.detach().to(torch.float64) * b.mask).sum(-1)  # float64, as the learner's counts
    sign = sequence_polarity(adv_sums)
    counts = n.polarity if n.polarity is not None else polarity_counts(adv_sums, b.lengths)
    seq_loss = b.seq_sum(loss)
    total = seq_loss.sum() * 0.0  # keeps the graph when no sequence has a sign
    seqs = counts.pos_seqs + counts.neg_seqs
    for side, n_seqs, n_tokens in ((sign > 0, counts.pos_seqs, counts.pos_tokens),
                                   (sign < 0, counts.neg_seqs, counts.neg_tokens)):
        if n_tokens > 0:
            total = total + (n_seqs / seqs) * seq_loss[side].sum() / n_tokens
    return total


AUTO = "auto"


def resolve(loss_agg: str | None, objective: str) -> str:
    """The aggregation to use: `loss_agg`, or for "auto" (or None) the objective's registered default."""
    if loss_agg is None or loss_agg == AUTO:
        return get("objective", objective).loss_agg
    get("aggregation", loss_agg, argument="loss_agg")
    return loss_agg


def aggregate(loss: Tensor, b: TokenBatch, loss_agg: str, norm: Norm) -> Tensor:
    return get("aggregation", loss_agg, argument="loss_agg").fn(loss, b, norm)

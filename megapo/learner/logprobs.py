"""Log-probs and entropy of given tokens from vocabulary-parallel logits.

Each TP rank holds logits for its slice of the vocabulary. Only per-token scalars cross ranks
(max, sum of exp, the target's logit, sum p*logit; Σ p² for OTB's Logit-Gradient Proxy, vocab_parallel_sum_p2; the
kept mass and the target of Lp-Reg's min-p proxy, vocab_parallel_min_p_logprobs), or O(k) of them for the top-k and K
given tokens (vocab_parallel_topk, vocab_parallel_logprobs_at): the full vocabulary is never gathered on one rank.
Unlike Megatron's vocab_parallel_cross_entropy this does not modify the logits in place (the caller
may still need them) and also returns the entropy. Differentiable (used by the train step).
"""

from __future__ import annotations

import math

import torch

_NEG = -1e30  # logit of a padded vocabulary entry (finite, so 0 * _NEG stays 0 in the entropy)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            with_entropy: bool = False, entropy_grad: bool = True, group=None):
    """logits [..., V_local] (this rank's vocabulary slice), targets [...] global token ids.
    Returns (logp [...], entropy [...] or None), identical on every TP rank. entropy_grad=False: the
    entropy is only a metric (no graph kept for it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if group is None:
        group = parallel_state.get_tensor_model_parallel_group()
    rank, size = group.rank(), group.size()
    part = logits.shape[-1]
    start = rank * part
    logits = logits.float()
    if start + part > vocab_size:  # mask vocabulary padding (added so the vocab splits evenly over TP)
        ids = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, _NEG)

    def all_reduce(x):
        return reduce_from_tensor_model_parallel_region(x) if size > 1 else x

    with torch.no_grad():
        peak = logits.max(dim=-1).values
        if size > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    exp = shifted.exp()
    local = targets - start
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    entropy_graph = entropy_grad and torch.is_grad_enabled()
    parts = [exp.sum(dim=-1), torch.where(inside, picked, torch.zeros_like(picked))]
    if with_entropy:
        with torch.set_grad_enabled(entropy_graph):
            parts.append((exp * shifted).sum(dim=-1))
    sums = all_reduce(torch.stack(parts))  # one collective for every per-token sum
    log_z = sums[0].log()
    logp = sums[1] - log_z
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_graph):
            entropy = log_z - sums[2] / sums[0]
    return logp, entropy


# ------------------------------------------------------------------------------ top-k and K given tokens
# The two functions below take the TP group as an argument (any torch.distributed group, or an object with
# rank() / size() for one rank) and reduce over it themselves, so they run under Megatron's TP group or a plain
# gloo group alike (the tests' two-process check uses the latter).


class _SumOverRanks(torch.autograd.Function):
    """Sum over the group's ranks; the backward passes each rank's gradient through as it is (each rank's part of a
    sum gets the sum's gradient), as Megatron's reduce_from_tensor_model_parallel_region does."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    return _SumOverRanks.apply(x, group) if group.size() > 1 else x


def _masked_slice(logits: torch.Tensor, vocab_size: int, group) -> tuple[torch.Tensor, int]:
    """This rank's logits (at least float32; float64 stays float64) with its vocabulary padding at _NEG, and the
    global id of its first entry."""
    part = logits.shape[-1]
    start = group.rank() * part
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if start + part > vocab_size:  # padding added so the vocabulary splits evenly over TP
        ids = torch.arange(start, start + part, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, _NEG)
    return logits, start


def _global_peak(logits: torch.Tensor, group) -> torch.Tensor:
    """max over the whole vocabulary per position (a constant shift: no gradient needed through it)."""
    with torch.no_grad():
        peak = logits.max(dim=-1).values
        if group.size() > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX, group=group)
    return peak


def _tp_group(group):
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_logprobs_at(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                               group=None) -> torch.Tensor:
    """log p(targets[..., j]) for K given token ids per position: logits [..., V_local] (this rank's vocabulary
    slice), targets [..., K] global ids -> [..., K], the same on every rank of `group` (None: Megatron's TP group).
    log p(v) = z_v − max − log Σ_u exp(z_u − max) over the real vocabulary; per position K + 1 values cross ranks
    (the K picked logits, each from the rank holding it, and the sum of exp). Differentiable in `logits`."""
    group = _tp_group(group)
    logits, start = _masked_slice(logits, vocab_size, group)
    part = logits.shape[-1]
    shifted = logits - _global_peak(logits, group).unsqueeze(-1)
    local = targets.long() - start
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1))
    parts = torch.cat([shifted.exp().sum(dim=-1, keepdim=True), torch.where(inside, picked, 0.0)], dim=-1)
    sums = _sum_over_ranks(parts, group)  # one collective: [..., 1 + K]
    return sums[..., 1:] - sums[..., :1].log()


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, *, vocab_size: int, group=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position the k most likely token ids of the whole vocabulary and their log-probs, from logits
    [..., V_local] (this rank's slice; vocabulary padding never chosen) -> (ids [..., k] int64, logp [..., k]),
    highest first, the same on every rank of `group` (None: Megatron's TP group).

    Each rank takes its slice's top min(k, V_local), the ranks all-gather those candidates (k values and ids per
    rank and position), and the global top k is taken among them: the global top k lie among the ranks' local
    top k. log p = z − max − log Σ exp(z − max), the reduction vocab_parallel_logprobs uses. Only O(k) values per
    position cross ranks, never the vocabulary. No gradient (a teacher's values)."""
    group = _tp_group(group)
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k: must be in [1, vocab_size={vocab_size}], got {k}")
    logits, start = _masked_slice(logits, vocab_size, group)
    # the arithmetic of vocab_parallel_logprobs_at step for step, so the two agree to the bit on the same logits
    shifted = logits - _global_peak(logits, group).unsqueeze(-1)
    log_sum = _sum_over_ranks(shifted.exp().sum(dim=-1, keepdim=True), group).log()
    values, ids = shifted.topk(min(k, shifted.shape[-1]), dim=-1)
    ids = ids + start
    if group.size() > 1:  # candidates of every rank side by side: [..., size * k_local]
        values, ids = (_gather_last(x, group) for x in (values, ids))
    values, pick = values.topk(k, dim=-1)
    return ids.gather(-1, pick), values - log_sum


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """All ranks' `x` concatenated along the last dimension, in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ------------------------------------------------------------------------------ per-position reductions over the
# whole distribution (no vocabulary gathered: a few values per position cross ranks)


def vocab_parallel_sum_p2(logits: torch.Tensor, *, vocab_size: int, group=None) -> torch.Tensor:
    """Σ_v p_v² per position over the whole vocabulary, from logits [..., V_local] (this rank's slice) -> [...], the
    same on every rank of `group` (None: Megatron's TP group). Σ_v p_v² = Σ_v e^{2(z_v − m)} / (Σ_v e^{z_v − m})²
    with m the global max; two values per position cross ranks. Differentiable in `logits`.

    With p_y = π(y) it gives the squared logit-gradient norm of log π(y): ‖∇_z log π(y)‖² = ‖e_y − p‖² =
    1 − 2 p_y + Σ_v p_v² (logit_grad_sq_norm; OTB's Logit-Gradient Proxy)."""
    group = _tp_group(group)
    logits, _ = _masked_slice(logits, vocab_size, group)
    exp = (logits - _global_peak(logits, group).unsqueeze(-1)).exp()
    sums = _sum_over_ranks(torch.stack([exp.sum(dim=-1), exp.square().sum(dim=-1)], dim=-1), group)
    return sums[..., 1] / sums[..., 0].square()


def logit_grad_sq_norm(logp: torch.Tensor, sum_p2: torch.Tensor) -> torch.Tensor:
    """‖e_y − p‖² = 1 − 2 π(y) + Σ_v π(v)²: the squared norm of log π(y)'s gradient in the logits, from log π(y) and
    vocab_parallel_sum_p2 (clamped at 0 against rounding)."""
    return (1 - 2 * logp.exp() + sum_p2).clamp(min=0)


MIN_P_MODES = ("relative", "fixed")


@torch.no_grad()
def vocab_parallel_min_p_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, min_p: float, mode: str = "relative",
                                  vocab_size: int, group=None) -> torch.Tensor:
    """log q(targets) under the min-p proxy q of π = softmax(logits) (Lp-Reg's proxy distribution): the tokens below a
    threshold τ dropped and the rest renormalised, q(v) = π(v)·1[π(v) ≥ τ] / Σ_u π(u)·1[π(u) ≥ τ], with
    τ = min_p·max_u π(u) (mode "relative": z_v − max ≥ log min_p) or τ = min_p (mode "fixed"). logits [..., V_local]
    (this rank's slice), targets [...] global ids -> [...], −1e30 (q = 0, finite like the vocabulary padding) where
    the target is dropped; the same on every rank of
    `group` (None: Megatron's TP group). Per position 2 values cross ranks (3 in mode fixed, which needs log Z first).
    No gradient (a regularisation target)."""
    if mode not in MIN_P_MODES:
        raise ValueError(f"mode: must be one of {', '.join(MIN_P_MODES)}, got {mode!r}")
    if not 0 < min_p <= 1:
        raise ValueError(f"min_p: must be in (0, 1], got {min_p!r}")
    group = _tp_group(group)
    logits, start = _masked_slice(logits, vocab_size, group)
    part = logits.shape[-1]
    shifted = logits - _global_peak(logits, group).unsqueeze(-1)  # log π(v) + log Z, Z = Σ e^{z − max}
    exp = shifted.exp()
    if mode == "relative":  # π(v) ≥ min_p · π_max  ⟺  z_v − max ≥ log min_p
        keep = shifted >= math.log(min_p)
    else:  # π(v) ≥ min_p  ⟺  z_v − max − log Z ≥ log min_p
        log_z = _sum_over_ranks(exp.sum(dim=-1, keepdim=True), group).log()
        keep = shifted - log_z >= math.log(min_p)
    local = targets.long() - start
    inside = (local >= 0) & (local < part)
    at = local.clamp(0, part - 1).unsqueeze(-1)
    picked = torch.where(inside, shifted.gather(-1, at).squeeze(-1), 0.0)
    kept = torch.where(inside, keep.gather(-1, at).squeeze(-1), False).to(shifted.dtype)
    sums = _sum_over_ranks(torch.stack([torch.where(keep, exp, 0.0).sum(dim=-1), picked, kept], dim=-1), group)
    kept_sum, picked, kept = sums[..., 0], sums[..., 1], sums[..., 2] > 0.5
    return torch.where(kept, picked - kept_sum.clamp(min=torch.finfo(kept_sum.dtype).tiny).log(),
                       torch.full_like(picked, _NEG))

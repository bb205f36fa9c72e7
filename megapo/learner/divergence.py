"""The Jensen-Shannon distance between two next-token distributions, from vocabulary-parallel logits.

Each TP rank holds both positions' logits for its slice of the vocabulary (megapo/learner/logprobs.py's layout): only
per-position scalars cross ranks (the two maxima, the two partition sums, then the divergence's partial sum), never
the distributions themselves.
"""

from __future__ import annotations

import math

import torch

from megapo.learner.logprobs import _masked_slice, _tp_group


@torch.no_grad()
def vocab_parallel_js_distance(p_logits: torch.Tensor, q_logits: torch.Tensor, *, vocab_size: int,
                               group=None) -> torch.Tensor:
    """sqrt(JSD(p, q)) per position, p = softmax(p_logits), q = softmax(q_logits) over the whole vocabulary, from
    [..., V_local] each (this rank's slice) -> [...], the same on every rank of `group` (None: Megatron's TP group).
    JSD(p, q) = ½ Σ_v p_v log(p_v / m_v) + ½ Σ_v q_v log(q_v / m_v), m = ½ (p + q), natural logarithm: the distance
    lies in [0, sqrt(log 2)] (0: the same distribution). Padded vocabulary entries count as probability 0."""
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"q_logits: must have p_logits' shape {tuple(p_logits.shape)}, got {tuple(q_logits.shape)}")
    group = _tp_group(group)
    zp, _ = _masked_slice(p_logits, vocab_size, group)
    zq, _ = _masked_slice(q_logits, vocab_size, group)
    peaks = torch.stack([zp.max(dim=-1).values, zq.max(dim=-1).values])
    if group.size() > 1:
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX, group=group)
    zp, zq = zp - peaks[0].unsqueeze(-1), zq - peaks[1].unsqueeze(-1)
    sums = torch.stack([zp.exp().sum(dim=-1), zq.exp().sum(dim=-1)])
    if group.size() > 1:
        torch.distributed.all_reduce(sums, group=group)
    log_p = zp - sums[0].log().unsqueeze(-1)
    log_q = zq - sums[1].log().unsqueeze(-1)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
    # an entry with p_v = q_v adds exactly 0 (logaddexp's rounding would leave ~1 ulp there, whose square root
    # shows as ~1e-8 at equal distributions); one with p_v = 0 adds 0 (exp underflows to 0 against a finite
    # log-ratio; padding sits at a finite -1e30)
    same = log_p == log_q
    to_m_p = torch.where(same, 0.0, log_p - log_m)
    to_m_q = torch.where(same, 0.0, log_q - log_m)
    local = 0.5 * (log_p.exp() * to_m_p + log_q.exp() * to_m_q).sum(dim=-1)
    if group.size() > 1:
        torch.distributed.all_reduce(local, group=group)
    return local.clamp(min=0.0).sqrt()

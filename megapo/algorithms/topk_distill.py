"""The top-k forward-KL distillation term (algorithm.distill.mode topk_forward_kl), a loss term beside the policy loss.

Per response token t and teacher j, with TopK_j(t) the teacher's k most likely token ids at t:

    KL_j(t) = Σ_{v ∈ TopK_j(t)} p_Tj(v) · (log p_Tj(v) − log π_θ(v))
    L_distill = agg_t( Σ_j β_j · KL_j(t) )        over the policy tokens, agg the run's loss aggregation

p_Tj is the teacher's full-vocabulary probability, **not** renormalised over its top k (the mass outside the top k
is dropped, so KL_j(t) can be slightly negative where π_θ puts more mass on the k ids than the teacher). This is
verl's `forward_kl_topk` (verl/trainer/distillation/losses.py; issue 31 compares at k = 32) without its three
additions: verl takes the union of the student's and the teacher's top k, clamps both log-probs at log(1e-8) and the
per-token loss at >= 0; here the set is the teacher's top k only (as issue 31 defines it) and nothing is clamped (a
clamp at 0 would drop the gradient exactly where π_θ overshoots the teacher). It is exactly 0 when the teacher is the
student's own weights on the same routes, but its gradient is not unless the k ids hold all the mass: at π_θ = p_T
the logit gradient is p(u)·(P_K − 1[u ∈ K]), P_K = Σ_{v∈K} p(v), which moves mass from outside the top k into it
(the truncated, unrenormalised KL sharpens the student toward the teacher's top k). The gradient reaches π_θ only
through log π_θ at the k ids: ∂/∂θ = −Σ_j β_j Σ_v p_Tj(v) ∇ log π_θ(v) (the forward-KL, supervised direction of
distillation: Hinton et al. 2015; Agarwal et al. 2024, arXiv:2306.13649). The learner calls it because log π_θ at the
teacher's ids needs the vocabulary-parallel logits (megapo.learner.logprobs.vocab_parallel_logprobs_at); the
teacher's ids and log-probs reach the learner as sample.teacher_topk_ids / teacher_topk_logp
(megapo/trainer/distill.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megapo.algorithms.aggregation import Norm, aggregate
from megapo.algorithms.batch import TokenBatch

METRIC = "distill/topk_forward_kl"


def topk_forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Σ_v p_T(v) (log p_T(v) − log π_θ(v)) over the last axis (the k ids): [..., k] -> [...]."""
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


def topk_distill_loss(student_logp: Tensor, teacher_logp: Tensor, coefs: tuple[float, ...], b: TokenBatch,
                      loss_agg: str, norm: Norm) -> tuple[Tensor, dict[str, Tensor]]:
    """The term Σ_j β_j KL_j aggregated as `loss_agg` over b's tokens (this shard's share when `norm` holds the
    batch-global counts), and each teacher's KL summed over b's policy tokens (the learner's metric reduction
    divides by the batch's policy tokens): METRIC for the first teacher, METRIC/<j> for each with several.
    student_logp, teacher_logp: [S, T, J·k], teacher j's ids in the j-th block of k (coefs: β_j, J = len(coefs))."""
    if teacher_logp.shape[-1] % len(coefs):
        raise ValueError(f"teacher_topk_logp: {teacher_logp.shape[-1]} columns for {len(coefs)} teachers "
                         "(needs k columns per teacher)")
    k = teacher_logp.shape[-1] // len(coefs)
    kls = [topk_forward_kl(s, t) for s, t in zip(student_logp.split(k, -1), teacher_logp.split(k, -1))]
    term = sum(coef * kl for coef, kl in zip(coefs, kls))
    loss = aggregate(term, b, loss_agg, norm)
    sums = [torch.where(b.mask, kl.detach(), 0.0).sum() for kl in kls]
    metrics = {METRIC: sums[0]}
    if len(kls) > 1:
        metrics.update({f"{METRIC}/{j}": s for j, s in enumerate(sums)})
    return loss, metrics

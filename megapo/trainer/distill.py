"""On-policy distillation from one or several teachers: the student samples, each frozen teacher scores the
student's tokens, and the weighted per-token reverse KLs enter the advantage.

    A_t <- A_t - Σ_j β_j · (log π_old(y_t) - log π_Tj(y_t))      (algorithm.distill, mode reverse_kl)

with the teachers of algorithm.distill.teachers: [{path, coef: β_j}, ...], or the single algorithm.distill.teacher
weighed by algorithm.distill.coef (the same as a one-entry list). log π_old - log π_T at a sampled token is a
one-sample estimate of KL(π_old || π_T) at that position; subtracting it from the advantage is the reverse-KL
policy gradient of on-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning
from Self-Generated Mistakes", arXiv:2306.13649; Thinking Machines' "On-Policy Distillation", 2025; slime's
--use-opd); several teachers with weights are the sum of their terms (verl's multi-teacher distillation). With
data.reward the verifier's, it is distillation + RL; with a reward of 0 for every sample (a user reward returning
0.0), pure distillation.

Each teacher is a second Megatron model under the learner's layout and precision (megapo.learner.reference's
MegatronReference), frozen; it replays the policy's routes when it has the policy's MoE shape (the same MoE layers,
experts and top-k) and routing replay is on, and routes itself otherwise. Its tokenizer must be the student's.
mode topk_forward_kl (algorithm.distill.k) is a loss term instead of an advantage term: each teacher gives, per
response token, its k most likely token ids and their log-probs (vocabulary-parallel top-k,
MegatronReference.response_topk), laid side by side in sample.teacher_topk_ids / teacher_topk_logp
(`attach_teacher_topk`), and the learner adds Σ_j β_j Σ_t Σ_{v ∈ top-k_j(t)} p_Tj(v)(log p_Tj(v) - log π_θ(v)),
aggregated as the policy loss, logged as distill/topk_forward_kl (megapo/algorithms/topk_distill.py).

The metric distill/reverse_kl is the first teacher's mean of log π_old - log π_T over the batch's policy tokens
(exactly 0 when the teacher is the student's own weights: the same forward on the same routes); with several
teachers, distill/reverse_kl/<j> is teacher j's (0-based, in the order of algorithm.distill.teachers).
"""

from __future__ import annotations

from pathlib import Path

# the config section lives with the algorithms (megapo/algorithms/config.py); its names stay importable from here
from megapo.algorithms.config import DistillConfig, check_same_tokenizer  # noqa: F401


def same_moe_shape(teacher_hf: dict, student_hf: dict) -> bool:
    """Whether the teacher can replay the student's routes: the same MoE layers, experts and top-k."""
    from megapo.models.family import family_for

    a, b = (family_for(hf).spec(hf) for hf in (teacher_hf, student_hf))
    return (a.num_layers, a.num_experts, a.topk, tuple(a.moe_layers or ())) == \
        (b.num_layers, b.num_experts, b.topk, tuple(b.moe_layers or ()))


def build_teachers(cfg, student_dir: Path) -> list:
    """Every teacher of algorithm.distill, in order (collective: every rank)."""
    return [build_teacher(cfg, student_dir, t.path) for t in cfg.algorithm.distill.all_teachers()]


def build_teacher(cfg, student_dir: Path, path: str | None = None):
    """A teacher (`path`; None: the first of algorithm.distill) as a frozen Megatron model under the learner's layout
    and precision (collective: every rank)."""
    from megapo.layout import read_hf_config
    from megapo.learner.reference import MegatronReference

    path = path if path is not None else cfg.algorithm.distill.all_teachers()[0].path
    replay = cfg.algorithm.routing_replay != "off" and same_moe_shape(read_hf_config(path), read_hf_config(student_dir))
    return MegatronReference(path, cfg.parallel, micro_batch_tokens=cfg.train.micro_batch_tokens,
                             row_tokens=cfg.train.row_tokens, routing_replay=replay, seed=cfg.train.seed,
                             precision=cfg.train.precision_spec())


def attach_teacher_topk(teachers: list, batch: list, k: int) -> None:
    """Set each sample's teacher_topk_ids / teacher_topk_logp: per response token the k most likely ids of every
    teacher and their log-probs, teacher j in columns j·k .. (j+1)·k - 1 ([response tokens, J·k]; collective: every
    rank calls each Megatron teacher)."""
    import torch

    from megapo.algorithms.sample import as_train_samples

    batch = as_train_samples(batch)
    per_teacher = [t.response_topk(batch, k) for t in teachers]
    for i, sample in enumerate(batch):
        sample.teacher_topk_ids = torch.cat([rows[i][0] for rows in per_teacher], dim=-1)
        sample.teacher_topk_logp = torch.cat([rows[i][1] for rows in per_teacher], dim=-1)


def teachers_advantages(advantages: list, old_logp: list, teacher_logps: list[list], coefs: list[float],
                        loss_mask: list | None = None) -> tuple[list, list[float]]:
    """A_t - Σ_j coefs[j] · (old_t - teacher_j_t) per response token, teacher j's log-probs teacher_logps[j]; and
    each teacher's mean of old_t - teacher_j_t over the policy tokens. The terms add up, so the teachers are
    subtracted one after the other (reverse_kl_advantages each)."""
    kls = []
    for logp, coef in zip(teacher_logps, coefs, strict=True):
        advantages, kl = reverse_kl_advantages(advantages, old_logp, logp, coef, loss_mask)
        kls.append(kl)
    return advantages, kls


def reverse_kl_advantages(advantages: list, old_logp: list, teacher_logp: list, coef: float,
                          loss_mask: list | None = None) -> tuple[list[list[float]], float]:
    """Per sample, A_t - coef · (old_t - teacher_t) per response token (a scalar A repeated), and the mean of
    old_t - teacher_t over the policy tokens (loss_mask 1; all when None)."""
    out, total, count = [], 0.0, 0
    for i, (a, old, teacher) in enumerate(zip(advantages, old_logp, teacher_logp)):
        if len(old) != len(teacher):
            raise ValueError(f"teacher_logp[{i}]: {len(teacher)} values for {len(old)} response tokens")
        per_token = a if isinstance(a, list) else [a] * len(old)
        gaps = [o - t for o, t in zip(old, teacher)]
        out.append([x - coef * g for x, g in zip(per_token, gaps)])
        mask = loss_mask[i] if loss_mask is not None and loss_mask[i] is not None else [1] * len(gaps)
        total += sum(g for g, m in zip(gaps, mask) if m)
        count += sum(1 for m in mask if m)
    return out, total / max(count, 1)


def reverse_kl_metrics(kls: list[float]) -> dict:
    """distill/reverse_kl: the first (or only) teacher's mean gap; with several, distill/reverse_kl/<j> each one's."""
    metrics = {"distill/reverse_kl": kls[0]} if kls else {}
    if len(kls) > 1:
        metrics.update({f"distill/reverse_kl/{j}": kl for j, kl in enumerate(kls)})
    return metrics

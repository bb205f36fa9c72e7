"""`policy_loss`: the one entry point the learner calls (docs/CONTRACTS.md).

    loss, metrics = policy_loss(LossSpec("gspo"), logp, old_logp, adv, mask, global_seqs=n_seqs_all_ranks)
    # loss_agg "auto" (default): the objective's own, here GSPO's "seq-mean-token-mean"
    loss, metrics = policy_loss("ppo", logp, old_logp, adv, mask, eps_high=0.28)   # LossSpec.of("ppo", eps_high=0.28)

Steps: check and bring the inputs to the padded view (batch.py) → the objective's per-token loss
(objectives.py) → × the mismatch correction weights (corrections.py) → aggregate (aggregation.py)
→ + KL and entropy terms aggregated the same way (kl.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megapo.algorithms import batch as batch_mod
from megapo.algorithms import corrections
from megapo.algorithms.aggregation import AUTO, Norm, PolarityCounts, aggregate, resolve
from megapo.algorithms.kl import kl_penalty
from megapo.algorithms.registry import get
from megapo.algorithms.spec import FLAT_OPTIONS, LossSpec, as_loss_spec

def _positive(name: str, value) -> float | Tensor | None:
    if value is None:
        return None
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: must be a positive finite number, got {value!r}")
    return value


def _polarity(counts) -> PolarityCounts | None:
    if counts is None:
        return None
    if not isinstance(counts, PolarityCounts):
        raise ValueError(f"global_polarity: expected aggregation.PolarityCounts, got {type(counts).__name__}")
    for name in ("pos_seqs", "neg_seqs", "pos_tokens", "neg_tokens"):
        v = getattr(counts, name)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"global_polarity.{name}: must be a finite count >= 0, got {v!r}")
    return counts


def _token_weight(b: batch_mod.TokenBatch) -> Tensor:
    w = b.extra["token_weight"]
    if bool((w[b.mask] < 0).any()):
        raise ValueError("token_weight: must be >= 0 at every valid token")
    return w


def _kl_weight(b: batch_mod.TokenBatch) -> Tensor:
    w = b.extra["kl_weight"]
    if bool((w[b.mask] < 0).any()):
        raise ValueError("kl_weight: must be >= 0 at every valid token")
    return w


def token_inputs(name: str, options: dict) -> tuple[str, ...]:
    """The per-token inputs objective `name` with these options (its objective options; LossSpec's own names are
    ignored)
    reads beyond logp / old_logp / advantages: "old_entropy" (π_old's per-token entropy), "sentence_end"
    (1.0 at a sentence's last token). () for an unregistered name (a custom loss_fn's objective)."""
    from megapo.algorithms.registry import entries

    entry = next((e for e in entries("objective") if e.name == name), None)
    if entry is None:
        return ()
    opts = entry.make_options({k: v for k, v in options.items() if k not in FLAT_OPTIONS})
    return tuple(getattr(opts, "token_inputs", ()))


def policy_loss(
    loss: LossSpec | str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    global_polarity: PolarityCounts | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    token_weight: Tensor | None = None,
    old_entropy: Tensor | None = None,
    sentence_end: Tensor | None = None,
    topk_logp_sum: Tensor | None = None,
    top1: Tensor | None = None,
    topk_lse: Tensor | None = None,
    in_topk: Tensor | None = None,
    proxy_logp: Tensor | None = None,
    low_prob: Tensor | None = None,
    entropy_score: Tensor | None = None,
    kl_weight: Tensor | None = None,
    mismatch_mask: Tensor | None = None,
    loss_agg: str | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of `loss` (a LossSpec, megapo/algorithms/spec.py) and its metrics (detached 0-d tensors, local to
    this shard). `loss` may also be an objective name: the spec is then LossSpec.of(name, loss_agg or "auto",
    **options) (options: the spec's field names, the rest the objective's; see `megapo objectives`); with a
    LossSpec, `loss_agg` and options are refused.

    Per-token inputs (same shape as logp): ref_logp for the KL term and metric (required when the spec's
    kl_coef is non-zero); entropy (differentiable) for the entropy metric and bonus (required with
    entropy_coef); token_weight (detached, >= 0: a token_weight stage's output, megapo/algorithms/stages.py)
    multiplies the objective's per-token loss as a correction does, the normaliser unchanged; old_entropy
    (π_old's per-token entropy), sentence_end (1.0 at each sentence's last token), topk_logp_sum (Σ_k log π_θ(v_k)
    over π_θ's own k most likely tokens at each position, differentiable: the learner's top-k seam, k the
    objective's `policy_topk`), top1 (1.0 where the sampled token is π_θ's most likely one), topk_lse (log Σ_k π_θ(v_k)
    over the same k, differentiable) and in_topk (1.0 where the sampled token is among them: rlpt), proxy_logp (log q(y_t)
    under the min-p proxy of π_θ, detached: lp_reg, the learner's vocabulary-parallel reduction) reach the objective
    only when its options ask for them (`token_inputs`), and are refused missing then; so does low_prob (1.0 where
    lp_reg's batch-global low-probability quantile selects the token, detached: megapo.trainer.update.set_low_prob)
    and entropy_score (HAPO's batch-global signed entropy score of π_old, detached: set_entropy_scores).
    kl_weight (detached, >= 0: stage low_entropy_kl's coefficients, megapo/algorithms/semantic_entropy.py) adds
    the term Σ c_t · |log π_θ(y_t) − log π_old(y_t)|, aggregated as the policy loss is (metric low_entropy_kl).
    global_polarity: loss_agg="balanced"'s sequence and token counts by advantage sign over the whole
    batch (aggregation.polarity_counts), so its shards, too, sum to the full-batch loss.
    mismatch_mask (0/1, TrainSample.mismatch_mask: SOUP's historical prefixes are 0) limits the mismatch_* metrics
    to its 1s (mismatch_tokens counts them; the learner weighs each micro-batch's means by it).
    """
    spec = as_loss_spec(loss, loss_agg, options)
    entry = get("objective", spec.objective, argument="objective")
    agg = resolve(spec.loss_agg, spec.objective)
    obj_opts = spec.objective_config()
    norm = Norm(
        global_tokens=_positive("global_tokens", global_tokens),
        global_seqs=_positive("global_seqs", global_seqs),
        max_len=spec.max_len,
        polarity=_polarity(global_polarity),
    )
    if spec.kl_coef and ref_logp is None:
        raise ValueError("ref_logp: required when kl_coef is non-zero")
    if spec.entropy_coef and entropy is None:
        raise ValueError("entropy: required when entropy_coef is non-zero")
    if spec.correction is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp: required by correction={spec.correction!r}")

    extra = {}
    if ref_logp is not None:
        extra["ref_logp"] = ref_logp.detach() if isinstance(ref_logp, Tensor) else ref_logp
    if entropy is not None:
        extra["entropy"] = entropy
    if token_weight is not None:
        extra["token_weight"] = token_weight.detach() if isinstance(token_weight, Tensor) else token_weight
    if kl_weight is not None:
        extra["kl_weight"] = kl_weight.detach() if isinstance(kl_weight, Tensor) else kl_weight
    if mismatch_mask is not None:
        extra["mismatch_mask"] = mismatch_mask.detach() if isinstance(mismatch_mask, Tensor) else mismatch_mask
    asked = {"old_entropy": old_entropy, "sentence_end": sentence_end, "topk_logp_sum": topk_logp_sum, "top1": top1,
             "topk_lse": topk_lse, "in_topk": in_topk, "proxy_logp": proxy_logp, "low_prob": low_prob,
             "entropy_score": entropy_score}
    for key in getattr(obj_opts, "token_inputs", ()):  # only what the objective reads; the rest is ignored
        value = asked.get(key)
        if value is None:
            raise ValueError(f"{key}: required by objective {spec.objective!r} with these options")
        keep_graph = key in ("topk_logp_sum", "topk_lse")  # the objective's gradient reaches π_θ's top-k through it
        extra[key] = value.detach() if isinstance(value, Tensor) and not keep_graph else value
    b, _ = batch_mod.build(logp, old_logp, advantages, mask, rollout_logp, cu_seqlens, extra)

    out = entry.fn(b, obj_opts)
    token_loss = out.loss
    metrics: dict[str, Tensor] = {}
    if spec.correction is not None:
        weights, corr_metrics = corrections.batch_correction_weights(spec.correction, b, spec.correction_options)
        token_loss = token_loss * weights
        metrics.update(corr_metrics)
    if token_weight is not None:
        token_loss = token_loss * _token_weight(b)
        metrics["token_weight_mean"] = b.token_mean(b.extra["token_weight"]).detach()

    pg_loss = aggregate(token_loss, b, agg, norm)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    if kl_weight is not None:  # SENT's KL to π_old on the low-entropy tokens (stage low_entropy_kl)
        from megapo.algorithms.semantic_entropy import old_kl_term

        old_kl = aggregate(old_kl_term(b.logp, b.old_logp, _kl_weight(b)), b, agg, norm)
        loss = loss + old_kl
        metrics["low_entropy_kl"] = old_kl.detach()
    if ref_logp is not None:
        kl = kl_penalty(b.logp, b.extra["ref_logp"], spec.kl_estimator)
        kl_loss = aggregate(kl, b, agg, norm)
        metrics["kl"] = b.token_mean(kl).detach()
        if spec.kl_coef:
            loss = loss + spec.kl_coef * kl_loss
    if entropy is not None:
        metrics["entropy"] = b.token_mean(b.extra["entropy"]).detach()
        if spec.entropy_coef:
            loss = loss - spec.entropy_coef * aggregate(b.extra["entropy"], b, agg, norm)

    metrics.update(_ratio_metrics(b, out))
    if b.rollout_logp is not None:
        metrics.update(corrections.mismatch_from_batch(b, b.extra.get("mismatch_mask")))
    return loss, metrics


def _ratio_metrics(b: batch_mod.TokenBatch, out) -> dict[str, Tensor]:
    ratio = out.ratio.detach()
    valid = b.mask
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)

    def frac(flags):
        return zero if flags is None else b.token_mean(flags.to(ratio.dtype)).detach()

    return {
        "clipfrac_low": frac(out.clip_low),
        "clipfrac_high": frac(out.clip_high),
        "clipfrac_dual": frac(out.clip_dual),
        "ratio_mean": b.token_mean(ratio).detach(),
        "ratio_min": ratio[valid].min(),
        "ratio_max": ratio[valid].max(),
    }

"""`policy_loss`: the one entry point the learner calls (docs/CONTRACTS.md).

    loss, metrics = policy_loss("gspo", logp, old_logp, adv, mask, global_seqs=n_seqs_all_ranks)
    # loss_agg "auto" (default): the objective's own, here GSPO's "seq-mean-token-mean"

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

# options policy_loss itself understands; everything else goes to the objective's options
_COMMON = ("correction", "correction_options", "max_len", "ref_logp", "kl_coef", "kl_estimator",
           "entropy", "entropy_coef", "token_weight", "old_entropy", "sentence_end")


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


def token_inputs(name: str, options: dict) -> tuple[str, ...]:
    """The per-token inputs objective `name` with these options (policy_loss's keywords, common ones included)
    reads beyond logp / old_logp / advantages: "old_entropy" (π_old's per-token entropy), "sentence_end"
    (1.0 at a sentence's last token). () for an unregistered name (a custom loss_fn's objective)."""
    from megapo.algorithms.registry import entries

    entry = next((e for e in entries("objective") if e.name == name), None)
    if entry is None:
        return ()
    opts = entry.make_options({k: v for k, v in options.items() if k not in _COMMON})
    return tuple(getattr(opts, "token_inputs", ()))


def _coef(name: str, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    return v


def policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    rollout_logp: Tensor | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    loss_agg: str = AUTO,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    global_polarity: PolarityCounts | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of objective `name` and its metrics (detached 0-d tensors, local to this shard).

    loss_agg: an aggregation name, or "auto" for the objective's registered (paper) default.
    Common options: correction (a correction name) and correction_options (dict); max_len (for
    loss_agg="seq-mean-token-sum-norm"); ref_logp + kl_coef (+ kl_estimator, default "k3") for a
    KL loss term; entropy (per-token entropies, differentiable) + entropy_coef for an entropy
    bonus; token_weight (per-token, detached, >= 0: a token_weight stage's output, megapo/algorithms/stages.py)
    multiplies the objective's per-token loss as a correction does, the normaliser unchanged; old_entropy
    (π_old's per-token entropy) and sentence_end (1.0 at each sentence's last token) reach the objective only
    when its options ask for them (`token_inputs`), and are refused missing then. Any other
    keyword is an option of the objective (see `megapo objectives`).
    global_polarity: loss_agg="balanced"'s sequence and token counts by advantage sign over the whole
    batch (aggregation.polarity_counts), so its shards, too, sum to the full-batch loss.
    """
    entry = get("objective", name)
    loss_agg = resolve(loss_agg, name)
    common = {k: options.pop(k) for k in _COMMON if k in options}
    obj_opts = entry.make_options(options)
    norm = Norm(
        global_tokens=_positive("global_tokens", global_tokens),
        global_seqs=_positive("global_seqs", global_seqs),
        max_len=_positive("max_len", common.get("max_len")),
        polarity=_polarity(global_polarity),
    )
    kl_coef = _coef("kl_coef", common.get("kl_coef", 0.0))
    entropy_coef = _coef("entropy_coef", common.get("entropy_coef", 0.0))
    ref_logp = common.get("ref_logp")
    entropy = common.get("entropy")
    if kl_coef and ref_logp is None:
        raise ValueError("ref_logp: required when kl_coef is non-zero")
    if entropy_coef and entropy is None:
        raise ValueError("entropy: required when entropy_coef is non-zero")
    correction = common.get("correction")
    if correction is not None and rollout_logp is None:
        raise ValueError(f"rollout_logp: required by correction={correction!r}")
    if correction is None and common.get("correction_options"):
        raise ValueError("correction_options: given without a correction")

    extra = {}
    if ref_logp is not None:
        extra["ref_logp"] = ref_logp.detach() if isinstance(ref_logp, Tensor) else ref_logp
    if entropy is not None:
        extra["entropy"] = entropy
    token_weight = common.get("token_weight")
    if token_weight is not None:
        extra["token_weight"] = token_weight.detach() if isinstance(token_weight, Tensor) else token_weight
    for key in getattr(obj_opts, "token_inputs", ()):  # only what the objective reads; the rest is ignored
        value = common.get(key)
        if value is None:
            raise ValueError(f"{key}: required by objective {name!r} with these options")
        extra[key] = value.detach() if isinstance(value, Tensor) else value
    b, _ = batch_mod.build(logp, old_logp, advantages, mask, rollout_logp, cu_seqlens, extra)

    out = entry.fn(b, obj_opts)
    token_loss = out.loss
    metrics: dict[str, Tensor] = {}
    if correction is not None:
        weights, corr_metrics = corrections.batch_correction_weights(correction, b, common.get("correction_options"))
        token_loss = token_loss * weights
        metrics.update(corr_metrics)
    if token_weight is not None:
        token_loss = token_loss * _token_weight(b)
        metrics["token_weight_mean"] = b.token_mean(b.extra["token_weight"]).detach()

    pg_loss = aggregate(token_loss, b, loss_agg, norm)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    if ref_logp is not None:
        kl = kl_penalty(b.logp, b.extra["ref_logp"], common.get("kl_estimator", "k3"))
        kl_loss = aggregate(kl, b, loss_agg, norm)
        metrics["kl"] = b.token_mean(kl).detach()
        if kl_coef:
            loss = loss + kl_coef * kl_loss
    if entropy is not None:
        metrics["entropy"] = b.token_mean(b.extra["entropy"]).detach()
        if entropy_coef:
            loss = loss - entropy_coef * aggregate(b.extra["entropy"], b, loss_agg, norm)

    metrics.update(_ratio_metrics(b, out))
    if b.rollout_logp is not None:
        metrics.update(corrections.mismatch_from_batch(b))
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

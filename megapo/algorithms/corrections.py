"""Train–inference mismatch corrections and metrics.

The engine samples from μ (its log-probs: `rollout_logp`), the learner computes π_old on the same
tokens (`old_logp`); they differ by numerics, kernels, MoE routing. A correction turns the token
ratio k_t = π_old(y_t)/μ(y_t) into a detached per-token weight that multiplies the objective's
per-token loss (0 = the token is masked out). Masked tokens stay in the loss normaliser, so the
gradient still does not depend on how the batch is split.

Use as `policy_loss(..., rollout_logp=mu, correction="tis", correction_options={"cap": 2.0})`,
or call `correction_weights` / `mismatch_metrics` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms import batch as batch_mod
from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.registry import get, register


def _log_k(b: TokenBatch) -> Tensor:
    """log(π_old/μ) per token, 0 on padding."""
    if b.rollout_logp is None:
        raise ValueError("rollout_logp: required by a train-inference mismatch correction")
    return (b.old_logp - b.rollout_logp) * b.fmask


def _check_bounds(lo: float, hi: float, names=("lo", "hi")) -> None:
    if not (0 <= lo < hi):
        raise ValueError(f"{names[0]}/{names[1]}: need 0 <= {names[0]} < {names[1]}, got {lo!r}, {hi!r}")


@dataclass
class CapOptions:
    cap: float = 2.0

    def __post_init__(self):
        if not self.cap > 0:
            raise ValueError(f"cap: must be > 0, got {self.cap!r}")


@dataclass
class BoundsOptions:
    lo: float = 0.5
    hi: float = 2.0

    def __post_init__(self):
        _check_bounds(self.lo, self.hi)


@dataclass
class GeoBoundsOptions:
    lo: float = 0.999
    hi: float = 1.001

    def __post_init__(self):
        _check_bounds(self.lo, self.hi)


@dataclass
class IcePopOptions:
    alpha: float = 0.5
    beta: float = 5.0

    def __post_init__(self):
        _check_bounds(self.alpha, self.beta, ("alpha", "beta"))


_TIS_PAPER = "Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL Training (TIS, blog)"
_MIS_PAPER = "Liu, Li et al. 2025, When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch (MIS, blog)"


@register("tis", "correction", "token", _TIS_PAPER, CapOptions)
def tis(b: TokenBatch, o: CapOptions) -> Tensor:
    """w_t = min(π_old(y_t)/μ(y_t), C)  (truncated importance sampling, token level)."""
    return torch.exp(_log_k(b)).clamp(max=o.cap)


@register("seq_tis", "correction", "sequence", _TIS_PAPER, CapOptions)
def seq_tis(b: TokenBatch, o: CapOptions) -> Tensor:
    """w_i = min(Π_t π_old(y_t)/μ(y_t), C) for every token of sequence i."""
    w = torch.exp(_log_k(b).sum(-1)).clamp(max=o.cap)
    return w[:, None].expand_as(b.logp)


def _inside(ratio: Tensor, lo: float, hi: float) -> Tensor:
    return ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)


# MIS (masked importance sampling, the MIS write-up; TRL's and ms-swift's *_mask modes, slime's and verl's
# sequence-level MIS) keeps the ratio inside the band: ρ·1[lo ≤ ρ ≤ hi]. The rs_* forms are rejection
# sampling (verl's rollout_rs): they keep or drop the token/sequence but do not re-weight it.


@register("mis_token", "correction", "token", _MIS_PAPER, BoundsOptions)
def mis_token(b: TokenBatch, o: BoundsOptions) -> Tensor:
    """ρ_t = π_old(y_t)/μ(y_t); w_t = ρ_t if lo <= ρ_t <= hi else 0  (masked importance sampling, token)."""
    k = torch.exp(_log_k(b))
    return k * _inside(k, o.lo, o.hi)


@register("mis_seq", "correction", "sequence", _MIS_PAPER, BoundsOptions)
def mis_seq(b: TokenBatch, o: BoundsOptions) -> Tensor:
    """ρ_i = Π_t π_old/μ; w_i = ρ_i if lo <= ρ_i <= hi else 0, on every token of sequence i
    (masked importance sampling, sequence)."""
    k = torch.exp(_log_k(b).sum(-1))
    return (k * _inside(k, o.lo, o.hi))[:, None].expand_as(b.logp)


@register("rs_token", "correction", "token", _MIS_PAPER + ", rejection sampling", BoundsOptions)
def rs_token(b: TokenBatch, o: BoundsOptions) -> Tensor:
    """w_t = 1 if lo <= π_old(y_t)/μ(y_t) <= hi else 0  (token rejection: a mask, no re-weighting)."""
    return _inside(torch.exp(_log_k(b)), o.lo, o.hi)


@register("rs_seq", "correction", "sequence", _MIS_PAPER + ", rejection sampling", BoundsOptions)
def rs_seq(b: TokenBatch, o: BoundsOptions) -> Tensor:
    """w_i = 1 if lo <= Π_t π_old/μ <= hi else 0, for the whole sequence (sequence rejection)."""
    return _inside(torch.exp(_log_k(b).sum(-1)), o.lo, o.hi)[:, None].expand_as(b.logp)


@register("rs_geo", "correction", "sequence", _MIS_PAPER + ", geometric rejection sampling", GeoBoundsOptions)
def rs_geo(b: TokenBatch, o: GeoBoundsOptions) -> Tensor:
    """w_i = 1 if lo <= exp((1/|y_i|)·Σ_t log(π_old/μ)) <= hi else 0 (geometric-mean ratio; rejection
    only: the geometric mean is not an importance weight)."""
    return _inside(torch.exp(b.seq_mean(_log_k(b))), o.lo, o.hi)[:, None].expand_as(b.logp)


@register(
    "icepop", "correction", "token",
    "Ling Team 2025, Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model (Ring-1T, "
    "arXiv:2510.18855), IcePop",
    IcePopOptions,
)
def icepop(b: TokenBatch, o: IcePopOptions) -> Tensor:
    """k_t = π_old(y_t)/μ(y_t); w_t = k_t if α <= k_t <= β else 0 (IcePop's M(k): calibrate inside
    the band, drop the token's gradient outside it)."""
    k = torch.exp(_log_k(b))
    return k * _inside(k, o.alpha, o.beta)


def batch_correction_weights(name: str, b: TokenBatch, options: dict | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached weights [S, T] of correction `name` and its metrics."""
    entry = get("correction", name, argument="correction")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"correction_options: expected a dict, got {type(options).__name__}")
    opts = entry.make_options(dict(options or {}))
    w = entry.fn(b, opts).detach() * b.fmask
    metrics = {
        "correction_weight_mean": b.token_mean(w).detach(),
        "correction_masked_frac": b.token_mean((w == 0).to(w.dtype)).detach(),
    }
    return w, metrics


def mismatch_from_batch(b: TokenBatch, keep: Tensor | None = None) -> dict[str, Tensor]:
    """Engine (μ) vs learner (π_old) mismatch over the valid tokens, samples drawn from μ.

    k1 = mean(log μ - log π_old) and k3 = mean(ρ - 1 - log ρ) with ρ = π_old/μ estimate KL(μ‖π_old);
    χ² = mean(ρ²) - 1 estimates χ²(π_old‖μ); ess = (Σρ)²/(N·Σρ²) ∈ (0, 1] is the normalised
    effective sample size of the token weights; max_abs_dlogp = max |log π_old - log μ|.
    `keep` ([S, T] 0/1, TrainSample.mismatch_mask): only its valid 1s count, the tokens whose μ this step's engine
    gave (SOUP's historical prefixes, μ an older policy's and π_old := μ there, are 0s); with none kept the means
    are 0.
    """
    log_rho = _log_k(b)
    rho = torch.exp(log_rho)
    m = b.fmask if keep is None else b.fmask * keep
    n = m.sum()
    sum_rho = (rho * m).sum()
    sum_rho2 = (rho * rho * m).sum()
    out = {
        "mismatch_tokens": n.detach(),  # the tokens the means are over (the learner weighs them by it)
        "mismatch_k1": (-(log_rho) * m).sum().detach() / n,
        "mismatch_k3": ((rho - 1 - log_rho) * m).sum().detach() / n,
        "mismatch_chi2": (sum_rho2 / n - 1).detach(),
        "mismatch_ess": (sum_rho * sum_rho / (n * sum_rho2)).detach(),
        "mismatch_max_abs_dlogp": log_rho.abs().masked_fill(m == 0, 0).max().detach(),
    }
    if keep is None:
        return out
    # a micro-batch may keep none (SOUP's prefixes only): 0, not 0/0, adds nothing to the learner's reduction
    return {name: torch.where(n > 0, v, torch.zeros_like(v)) for name, v in out.items()}


def mismatch_metrics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cu_seqlens=None) -> dict[str, Tensor]:
    """Mismatch metrics for padded [B, T] or packed [N] (+cu_seqlens) inputs."""
    b, _ = batch_mod.build(old_logp, old_logp, torch.zeros_like(old_logp), mask, rollout_logp, cu_seqlens)
    return mismatch_from_batch(b)


def correction_weights(
    name: str, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, *, cu_seqlens=None, **options
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token detached weights of correction `name`, in the caller's layout, and metrics."""
    b, layout = batch_mod.build(old_logp, old_logp, torch.zeros_like(old_logp), mask, rollout_logp, cu_seqlens)
    w, metrics = batch_correction_weights(name, b, options)
    return layout.to_input(w), metrics

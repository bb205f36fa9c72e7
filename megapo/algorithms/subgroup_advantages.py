"""Advantage estimators that split each group of n responses into two subgroups and compare within and across them.

Same contract as megapo.algorithms.advantages: rewards [P, n] (compute_advantages reshapes flat input), `lengths`
the response tokens of each sample (same shape), one advantage per response out. Both estimators act on each
prompt's group alone, so the advantages do not depend on how the batch's prompts are split.

    drpo    correct vs incorrect responses; the length signal is normalised among the correct ones only
    canon   the shorter vs the longer half of the group; inter- and intra-subgroup baselines
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.options import check_number
from megapo.algorithms.registry import register


def _need_lengths(lengths: Tensor | None, name: str) -> Tensor:
    if lengths is None:
        raise ValueError(f"lengths: {name} reads each response's token count; pass lengths")
    return lengths


# ----------------------------------------------------------------------------- DRPO


@dataclass
class DrpoOptions:
    lam: float = 0.1  # λ, the KL-regularisation temperature of the positive distribution (public code: 0.1)
    max_len: int = 0  # L_max in the length ratio L/L_max: best the generation budget (0: the group's longest)
    correct_threshold: float = 0.5  # a response is correct when R >= this (as data.correct_threshold)

    def __post_init__(self):
        check_number("lam", self.lam, above=0)
        check_number("max_len", self.max_len, low=0, integer=True)
        check_number("correct_threshold", self.correct_threshold)


def drpo_positive_weights(lengths: Tensor, correct: Tensor, lam: float, max_len: Tensor | int) -> Tensor:
    """ŵ_i = exp((1 − L_i/L_max)/λ) / Σ_{j correct} exp((1 − L_j/L_max)/λ) on the correct responses of a group, 0
    on the others: the closed-form positive distribution P*(o) ∝ π_old⁺(o)·exp(r(o)/λ) (max E_P[r] − λ·KL(P‖π_old⁺),
    r = 1 − L/L_max) estimated on the group's correct samples by self-normalised importance weights."""
    score = (1 - lengths.to(torch.float64) / max_len) / lam
    return torch.softmax(score.masked_fill(~correct, float("-inf")), dim=-1).nan_to_num(0.0)


@register(
    "drpo", "advantage", "group",
    "Li, Chen, Lin, Yang 2025, DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization (arXiv:2510.04474)",
    DrpoOptions, min_group=2,  # a group of one has no correct/incorrect pair to discriminate
)
def drpo(r: Tensor, o: DrpoOptions, lengths: Tensor | None) -> Tensor:
    """Per group of n: correct C = {i: R_i >= correct_threshold}, incorrect N the rest;
    ŵ_i = exp((1 − L_i/L_max)/λ) / Σ_{j∈C} exp((1 − L_j/L_max)/λ) (the length reward normalised within the correct
    responses only, so a long correct response is never pushed down by the incorrect ones);
    L_max = max_len, or the group's longest response when max_len is 0;
    A_i = n·ŵ_i for i ∈ C, A_i = −n/|N| for i ∈ N; A = 0 for the whole group when C or N is empty (the public
    code drops such groups). With the seq-mean-token-mean aggregation and a log-likelihood objective the loss is
    then the paper's per-prompt discriminative objective Σ_C ŵ_i·s_i − mean_N s_j averaged over prompts.
    Assumption: the incorrect responses weigh 1/|N| each (the public code's log-mean-exp over them, temperature
    τ = 10 on mean token log-likelihoods, needs the policy's scores inside the loss and is near uniform there);
    the KL trust region is the objective's (ppo clip, kl_coef), not DRPO's constraint penalty; the public code's
    L_max is the generation budget, which an estimator is not told: max_len 0 falls back to the group's longest
    response (set max_len to rollout.max_new_tokens for the paper's form)."""
    lengths = _need_lengths(lengths, "drpo")
    correct = r >= o.correct_threshold
    n_pos = correct.sum(-1, keepdim=True)
    n_neg = r.shape[-1] - n_pos
    max_len = o.max_len or lengths.max(-1, keepdim=True).values
    w = drpo_positive_weights(lengths, correct, o.lam, max_len)
    neg = -1.0 / n_neg.clamp(min=1).to(r.dtype)
    adv = r.shape[-1] * torch.where(correct, w, neg.expand_as(r))
    return torch.where((n_pos > 0) & (n_neg > 0), adv, torch.zeros_like(adv))


# ----------------------------------------------------------------------------- CANON


CANON_METRICS = ("length",)


@dataclass
class CanonOptions:
    mu: float = 1.0  # μ: weight of the inter-subgroup estimate (1 − μ: intra); public code's default 1.0
    metric: str = "length"  # what the group is split by (entropy: not built, see the formula)

    def __post_init__(self):
        check_number("mu", self.mu, low=0, high=1)
        if self.metric == "entropy":
            raise ValueError("metric: entropy is not built: the estimator runs before the old-log-prob pass that "
                             "computes π_old's entropy; use metric: length")
        if self.metric not in CANON_METRICS:
            raise ValueError(f"metric: must be one of {', '.join(CANON_METRICS)}, got {self.metric!r}")


def canon_high_half(metric: Tensor) -> Tensor:
    """Per group of n: True for the ⌈n/2⌉ responses with the highest metric, False for the ⌊n/2⌋ lowest (order by
    (metric, index): ties keep the response order)."""
    ranks = torch.argsort(torch.argsort(metric, dim=-1, stable=True), dim=-1)
    return ranks >= metric.shape[-1] // 2


@register(
    "canon", "advantage", "group",
    "Chen et al. 2025, Conditional Advantage Estimation for Reinforcement Learning in Large Reasoning Models "
    "(CANON, arXiv:2509.23962), on response length",
    CanonOptions, min_group=2,  # both subgroups need a response
)
def canon(r: Tensor, o: CanonOptions, lengths: Tensor | None) -> Tensor:
    """Per group of n: sort by the metric (response length L_i; ties by index), the ⌊n/2⌋ lowest form S⁻, the rest
    S⁺; for i in subgroup S with the other subgroup S':
    A_i = μ·(R_i − mean_{S'} R) + (1 − μ)·(R_i − mean_S R)
    (inter-subgroup: which direction of the metric pays, A_i = (R_i − mean_S R) + (mean_S R − mean_{S'} R);
    intra-subgroup: the better response of the same trend). μ = 1/2 with n even is Dr. GRPO's R_i − mean R.
    Assumption: the public code's asymmetry factors (α = 1, β = 0 by default) are left out, and the Dr. GRPO
    division by the generation budget is the aggregation's business, as in dr_grpo. The entropy metric (the
    paper's main variant) needs π_old's per-response entropy before the estimator runs, a seam megapo lacks."""
    lengths = _need_lengths(lengths, "canon")
    high = canon_high_half(lengths)
    n = r.shape[-1]
    n_high, n_low = n - n // 2, n // 2
    mean_high = (r * high).sum(-1, keepdim=True) / n_high
    mean_low = (r * ~high).sum(-1, keepdim=True) / n_low
    own = torch.where(high, mean_high, mean_low)
    other = torch.where(high, mean_low, mean_high)
    return o.mu * (r - other) + (1 - o.mu) * (r - own)

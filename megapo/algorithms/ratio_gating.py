"""Objectives that gate the importance ratio at more than one level (token, turn, trajectory) or scale a sample by how
much its ratio was clipped (issue 32): s_ppo and st_ppo (Li et al. 2025, ST-PPO: Stabilized Off-Policy Proximal
Policy Optimization for Multi-Turn Agents, arXiv:2511.20718) and fiberpo (Li et al. 2026, Fibration Policy
Optimization, arXiv:2603.08239).

Conventions are objectives.py's: a per-token loss on the padded [S, T] view, one sequence per row, r_t =
π_θ(y_t)/π_old(y_t), ℓ_t = log r_t, A_t the advantage (token by token), sg[·] stop-gradient, |y_i| the row's number
of valid tokens. Every quantity here is per token or per row, so a split of the batch into micro-batches and DP
shards (whole sequences each) changes nothing. In the docstrings "Assumption:" marks what the abstract does not fix,
[P] a detail taken from the paper or a summary of it rather than the abstract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.objectives import ObjectiveOut, _log_bounds, _log_ratio
from megapo.algorithms.options import check_number, check_token_ids
from megapo.algorithms.registry import register
from megapo.algorithms.trust_region import sentence_ids, sentence_mean


def _pessimistic_gated(log_r: Tensor, gated: Tensor, adv: Tensor, cap: float) -> Tensor:
    """max(-A·e^ℓ, -A·e^g) for a gated log-ratio g <= cap. For A >= 0 the unclipped branch only wins while ℓ <= g
    <= cap, so it is computed from min(ℓ, cap) (same value and gradient where it wins, and no e^ℓ overflow)."""
    capped = torch.where(adv >= 0, log_r.clamp(max=cap), log_r)
    return torch.maximum(-adv * torch.exp(capped), -adv * torch.exp(gated))


# ----------------------------------------------------------------------------------------- s_ppo / st_ppo


@dataclass
class SPPOOptions:
    eps_low: float = 0.2  # [P] PPO's clip range, 0.2 in the paper's runs
    eps_high: float = 0.2
    bias_scale: float = 1.0  # Assumption: κ of the clipping-bias weight 1/(1 + κ·β_i); 0: no correction

    def __post_init__(self):
        check_number("eps_low", self.eps_low, low=0, below=1)  # log(1 - ε) finite
        check_number("eps_high", self.eps_high, low=0)
        check_number("bias_scale", self.bias_scale, low=0)


@dataclass
class STPPOOptions(SPPOOptions):
    # the token ids that end a turn (e.g. the tool-call or end-of-turn marker); [] : the response is one turn. The
    # learner flags them through the sentence_end input, so the option keeps sspo's name
    sentence_end_ids: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        check_token_ids("sentence_end_ids", self.sentence_end_ids)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("sentence_end",) if self.sentence_end_ids else ()


def clip_excess(log_ratio: Tensor, adv: Tensor, lo: float, hi: float) -> Tensor:
    """[S, T] detached e_t >= 0: how far (in log space) the ratio lies beyond the bound where PPO's clip takes the
    token's gradient away: ℓ - log(1+ε_high) when A > 0 and ℓ is above it, log(1-ε_low) - ℓ when A < 0 and ℓ is
    below it, else 0."""
    ell = log_ratio.detach()
    high = torch.where((adv > 0) & (ell > hi), ell - hi, torch.zeros_like(ell))
    low = torch.where((adv < 0) & (ell < lo), lo - ell, torch.zeros_like(ell))
    return high + low


def clipping_bias_weight(b: TokenBatch, excess: Tensor, bias_scale: float) -> Tensor:
    """[S, 1] detached ω_i = 1/(1 + κ·β_i), β_i = (1/|y_i|)·Σ_t e_t the row's mean clip excess."""
    beta = b.seq_mean(excess)[:, None]
    return 1.0 / (1.0 + bias_scale * beta)


def _corrected_ppo(b: TokenBatch, log_ratio: Tensor, o: SPPOOptions) -> ObjectiveOut:
    """ω_i·max(-A_t·e^{g_t}, -A_t·e^{clip(g_t, lo, hi)}) for the per-token log-ratio g_t the objective clips."""
    adv = b.advantages
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    gated = log_ratio.clamp(min=lo, max=hi)
    surrogate = _pessimistic_gated(log_ratio, gated, adv, hi)
    excess = clip_excess(log_ratio, adv, lo, hi)
    weight = clipping_bias_weight(b, excess * b.fmask, o.bias_scale)
    ell = log_ratio.detach()
    return ObjectiveOut(weight * surrogate, torch.exp(ell),
                        clip_low=(adv < 0) & (ell < lo) & b.mask, clip_high=(adv > 0) & (ell > hi) & b.mask)


PAPER_STPPO = ("Li et al. 2025, ST-PPO: Stabilized Off-Policy Proximal Policy Optimization for Multi-Turn Agents "
               "(arXiv:2511.20718; v2: Stabilizing Off-Policy Training for Long-Horizon LLM Agent via Turn-Level "
               "Importance Sampling and Clipping-Triggered Normalization)")


@register(
    "s_ppo", "objective", "token", PAPER_STPPO + ", S-PPO: clipping-bias correction on token-level PPO",
    SPPOOptions,
    loss_agg="token-mean",  # Assumption: PPO's token mean (the abstract names none)
)
def s_ppo(b: TokenBatch, o: SPPOOptions) -> ObjectiveOut:
    """loss_t = ω_i·max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)): token-level PPO whose sample i is
    down-weighted by its clipping bias. e_t = ℓ_t - log(1+ε_high) where A_t > 0 and ℓ_t is above that bound,
    log(1-ε_low) - ℓ_t where A_t < 0 and ℓ_t is below it, else 0 (how far the token sits past the bound where the
    clip takes its gradient away); β_i = (1/|y_i|)·Σ_t e_t; ω_i = sg[1/(1 + κ·β_i)] (κ = bias_scale; a sample
    nothing is clipped in keeps weight 1, so the correction is triggered by clipping). bias_scale 0 is PPO.
    Assumption: the abstract says only that the clipping-bias correction normalizes gradients by down-weighting
    unreliable, highly off-policy samples; the sample (a response), the measure β_i (mean log-space excess of the
    clipped tokens) and the form 1/(1 + κ·β) are ours."""
    return _corrected_ppo(b, _log_ratio(b), o)


def turn_log_ratio(b: TokenBatch) -> Tensor:
    """[S, T] ℓ̄_k = (1/|k|)·Σ_{t∈k} ℓ_t over the valid tokens of each token's turn k (differentiable through each of
    them); a turn ends at a token flagged in sentence_end, the tail after the last flag is one turn."""
    return sentence_mean(_log_ratio(b), sentence_ids(b), b.mask)


@register(
    "st_ppo", "objective", "token", PAPER_STPPO + ", ST-PPO (turn-level ratio + clipping-bias correction); "
    "Turn-PPO with bias_scale 0",
    STPPOOptions,
    loss_agg="token-mean",  # Assumption: PPO's token mean (the abstract names none)
)
def st_ppo(b: TokenBatch, o: STPPOOptions) -> ObjectiveOut:
    """A response splits into turns k at the tokens whose ids are in sentence_end_ids (the token ends its turn; the
    tail after the last one, or the whole response when none is given, is one turn). s_k = exp((1/|k|)·Σ_{t∈k} ℓ_t),
    the turn-level ratio (the geometric mean of the turn's token ratios, gradient through each of them) [P: a
    summary of the paper's turn-level importance sampling]; loss_t = ω_i·max(-A_t·s_k, -A_t·clip(s_k, 1-ε_low,
    1+ε_high)) for every token t of turn k, A_t token by token. ω_i = sg[1/(1 + κ·β_i)] as in s_ppo, with e_t
    measured on the token's turn ratio s_k. bias_scale 0: Turn-PPO; a single-turn response (no ids): the clipped
    ratio is GSPO's sequence ratio. Assumption: the clipping-bias measure and weight as in s_ppo."""
    return _corrected_ppo(b, turn_log_ratio(b), o)


# ----------------------------------------------------------------------------------------- fiberpo


@dataclass
class FiberPOOptions:
    base_eps_low: float = 0.05  # Assumption: the trajectory (base) budget on the geometric-mean ratio
    base_eps_high: float = 0.05
    fiber_eps_low: float = 0.2  # Assumption: the token (fiber) budget on the residual ratio r_t / s_i (PPO's 0.2)
    fiber_eps_high: float = 0.2

    def __post_init__(self):
        for key in ("base_eps_low", "fiber_eps_low"):
            check_number(key, getattr(self, key), low=0, below=1)
        for key in ("base_eps_high", "fiber_eps_high"):
            check_number(key, getattr(self, key), low=0)


def fiber_gated_log_ratio(b: TokenBatch, o: FiberPOOptions) -> tuple[Tensor, Tensor]:
    """([S, T] ĝ_t, [S, T] ℓ̄_i broadcast): ĝ_t = clip(ℓ̄_i, base bounds) + clip(ℓ_t - ℓ̄_i, fiber bounds), ℓ̄_i the
    row's mean log-ratio (both terms differentiable where not clipped)."""
    log_r = _log_ratio(b)
    mean = (b.seq_sum(log_r) / b.lengths.clamp(min=1))[:, None].expand_as(log_r)
    b_lo, b_hi = _log_bounds(o.base_eps_low, o.base_eps_high)
    f_lo, f_hi = _log_bounds(o.fiber_eps_low, o.fiber_eps_high)
    gated = mean.clamp(min=b_lo, max=b_hi) + (log_r - mean).clamp(min=f_lo, max=f_hi)
    return gated, mean


@register(
    "fiberpo", "objective", "token",
    "Li et al. 2026, Fibration Policy Optimization (arXiv:2603.08239), FiberPO: trajectory-token fiber bundle "
    "gating (the FiberPO-Domain hierarchy's domain and group levels are not built)",
    FiberPOOptions,
    loss_agg="seq-mean-token-mean",  # Assumption: each trajectory (a base point of the bundle) weighted equally
)
def fiberpo(b: TokenBatch, o: FiberPOOptions) -> ObjectiveOut:
    """The log-ratio splits into a base part, the trajectory aggregate ℓ̄_i = (1/|y_i|)·Σ_t ℓ_t (log of the
    geometric-mean ratio s_i), and a fiber part, the token residual δ_t = ℓ_t - ℓ̄_i. Each is gated by its own
    budget: ĝ_t = clip(ℓ̄_i, log(1-ε^b_low), log(1+ε^b_high)) + clip(δ_t, log(1-ε^f_low), log(1+ε^f_high));
    loss_t = max(-A_t·r_t, -A_t·e^{ĝ_t}) (PPO's pessimistic form with the clip replaced by the two-level gate).
    Inside both budgets ĝ_t = ℓ_t, so at π_θ = π_old the Jacobian ∂ĝ/∂ℓ is the identity and the loss is PPO's;
    ĝ_t depends only on its own row, so the Jacobian is block-diagonal over trajectories. A trajectory past its base
    budget keeps the gradient of its residuals (tokens move relative to each other, not the trajectory as a whole);
    a token past its fiber budget still moves with its trajectory's mean. Assumption: the abstract fixes the
    decomposition (a base gate on trajectory aggregates, a fiber gate on per-token residuals) and the two Jacobian
    properties; the aggregate (mean log-ratio), the additive log-space composition, hard clips as gates, the
    pessimistic max and the budgets' defaults are ours. The APC-Obj derivation and the FiberPO-Domain levels above
    the trajectory (domain, prompt group) are not built."""
    adv = b.advantages
    log_r = _log_ratio(b)
    gated, _ = fiber_gated_log_ratio(b, o)
    cap = _log_bounds(o.base_eps_low, o.base_eps_high)[1] + _log_bounds(o.fiber_eps_low, o.fiber_eps_high)[1]
    loss = _pessimistic_gated(log_r, gated, adv, cap)
    ell, g = log_r.detach(), gated.detach()
    return ObjectiveOut(loss, torch.exp(ell),
                        clip_low=(adv < 0) & (g > ell) & b.mask, clip_high=(adv > 0) & (g < ell) & b.mask)

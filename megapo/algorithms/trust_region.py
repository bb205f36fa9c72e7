"""Ratio and trust-region objectives (issue 14): minpro, dppo, cppo (and cppo_prefix_mean), dhpo, sspo,
holder, kpo, aspo.

Conventions are objectives.py's: a per-token loss on the padded [S, T] view, r_t = π_θ(y_t)/π_old(y_t),
ℓ_t = log r_t, A_t the advantage, sg[·] stop-gradient. A sequence is a row of that view (batch.build
scatters a packed batch by cu_seqlens, as gspo relies on), and every prefix or per-sequence quantity
runs over the row's valid (mask=1) tokens only: "t" is a token's 1-based position among them, "L" their
number. In the docstrings [A] marks an assumption the abstract does not state, [P] a detail taken from
the paper or its public code rather than the abstract.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.objectives import (
    ObjectiveOut, _check_nonneg, _log_bounds, _log_ratio, _pessimistic, _seq_ratio_clip, check_entropy_scale,
    entropy_level, log_bounds_per_token, old_entropy,
)
from megapo.algorithms.options import check_choice, check_token_ids
from megapo.algorithms.registry import register

DIVERGENCES = ("tv", "kl")


def _check_positive(**values) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key}: must be a finite number > 0, got {value!r}")


def _ppo_mask_flags(adv: Tensor, ratio: Tensor, eps_low: float, eps_high: float):
    """Where PPO's clip leaves a token no gradient: A>0 above 1+ε_high, A<0 below 1-ε_low."""
    return (adv < 0) & (ratio < 1 - eps_low), (adv > 0) & (ratio > 1 + eps_high)


def _moves_with_advantage(adv: Tensor, log_r: Tensor) -> Tensor:
    """The token's probability has moved the way its advantage pushes it: A>0 and r>1, or A<0 and r<1."""
    return ((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0))


def _masked_ratio_loss(log_r: Tensor, adv: Tensor, keep: Tensor) -> Tensor:
    """-M_t·r_t·A_t. A dropped token's log-ratio is replaced by 0 first, so that an overflowing e^ℓ
    never meets a zero gradient (0·inf = NaN)."""
    safe = torch.where(keep, log_r, torch.zeros_like(log_r))
    return -keep.to(log_r.dtype) * torch.exp(safe) * adv


def binary_divergence(b: TokenBatch, kind: str) -> Tensor:
    """Detached [S, T] divergence of the Binary approximation (sampled token vs the rest), 0 on padding.

    p = π_θ(y_t), q = π_old(y_t); tv: |p - q|; kl: q·log(q/p) + (1-q)·log((1-q)/(1-p)) (0·log 0 = 0,
    so p = q = 1 gives 0 and p = 1 > q gives inf). Log-probs are taken as <= 0 (a rounding excess is
    clamped)."""
    logp = b.logp.detach().clamp(max=0)
    old = b.old_logp.clamp(max=0)
    if kind == "tv":
        d = (torch.exp(logp) - torch.exp(old)).abs()
    else:
        rest_p, rest_q = -torch.expm1(logp), -torch.expm1(old)
        d = torch.exp(old) * (old - logp) + torch.xlogy(rest_q, rest_q) - torch.xlogy(rest_q, rest_p)
    return torch.where(b.mask, d, torch.zeros_like(d))


def _exclusive_prefix_min(x: Tensor, mask: Tensor) -> Tensor:
    """[S, T]: min of x over the valid tokens before t in the row; +inf where there is none."""
    filled = x.masked_fill(~mask, math.inf)
    inclusive = torch.cummin(filled, -1).values
    first = torch.full_like(inclusive[:, :1], math.inf)
    return torch.cat([first, inclusive[:, :-1]], -1)


# ----------------------------------------------------------------------------------------- minpro


@dataclass
class MinPROOptions:
    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)


@register(
    "minpro", "objective", "token",
    "Lei, Cheng, Tao 2026, A Step Back: Prefix Importance Ratio Stabilizes Policy Optimization "
    "(arXiv:2601.22718), MinPRO",
    MinPROOptions,
    loss_agg="token-mean",  # [A] the paper's aggregation is not in the abstract: DAPO's token mean
)
def minpro(b: TokenBatch, o: MinPROOptions) -> ObjectiveOut:
    """m_t = min_{s<t} r_s over the sequence's earlier valid tokens, m_1 = 1 [A] (the abstract: the
    minimum token ratio observed in the preceding prefix replaces the cumulative prefix ratio Π_{s<t} r_s);
    loss_t = sg[m_t]·max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)) [A: PPO's clip on r_t, the
    prefix factor detached]. The ratio metric is m_t·r_t."""
    adv = b.advantages
    log_r = _log_ratio(b)
    prefix = _exclusive_prefix_min(log_r.detach(), b.mask)
    log_m = torch.where(torch.isinf(prefix), torch.zeros_like(prefix), prefix)
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    ratio = torch.exp(log_r.detach())
    low, high = _ppo_mask_flags(adv, ratio, o.eps_low, o.eps_high)
    return ObjectiveOut(torch.exp(log_m) * _pessimistic(log_r, adv, lo, hi), torch.exp(log_m + log_r.detach()),
                        clip_low=low, clip_high=high)


# ----------------------------------------------------------------------------------------- dppo


@dataclass
class DPPOOptions:
    divergence: str = "tv"
    delta: float = 0.15  # [A] not in the abstract

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        _check_positive(delta=self.delta)


@register(
    "dppo", "objective", "token",
    "Qi et al. 2026, Rethinking the Trust Region in LLM Reinforcement Learning (arXiv:2602.04879), "
    "DPPO, Binary approximation",
    DPPOOptions,
    loss_agg="token-mean",  # [A] the paper's aggregation is not in the abstract: DAPO's token mean
)
def dppo(b: TokenBatch, o: DPPOOptions) -> ObjectiveOut:
    """No ratio clip. D_t = the Binary divergence between π_θ and π_old at the sampled token
    (p = π_θ(y_t), q = π_old(y_t); divergence=tv: |p-q|; kl: q·log(q/p) + (1-q)·log((1-q)/(1-p)));
    M_t = 0 when D_t > δ and the token moves the way its advantage pushes it (A>0 and r>1, or A<0 and
    r<1), else 1 [A: PPO-style one-sided mask]; loss_t = -M_t·r_t·A_t (M_t detached). The Top-K
    approximation (π_old's top-K probabilities per token) is not implemented."""
    adv = b.advantages
    log_r = _log_ratio(b)
    drop = _moves_with_advantage(adv, log_r.detach()) & (binary_divergence(b, o.divergence) > o.delta)
    return ObjectiveOut(_masked_ratio_loss(log_r, adv, ~drop), torch.exp(log_r.detach()),
                        clip_low=drop & (adv < 0), clip_high=drop & (adv > 0))


# ----------------------------------------------------------------------------------------- cppo


@dataclass
class CPPOOptions:
    divergence: str = "tv"
    delta: float = 0.15  # [A] token threshold at t = 1
    w_min: float = 0.8  # [P] the position weight at the last token (the paper's default)
    budget: float = 1.0  # [A] the cumulative prefix budget: Σ_{s<=t} w_s·D_s may not pass it

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        _check_positive(delta=self.delta, w_min=self.w_min)
        if self.w_min > 1:
            raise ValueError(f"w_min: must be in (0, 1], got {self.w_min!r}")
        if self.budget is None:
            raise ValueError("budget: the cumulative prefix budget is a finite number > 0 (its default is 1.0); "
                             "the old prefix-mean bound (budget null: δ) is objective cppo_prefix_mean")
        _check_positive(budget=self.budget)


def _position_weights(b: TokenBatch, w_min: float) -> Tensor:
    """w_t = 1 - (1-w_min)·(t-1)/(L-1) (1 when L = 1): 1 at a row's first valid token, w_min at its last."""
    t = b.positions
    span = (b.lengths[:, None] - 1).clamp(min=1)
    return 1 - (1 - w_min) * (t - 1).clamp(min=0) / span


def _divergence_mask_loss(b: TokenBatch, over: Tensor) -> ObjectiveOut:
    """dppo's masked ratio loss: drop the tokens that are `over` and move the way their advantage pushes them."""
    adv = b.advantages
    log_r = _log_ratio(b)
    drop = _moves_with_advantage(adv, log_r.detach()) & over & b.mask
    return ObjectiveOut(_masked_ratio_loss(log_r, adv, ~drop), torch.exp(log_r.detach()),
                        clip_low=drop & (adv < 0), clip_high=drop & (adv > 0))


@register(
    "cppo", "objective", "token",
    "Mao et al. 2026, Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning "
    "(arXiv:2606.10968), CPPO (Cumulative Prefix-divergence Policy Optimization)",
    CPPOOptions,
    loss_agg="token-mean",  # [A] the paper's aggregation is not in the abstract: DAPO's token mean
)
def cppo(b: TokenBatch, o: CPPOOptions) -> ObjectiveOut:
    """D_t = the Binary divergence of dppo (divergence=tv|kl) between π_θ and π_old at the sampled token;
    w_t = 1 - (1-w_min)·(t-1)/(L-1) (w = 1 when L = 1), a linear weight from 1 at the first token to w_min at
    the last [P], so the position-weighted threshold D_t <= δ/w_t is strict early and relaxed late;
    C_t = Σ_{s<=t} w_s·D_s, the cumulative prefix divergence: a running sum that never shrinks, so drift spent
    early keeps counting against every later token (it compounds, where a prefix mean would dilute it), over
    every earlier valid token whether masked or not [A: the abstract names a cumulative prefix budget that
    tracks historical deviations and restricts further token-level deviation; the running sum, its weighting
    by w_s and the budget B (option `budget`, default 1.0 in the divergence's units) are assumptions];
    token t fits the budget left by its prefix when w_t·D_t <= B - C_{t-1}, i.e. C_t <= B;
    M_t = 0 when the token moves the way its advantage pushes it (A>0 and r>1, or A<0 and r<1) and
    (w_t·D_t > δ or C_t > B), else 1; loss_t = -M_t·r_t·A_t (M_t detached), as dppo."""
    div = binary_divergence(b, o.divergence)
    weighted = torch.where(b.mask, _position_weights(b, o.w_min) * div, torch.zeros_like(div))
    spent = torch.cumsum(weighted, -1)
    return _divergence_mask_loss(b, (weighted > o.delta) | (spent > o.budget))


@dataclass
class PrefixMeanOptions:
    divergence: str = "tv"
    delta: float = 0.15  # [A] token threshold at t = 1
    w_min: float = 0.8  # the position weight at the last token
    budget: float | None = None  # bound on the weighted prefix mean; None: delta

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        _check_positive(delta=self.delta, w_min=self.w_min)
        if self.w_min > 1:
            raise ValueError(f"w_min: must be in (0, 1], got {self.w_min!r}")
        if self.budget is not None:
            _check_positive(budget=self.budget)


@register(
    "cppo_prefix_mean", "objective", "token",
    "CPPO's position-weighted threshold (Mao et al. 2026, Beyond Uniform Token-Level Trust Region in LLM "
    "Reinforcement Learning, arXiv:2606.10968) with a bound on the prefix MEAN of the weighted divergence in "
    "place of its cumulative budget: not the paper's rule (what megapo called cppo before issue 32)",
    PrefixMeanOptions,
    loss_agg="token-mean",  # DAPO's token mean, as cppo
)
def cppo_prefix_mean(b: TokenBatch, o: PrefixMeanOptions) -> ObjectiveOut:
    """D_t and w_t as cppo; B_t = (1/t)·Σ_{s<=t} w_s·D_s, the weighted divergence's running MEAN over the prefix
    (every earlier valid token, masked or not): a large early drift is diluted as t grows, which is why this is
    not cppo's cumulative budget; M_t = 0 when the token moves the way its advantage pushes it and
    (w_t·D_t > δ or B_t > budget (default δ)), else 1; loss_t = -M_t·r_t·A_t (M_t detached)."""
    div = binary_divergence(b, o.divergence)
    weighted = torch.where(b.mask, _position_weights(b, o.w_min) * div, torch.zeros_like(div))
    prefix_avg = torch.cumsum(weighted, -1) / b.positions.clamp(min=1)
    budget = o.delta if o.budget is None else o.budget
    return _divergence_mask_loss(b, (weighted > o.delta) | (prefix_avg > budget))


# ----------------------------------------------------------------------------------------- dhpo


@dataclass
class DHPOOptions:
    alpha: float | str = 0.5  # weight of the token branch: a number (the averaged mixing) or "entropy"
    tok_eps_low: float = 0.2  # [A] PPO's range for the token branch
    tok_eps_high: float = 0.2
    seq_eps_low: float = 3e-4  # [A] GSPO's range for the sequence branch
    seq_eps_high: float = 4e-4
    entropy_scale: float = 1.0  # alpha=entropy: τ of α_t = 1 - e^{-H_t/τ} [A]

    def __post_init__(self):
        if self.alpha != "entropy":
            if isinstance(self.alpha, (str, bool)) or not isinstance(self.alpha, (int, float)):
                raise ValueError(f"alpha: must be a number in [0, 1] or 'entropy', got {self.alpha!r}")
            _check_nonneg(alpha=self.alpha)
            if self.alpha > 1:
                raise ValueError(f"alpha: must be in [0, 1], got {self.alpha!r}")
        _check_nonneg(tok_eps_low=self.tok_eps_low, tok_eps_high=self.tok_eps_high,
                      seq_eps_low=self.seq_eps_low, seq_eps_high=self.seq_eps_high)
        check_entropy_scale(self.entropy_scale)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("old_entropy",) if self.alpha == "entropy" else ()


def _mix(alpha: Tensor, token: Tensor, seq: Tensor) -> Tensor:
    """α·token + (1-α)·seq per token; the caller gives a branch of weight 0 a finite value (0·inf is NaN)."""
    return alpha * token + (1 - alpha) * seq


def _dhpo_alpha(b: TokenBatch, o: DHPOOptions) -> Tensor:
    if o.alpha == "entropy":
        return entropy_level(old_entropy(b), o.entropy_scale)
    return torch.full_like(b.old_logp, float(o.alpha))


@register(
    "dhpo", "objective", "token",
    "Min et al. 2026, Orchestrating Tokens and Sequences: Dynamic Hybrid Policy Optimization for RLVR "
    "(arXiv:2601.05607), DHPO, averaged mixing (alpha a number) and entropy-guided mixing (alpha=entropy)",
    DHPOOptions,
    loss_agg="seq-mean-token-mean",  # [A] GRPO's and GSPO's 1/G Σ_i 1/|y_i| Σ_t, the two it bridges
)
def dhpo(b: TokenBatch, o: DHPOOptions) -> ObjectiveOut:
    """s_i = exp((1/|y_i|)·Σ_t log r_{i,t}) (GSPO's sequence ratio, gradient through every token);
    ρ_t = α_t·r_t + (1-α_t)·s_i; ρ̂_t = α_t·clip(r_t, 1-ε^tok_low, 1+ε^tok_high) + (1-α_t)·clip(s_i,
    1-ε^seq_low, 1+ε^seq_high) (each branch clipped in its own range before mixing);
    loss_t = max(-A_t·ρ_t, -A_t·ρ̂_t). alpha a number: α_t = alpha (default 0.5: the averaged mixing).
    alpha=entropy (the entropy-guided mixing): α_t = 1 - e^{-H_t/τ}, H_t π_old's entropy at the token
    [A: the map and its direction: an uncertain token (a fork) leans on its own ratio, a near-certain one on
    the sequence's]. For A >= 0 the unclipped branch's ratios are capped where it can no longer win
    (r <= h/α, s <= h/(1-α), h the larger upper bound), which changes no value or gradient and keeps an
    overflowing ratio finite; a branch of weight 0 is evaluated at ratio 1."""
    adv = b.advantages
    log_r = _log_ratio(b)
    log_s = b.seq_mean(log_r)[:, None].expand_as(log_r)
    alpha = _dhpo_alpha(b, o)
    tok_lo, tok_hi = _log_bounds(o.tok_eps_low, o.tok_eps_high)
    seq_lo, seq_hi = _log_bounds(o.seq_eps_low, o.seq_eps_high)
    clipped = _mix(alpha, torch.exp(log_r.clamp(tok_lo, tok_hi)), torch.exp(log_s.clamp(seq_lo, seq_hi)))
    top = math.log(max(1 + o.tok_eps_high, 1 + o.seq_eps_high))
    tiny = torch.finfo(alpha.dtype).tiny
    has_tok, has_seq = alpha > 0, alpha < 1
    cap_r = top - torch.log(alpha.clamp(min=tiny))
    cap_s = top - torch.log((1 - alpha).clamp(min=tiny))
    capped_r = torch.where(adv >= 0, torch.minimum(log_r, cap_r), log_r)
    capped_s = torch.where(adv >= 0, torch.minimum(log_s, cap_s), log_s)
    zero = torch.zeros_like(log_r)
    unclipped = _mix(alpha, torch.exp(torch.where(has_tok, capped_r, zero)),
                     torch.exp(torch.where(has_seq, capped_s, zero)))
    loss = torch.maximum(-adv * unclipped, -adv * clipped)
    rho = _mix(alpha, torch.exp(torch.where(has_tok, log_r, zero).detach()),
               torch.exp(torch.where(has_seq, log_s, zero).detach()))
    clipped_d = clipped.detach()
    return ObjectiveOut(loss, rho, clip_low=(adv < 0) & (rho < clipped_d) & b.mask,
                        clip_high=(adv > 0) & (rho > clipped_d) & b.mask)


# ----------------------------------------------------------------------------------------- sspo


@dataclass
class SSPOOptions:
    eps_low: float = 0.05  # [A] between PPO's token range (0.2) and GSPO's sequence range (3e-4)
    eps_high: float = 0.05
    scale_min: float = 0.5  # [A] bounds of the entropy factor g_k on the clip range
    scale_max: float = 2.0
    sentence_end_ids: list = dataclasses.field(default_factory=list)  # the tokenizer's sentence-ending ids

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        _check_positive(scale_min=self.scale_min, scale_max=self.scale_max)
        if self.scale_max < self.scale_min:
            raise ValueError(f"scale_max: must be >= scale_min ({self.scale_min!r}), got {self.scale_max!r}")
        check_token_ids("sentence_end_ids", self.sentence_end_ids)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("old_entropy",) + (("sentence_end",) if self.sentence_end_ids else ())

    def config_check(self) -> None:
        """A run's config must give the sentence ends (megapo.algorithms.config.check_options asks; policy_loss
        does not: there, no ids is one sentence per response, the form its tests compare with GSPO)."""
        if not self.sentence_end_ids:
            raise ValueError(
                "sentence_end_ids: sspo needs the tokenizer's ids of the sentence-ending tokens (e.g. the ids of "
                "'.', '?', '!' and newline); without them the whole response is one sentence and sspo is GSPO "
                "with sspo's entropy-scaled clip, not subsentence-level policy optimization")


def sentence_ids(b: TokenBatch) -> Tensor:
    """[S, T] long: each valid token's sentence index within its row (0, 1, ...): a sentence ends at a token
    flagged in b.extra["sentence_end"]; without flags, or after the last one, the rest of the row is one."""
    ends = b.extra.get("sentence_end")
    if ends is None:
        return torch.zeros_like(b.mask, dtype=torch.long)
    flag = ((ends > 0.5) & b.mask).long()
    return torch.cumsum(flag, -1) - flag


def sentence_mean(values: Tensor, seg: Tensor, mask: Tensor) -> Tensor:
    """[S, T]: the mean of `values` over the valid tokens of each token's sentence (differentiable)."""
    rows, width = values.shape
    key = (torch.arange(rows, device=values.device)[:, None] * width + seg).reshape(-1)
    fmask = mask.to(values.dtype)
    sums = values.new_zeros(rows * width).index_add(0, key, (values * fmask).reshape(-1))
    counts = values.new_zeros(rows * width).index_add(0, key, fmask.reshape(-1))
    return (sums / counts.clamp(min=1))[key].reshape(rows, width)


@register(
    "sspo", "objective", "token",
    "Yang et al. 2025, SSPO: Subsentence-level Policy Optimization (arXiv:2511.04256)",
    SSPOOptions,
    loss_agg="seq-mean-token-mean",  # [A] the 1/G Σ_i 1/|y_i| Σ_t of the GRPO and GSPO it balances
)
def sspo(b: TokenBatch, o: SSPOOptions) -> ObjectiveOut:
    """A response splits into sentences k at its sentence-ending tokens (the tokenizer's ids in
    sentence_end_ids; the token ends its sentence; the tail after the last one, or the whole response when
    none is given, is one sentence: GSPO with this clip, which a run's config refuses, SSPOOptions.config_check).
    s_{i,k} = exp((1/|k|)·Σ_{t∈k} log r_t) (the sentence ratio, gradient
    through each of its tokens); H_k = the mean over k of π_old's per-token entropy, H̄_i its mean over the
    response; g_k = clamp(H_k/H̄_i, scale_min, scale_max) (1 when H̄_i = 0) [A: the abstract says sentence
    entropy widens the clip range of high-entropy and narrows that of low-entropy sentences; the relative
    form and its bounds are ours]; loss_t = max(-A·s_{i,k}, -A·clip(s_{i,k}, 1-ε_low·g_k, 1+ε_high·g_k)) on
    every token t of sentence k."""
    adv = b.advantages
    log_r = _log_ratio(b)
    seg = sentence_ids(b)
    log_s = sentence_mean(log_r, seg, b.mask)
    entropy = old_entropy(b)
    h_sentence = sentence_mean(entropy, seg, b.mask)
    h_response = b.seq_mean(entropy)[:, None]
    rel = h_sentence / torch.where(h_response > 0, h_response, torch.ones_like(h_response))
    g = torch.where(h_response > 0, rel.clamp(o.scale_min, o.scale_max), torch.ones_like(rel))
    lo, hi = log_bounds_per_token(o.eps_low * g, o.eps_high * g)
    s = log_s.detach()
    return ObjectiveOut(_pessimistic(log_s, adv, lo, hi), torch.exp(s),
                        clip_low=(adv < 0) & (s < lo) & b.mask, clip_high=(adv > 0) & (s > hi) & b.mask)


def sentence_end_flags(response_ids, end_ids) -> list[float]:
    """1.0 at each response token whose id is in `end_ids`, else 0.0 (sspo's policy_loss sentence_end)."""
    ends = set(end_ids)
    return [1.0 if int(t) in ends else 0.0 for t in response_ids]


# ----------------------------------------------------------------------------------------- holder


HOLDER_SCHEDULES = ("constant", "linear", "cosine", "poly", "cubic")


@dataclass
class HolderOptions:
    p: float = 0.0  # the exponent of schedule=constant; 0 is the geometric mean (GSPO)
    eps_low: float = 3e-4  # [A] GSPO's range, the p = 0 case
    eps_high: float = 4e-4
    # the paper's annealing of p over trainer steps: constant (p) | linear | cosine | poly | cubic, from p_start at
    # step 1 to p_end at step 1 + schedule_steps, then p_end (its maths runs: linear from 2 to -2)
    schedule: str = "constant"
    p_start: float = 2.0
    p_end: float = -2.0
    schedule_steps: int = 0  # trainer steps the schedule spans (> 0 unless constant)
    power: float = 2.0  # n of schedule=poly

    def __post_init__(self):
        for name in ("p", "p_start", "p_end", "power"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                what = "the Hölder exponent" if name != "power" else "the poly schedule's exponent"
                raise ValueError(f"{name}: {what} must be a finite real number, got {v!r}")
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        check_choice("schedule", self.schedule, HOLDER_SCHEDULES)
        if self.schedule != "constant":
            if isinstance(self.schedule_steps, bool) or not isinstance(self.schedule_steps, int) \
                    or self.schedule_steps < 1:
                raise ValueError(f"schedule_steps: schedule {self.schedule!r} needs the trainer steps it spans, an "
                                 f"int >= 1, got {self.schedule_steps!r}")
            if self.p != 0:
                raise ValueError(f"p: set by schedule {self.schedule!r} at every step (p_start -> p_end); "
                                 f"leave p unset, got {self.p!r}")
            if self.power <= 0:
                raise ValueError(f"power: the poly schedule's exponent must be > 0, got {self.power!r}")
        elif isinstance(self.schedule_steps, bool) or not isinstance(self.schedule_steps, int) \
                or self.schedule_steps < 0:
            raise ValueError(f"schedule_steps: must be an int >= 0, got {self.schedule_steps!r}")

    def p_at(self, step: int) -> float:
        """p at trainer step `step` (1-based): see holder_p."""
        return holder_p(self, step)

    def options_at(self, step: int) -> dict:
        """The options trainer step `step` trains with (LossSpec.at_step): the schedule resolved to its constant p."""
        if self.schedule == "constant":
            return {}
        return {"schedule": "constant", "p": self.p_at(step)}


def holder_p(o: HolderOptions, step: int) -> float:
    """HölderPO's p at trainer step `step`: x = min(1, (step − 1)/schedule_steps) [Assumption: step 1 is the
    schedule's start, the paper's code counts from its step 0], Δ = p_end − p_start;
    constant p; linear p_start + Δ·x; cosine p_start + Δ·(1 − cos πx)/2; poly p_start + Δ·x^power;
    cubic (p_start + p_end)/2 + (Δ/2)·(2x − 1)³ (the paper's code's linear/_dec, sin/cos, poly/_dec and cubic/_dec
    schedules, written from p_start to p_end)."""
    if o.schedule == "constant":
        return float(o.p)
    x = min(1.0, max(int(step) - 1, 0) / o.schedule_steps)
    start, delta = float(o.p_start), float(o.p_end) - float(o.p_start)
    if o.schedule == "linear":
        return start + delta * x
    if o.schedule == "cosine":
        return start + delta * (1.0 - math.cos(math.pi * x)) / 2.0
    if o.schedule == "poly":
        return start + delta * x ** float(o.power)
    return start + delta / 2.0 + delta / 2.0 * (2.0 * x - 1.0) ** 3


def log_power_mean(b: TokenBatch, log_r: Tensor, p: float) -> Tensor:
    """[S] log of the Hölder mean M_p = ((1/L)·Σ_t r_t^p)^(1/p) of each row's valid ratios (p = 0:
    the geometric mean), computed as (c + log1p((1/L)·Σ_t expm1(p·ℓ_t - c)))/p with c = max_t p·ℓ_t
    (detached): no overflow for any p, and no cancellation as p → 0. An empty row gives 0."""
    if p == 0:
        return b.seq_mean(log_r)
    scaled = p * log_r
    shift = scaled.detach().masked_fill(~b.mask, -math.inf).amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    terms = torch.expm1(torch.where(b.mask, scaled - shift, torch.zeros_like(scaled)))
    mean = terms.sum(-1) / b.lengths.clamp(min=1)
    return (shift.squeeze(-1) + torch.log1p(mean)) / p


@register(
    "holder", "objective", "sequence",
    "Chen et al. 2026, Hölder Policy Optimisation (arXiv:2605.12058), HölderPO",
    HolderOptions,
    loss_agg="seq-mean-token-mean",  # [A] the 1/G Σ_i form of the GSPO it contains (p = 0)
)
def holder(b: TokenBatch, o: HolderOptions) -> ObjectiveOut:
    """ρ_i = ((1/|y_i|)·Σ_t r_{i,t}^p)^(1/p) (the Hölder / power mean of the token ratios; p → 0 is
    the geometric mean, GSPO's s_i; p = 1 the arithmetic mean; any finite real p, negative included);
    loss = max(-A·ρ_i, -A·clip(ρ_i, 1-ε_low, 1+ε_high)) on every token of sequence i (sequence-level
    clipping [P]), gradient through every token. p over training (the paper's dynamic annealing), at trainer step
    t: x = min(1, (t − 1)/schedule_steps), Δ = p_end − p_start; schedule=constant p; linear p_start + Δ·x; cosine
    p_start + Δ·(1 − cos πx)/2; poly p_start + Δ·x^power; cubic (p_start + p_end)/2 + (Δ/2)·(2x − 1)³ (the paper's
    code's schedules; its maths runs: linear 2 → −2, its agent runs 1 → −1). How the step reaches the loss:
    the trainer hands each step's update LossSpec.at_step(step), the run's spec with this one per-step value
    resolved (objective_options p = p_t, schedule = constant); every other field stays run-fixed.
    Assumption: an unresolved schedule (policy_loss called directly) uses p_start, the step-1 value.
    Assumption: the clip stays GSPO's range by default (the paper's code clips ρ at 1 ± 0.2: set eps_low/eps_high)."""
    p = o.p if o.schedule == "constant" else float(o.p_start)
    log_rho = log_power_mean(b, _log_ratio(b), p)[:, None].expand_as(b.logp)
    return _seq_ratio_clip(b, log_rho, o)


# ----------------------------------------------------------------------------------------- kpo


@dataclass
class KPOOptions:
    process_var: float = 0.1  # [A] Q: how fast the latent log-ratio may drift from token to token
    obs_var: float = 1.0  # [A] R: the noise of one token's observed log-ratio
    init_var: float = 1.0  # [A] P_0: the prior variance around x_0 = 0 (on-policy)
    eps_low: float = 0.2  # PPO's clip, applied to the filtered ratio
    eps_high: float = 0.2
    gradient: str = "token"  # token: e^{x_t}·∇log π_t; filter: through the filter (past tokens too)

    def __post_init__(self):
        _check_nonneg(process_var=self.process_var, init_var=self.init_var,
                      eps_low=self.eps_low, eps_high=self.eps_high)
        _check_positive(obs_var=self.obs_var)
        check_choice("gradient", self.gradient, ("token", "filter"))


def kalman_gains(n: int, q: float, r: float, p0: float) -> list[float]:
    """Gains K_1..K_n of the scalar Kalman filter of a random walk (state noise q, observation noise
    r, prior variance p0): P⁻ = P + q, K = P⁻/(P⁻ + r), P = (1 - K)·P⁻. They do not depend on the data."""
    gains, var = [], p0
    for _ in range(n):
        prior = var + q
        k = prior / (prior + r)
        gains.append(k)
        var = (1 - k) * prior
    return gains


def causal_filter(values: Tensor, gains: Tensor, mask: Tensor, chunk: int = 64) -> Tensor:
    """x_t = (1 - k_t)·x_{t-1} + k_t·v_t along the last dim, x_0 = 0, k_t = gains[t-1] at the t-th
    valid token; an invalid position keeps x. Chunks of `chunk` tokens are solved in closed form
    (x_t = Σ_{s<=t} Π_{s<u<=t}(1-k_u)·k_s·v_s + Π_{u<=t}(1-k_u)·x_start) and chained, so the Python
    loop runs T/chunk times and every factor stays <= 1."""
    fmask = mask.to(values.dtype)
    pos = (torch.cumsum(fmask, -1).long() - 1).clamp(min=0)
    k = gains.to(values.dtype)[pos] * fmask
    log_keep = torch.log((1 - k).clamp(min=torch.finfo(values.dtype).tiny))
    drive = k * values
    x = values.new_zeros(values.shape[0])
    out = []
    for start in range(0, values.shape[-1], chunk):
        cum = torch.cumsum(log_keep[:, start:start + chunk], -1)
        width = cum.shape[-1]
        lower = torch.ones(width, width, dtype=torch.bool, device=values.device).tril()
        gap = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, 0.0)
        decay = torch.exp(gap) * lower
        block = (decay @ drive[:, start:start + chunk, None]).squeeze(-1) + torch.exp(cum) * x[:, None]
        out.append(block)
        x = block[:, -1]
    return torch.cat(out, -1)


@register(
    "kpo", "objective", "token",
    "He et al. 2026, Online Causal Kalman Filtering for Stable and Effective Policy Optimization "
    "(arXiv:2602.10609), KPO",
    KPOOptions,
    loss_agg="token-mean",  # [A] the paper's aggregation is not in the abstract: DAPO's token mean
)
def kpo(b: TokenBatch, o: KPOOptions) -> ObjectiveOut:
    """The token log-ratio ℓ_t is the noisy observation of a latent log-ratio x_t that follows a random
    walk [A: the state model]; a scalar Kalman filter runs causally over each sequence's valid tokens
    (no future token is used): x_0 = 0, P_0 = init_var; P⁻ = P + Q, K_t = P⁻/(P⁻ + R), x_t = x_{t-1} +
    K_t·(ℓ_t - x_{t-1}), P = (1 - K_t)·P⁻ (Q = process_var, R = obs_var; the gains tend to a constant,
    where the filter is exponential smoothing with weight K_∞). r̃_t = e^{x_t};
    loss_t = max(-A_t·r̃_t, -A_t·clip(r̃_t, 1-ε_low, 1+ε_high)) [A: PPO's clip on the filtered ratio].
    gradient=token [A]: x_t's value with gradient r̃_t·∇log π_θ(y_t) (log r̃ = sg[x_t] + log π - sg[log π]);
    gradient=filter: the gradient flows through the filter into the earlier tokens' log-ratios."""
    adv = b.advantages
    log_r = _log_ratio(b)
    gains = torch.tensor(kalman_gains(log_r.shape[-1], o.process_var, o.obs_var, o.init_var),
                         dtype=log_r.dtype, device=log_r.device)
    if o.gradient == "filter":
        state = causal_filter(log_r, gains, b.mask)
    else:
        state = causal_filter(log_r.detach(), gains, b.mask) + b.logp - b.logp.detach()
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    filtered = state.detach()
    return ObjectiveOut(_pessimistic(state, adv, lo, hi), torch.exp(filtered),
                        clip_low=(adv < 0) & (filtered < lo) & b.mask,
                        clip_high=(adv > 0) & (filtered > hi) & b.mask)


# ----------------------------------------------------------------------------------------- aspo


@dataclass
class ASPOOptions:
    eps_low: float = 0.2
    eps_high: float = 0.28  # [A] DAPO's clip-higher, which ASPO builds on
    dual_clip: float | None = 3.0  # [A] c of the soft dual clip; None: no cap

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if self.dual_clip is not None:
            _check_positive(dual_clip=self.dual_clip)
            if not self.dual_clip > 1:
                raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip!r}")


@register(
    "aspo", "objective", "token",
    "Wang et al. 2025, ASPO: Asymmetric Importance Sampling Policy Optimization (arXiv:2510.06062)",
    ASPOOptions,
    loss_agg="token-mean",  # [A] DAPO's token mean, the baseline it modifies
)
def aspo(b: TokenBatch, o: ASPOOptions) -> ObjectiveOut:
    """M_t = PPO's clip mask (0 when A_t > 0 and r_t > 1+ε_high, or A_t < 0 and r_t < 1-ε_low);
    w_t = 1/r_t for A_t > 0 (the flipped ratio), r_t otherwise; soft dual clip: w_t <- min(w_t, c), a
    capped weight that keeps the token's gradient instead of zeroing it [A: for both signs];
    loss_t = -M_t·sg[w_t]·A_t·log π_θ(y_t) [A: the weight on ∇log π_θ, as CISPO writes it]. Its value is a
    surrogate; its gradient is -M_t·w_t·A_t·∇log π_θ (for A<0 PPO's own gradient up to the cap)."""
    adv = b.advantages
    log_r = _log_ratio(b).detach()
    ratio = torch.exp(log_r)
    low, high = _ppo_mask_flags(adv, ratio, o.eps_low, o.eps_high)
    keep = (~(low | high)).to(log_r.dtype)
    log_w = torch.where(adv > 0, -log_r, log_r)
    dual = torch.zeros_like(b.mask)
    if o.dual_clip is not None:
        cap = math.log(o.dual_clip)
        dual = (log_w > cap) & (keep > 0) & b.mask
        log_w = log_w.clamp(max=cap)
    return ObjectiveOut(-keep * torch.exp(log_w) * adv * b.logp, ratio, clip_low=low, clip_high=high, clip_dual=dual)

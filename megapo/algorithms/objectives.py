"""Policy-gradient objectives, each as a per-token loss on the padded [S, T] view.

Every objective returns an `ObjectiveOut`: the per-token loss (aggregation over tokens and
sequences is done afterwards by `loss_agg`, see aggregation.py), the ratio it clips (for the ratio
metrics) and boolean maps of where it clipped. Notation: r_t = π_θ(y_t)/π_old(y_t) (token ratio),
A_t the advantage, sg[·] stop-gradient, |y| the sequence's number of valid tokens.

Sequence-level objectives (gspo, gmpo, vespo) compute one value per sequence and give it to each
of its tokens, so with loss_agg="seq-mean-token-mean" the loss is exactly the paper's per-sequence
objective averaged over sequences. Each objective registers its paper's aggregation (`loss_agg=`
below), which policy_loss uses when loss_agg is "auto" (the config's default). They use A_t token
by token; the caller broadcasts a per-sequence advantage (docs/CONTRACTS.md), which is the case the
papers cover.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.registry import register


@dataclass
class ObjectiveOut:
    loss: Tensor  # [S, T] per-token loss (padding positions are ignored by the aggregation)
    ratio: Tensor  # [S, T] the ratio the objective acts on (metrics only)
    clip_low: Tensor | None = None  # [S, T] bool
    clip_high: Tensor | None = None
    clip_dual: Tensor | None = None


def _check_nonneg(**values: float) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}: must be a finite number >= 0, got {value!r}")


def _log_ratio(b: TokenBatch) -> Tensor:
    # padding holds 0 in both, so its log-ratio is 0 (ratio 1) and sums over rows stay exact
    return (b.logp - b.old_logp) * b.fmask


def _log_bounds(eps_low: float, eps_high: float) -> tuple[float, float]:
    """Ratio bounds [1-ε_low, 1+ε_high] in log space (ε_low >= 1: no lower bound)."""
    return (math.log(1 - eps_low) if eps_low < 1 else -math.inf), math.log1p(eps_high)


def _pessimistic(log_ratio: Tensor, adv: Tensor, lo, hi, neg_cap: float | None = None) -> Tensor:
    """PPO's pessimistic surrogate as a loss, from the log-ratio ℓ and log-space bounds [lo, hi]:
    max(-A·e^ℓ, -A·e^{clip(ℓ, lo, hi)}).

    For A > 0 the unclipped branch only wins while ℓ <= hi, so it is computed from min(ℓ, hi)
    (same value and gradient where it matters); likewise ℓ is capped at `neg_cap` for A < 0 when a
    dual clip bounds the loss there. Without the caps a ratio that overflows to inf gives 0·inf =
    NaN gradients even though the token is clipped.
    """
    top = log_ratio.clamp(max=hi)
    if neg_cap is None:
        capped = torch.where(adv >= 0, top, log_ratio)  # A = 0: loss 0 either way, but never 0·inf
    else:
        capped = torch.where(adv > 0, top, log_ratio.clamp(max=neg_cap))
    clipped = torch.clamp(log_ratio, min=lo, max=hi)
    return torch.maximum(-adv * torch.exp(capped), -adv * torch.exp(clipped))


# ----------------------------------------------------------------------------------------- ppo


@dataclass
class PPOOptions:
    eps_low: float = 0.2
    eps_high: float = 0.2  # DAPO's clip-higher sets 0.28
    dual_clip: float | None = None  # c > 1: bound the loss of A<0 tokens by -c·A
    clip_mode: str = "fixed"  # dynamic: DCPO's bounds that widen for low-probability tokens; entropy: HAPO's
    ratio_cap: float = 10.0  # clip_mode=dynamic: the largest upper bound [P]
    eps_low_wide: float = 0.4  # clip_mode=entropy: ε_low at entropy 0 [A]
    eps_high_wide: float = 0.4  # clip_mode=entropy: ε_high as the entropy grows without bound [A]
    entropy_scale: float = 1.0  # clip_mode=entropy: τ of the entropy level 1 - e^{-H/τ} [A]
    clip_alpha: float = 1.0  # clip_mode=hapo: how far ĥ widens a token's bound (the authors' default)
    adv_beta: float = 1.0  # clip_mode=hapo: the advantage redistribution's A·(1 + β ĥ) (the authors' default)
    adaptive_advantage: bool = True  # clip_mode=hapo: redistribute the advantages (else the clip alone)
    entropy_pivot: float = 0.5  # clip_mode=hapo: the quantile of log-entropy ĥ is centred on (the median)

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip: must be > 1, got {self.dual_clip!r}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode: must be one of {', '.join(CLIP_MODES)}, got {self.clip_mode!r}")
        if isinstance(self.ratio_cap, bool) or not isinstance(self.ratio_cap, (int, float)) or not self.ratio_cap > 1 \
                or not math.isfinite(self.ratio_cap):
            raise ValueError(f"ratio_cap: must be a finite number > 1, got {self.ratio_cap!r}")
        _check_nonneg(eps_low_wide=self.eps_low_wide, eps_high_wide=self.eps_high_wide, clip_alpha=self.clip_alpha,
                      adv_beta=self.adv_beta)
        check_entropy_scale(self.entropy_scale)
        if not isinstance(self.adaptive_advantage, bool):
            raise ValueError(f"adaptive_advantage: must be true or false, got {self.adaptive_advantage!r}")
        if isinstance(self.entropy_pivot, bool) or not isinstance(self.entropy_pivot, (int, float)) \
                or not 0 <= self.entropy_pivot <= 1:
            raise ValueError(f"entropy_pivot: must be in [0, 1], got {self.entropy_pivot!r}")
        for name in ("eps_low", "eps_high"):
            if getattr(self, name + "_wide") < getattr(self, name):
                raise ValueError(f"{name}_wide: must be >= {name} ({getattr(self, name)!r}), "
                                 f"got {getattr(self, name + '_wide')!r}")

    @property
    def token_inputs(self) -> tuple[str, ...]:
        """Per-token inputs beyond logp / old_logp / advantages that the objective reads (policy_loss)."""
        return {"entropy": ("old_entropy",), "hapo": ("entropy_score",)}.get(self.clip_mode, ())


CLIP_MODES = ("fixed", "dynamic", "entropy", "hapo")


def check_entropy_scale(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"entropy_scale: must be a finite number > 0, got {value!r}")


def old_entropy(b: TokenBatch) -> Tensor:
    """π_old's per-token entropy (policy_loss's old_entropy; 0 on padding; a rounding excess below 0 clamped)."""
    if "old_entropy" not in b.extra:
        raise ValueError("old_entropy: this objective needs π_old's per-token entropy (policy_loss old_entropy=)")
    return b.extra["old_entropy"].detach().clamp(min=0)


def entropy_level(entropy: Tensor, scale: float) -> Tensor:
    """h = 1 - e^{-H/τ} in [0, 1): 0 for a certain token, rising with the entropy H (τ = `scale`, nats) [A: a
    fixed map, so the value of a token does not depend on the rest of the batch]."""
    return -torch.expm1(-entropy / scale)


def log_bounds_per_token(eps_low: Tensor, eps_high: Tensor) -> tuple[Tensor, Tensor]:
    """_log_bounds for per-token ε tensors: [log(1-ε_low), log(1+ε_high)], -inf where ε_low >= 1."""
    below_one = eps_low < 1
    lo = torch.log1p(-torch.where(below_one, eps_low, torch.zeros_like(eps_low)))
    return torch.where(below_one, lo, torch.full_like(lo, -math.inf)), torch.log1p(eps_high)


def entropy_bounds(b: TokenBatch, o: "PPOOptions") -> tuple[Tensor, Tensor]:
    """HAPO-style per-token bounds in log space from h = entropy_level(π_old's entropy):
    ε_low,t = ε_low + (ε_low_wide - ε_low)·(1 - h_t), ε_high,t = ε_high + (ε_high_wide - ε_high)·h_t."""
    h = entropy_level(old_entropy(b), o.entropy_scale)
    return log_bounds_per_token(o.eps_low + (o.eps_low_wide - o.eps_low) * (1 - h),
                                o.eps_high + (o.eps_high_wide - o.eps_high) * h)


def hapo_terms(b: TokenBatch, o: "PPOOptions", log_r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """HAPO's Asymmetric Adaptive Clipping and Differential Advantage Redistribution, as the authors' released
    ada_clip / ada_advantage, from each token's entropy score ĥ (entropy_score: hapo_entropy_scores over the whole
    batch). ε_low,t = ε_low (1 − α ĥ) where ĥ <= 0 (low entropy: may fall further), ε_high,t = ε_high (1 + α ĥ) where
    ĥ > 0 (high entropy: may rise further). With adaptive_advantage, inside the neutral band
    1 − ε_low,t/2 < r_t < 1 + ε_high,t/2 a high-entropy token keeps A_t and a low-entropy one takes A_t (1 + β ĥ);
    outside it, the other way round (the ratio selects, no gradient through the choice). -> (log lower bound, log upper
    bound, advantages)."""
    if "entropy_score" not in b.extra:
        raise ValueError("entropy_score: clip_mode hapo needs the batch-global entropy score (policy_loss "
                         "entropy_score=; the trainer computes it: objectives.hapo_entropy_scores)")
    h = b.extra["entropy_score"].detach().to(b.logp.dtype)
    low = torch.where(h <= 0, o.eps_low * (1 - o.clip_alpha * h), torch.full_like(h, o.eps_low))
    high = torch.where(h > 0, o.eps_high * (1 + o.clip_alpha * h), torch.full_like(h, o.eps_high))
    adv = b.advantages
    if o.adaptive_advantage:
        ratio = torch.exp(log_r.detach())
        neutral = (ratio > 1 - low / 2) & (ratio < 1 + high / 2)
        spread = adv * (1 + o.adv_beta * h)
        adv = torch.where(h > 0, torch.where(neutral, adv, spread), torch.where(neutral, spread, adv))
    lo, hi = log_bounds_per_token(low, high)
    return lo, hi, adv


def _policy_tokens(loss_mask: list | None, lengths: list[int]) -> list[Tensor]:
    """Per sample, bool per response token: loss_mask 1 (the policy's tokens); all where the batch or the sample has
    no loss_mask."""
    return [torch.ones(n, dtype=torch.bool) if loss_mask is None or loss_mask[i] is None
            else torch.as_tensor(loss_mask[i]).reshape(-1) == 1 for i, n in enumerate(lengths)]


def hapo_entropy_stats(entropies: list, loss_mask: list | None, pivot: float, eps: float = 1e-8
                       ) -> tuple[float, float, float, float] | None:
    """HAPO's statistics of a batch's entropies over its policy tokens (loss_mask 1; all when None): (centre,
    scale, top, bottom) with g = log max(H, eps), centre the pivot-quantile of g (nearest rank, as the authors'
    torch_quantile "nearest"), scale the root mean square of g − centre (at least sqrt(eps)), top = max(z) and bottom
    = min(z) of z = (g − centre) / scale (top >= eps, bottom <= −eps). None when the batch has no policy token.
    hapo_entropy_scores scores the batch's own tokens with them; the engine's adaptive temperature scores the next
    batch's (megapo.engines.base.EntropyTemperature)."""
    lengths = [len(e) for e in entropies]
    policy = _policy_tokens(loss_mask, lengths)
    values = [torch.log(torch.as_tensor(e, dtype=torch.float64).reshape(-1).clamp(min=eps))[m]
              for e, m in zip(entropies, policy)]
    values = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    if values.numel() == 0:
        return None
    k = round(pivot * (values.numel() - 1))  # Python's round, as the authors' torch_quantile
    centre = torch.kthvalue(values, k + 1).values
    scale = ((values - centre) ** 2).mean().clamp(min=eps).sqrt()
    batch_z = (values - centre) / scale
    return (float(centre), float(scale), float(batch_z.max().clamp(min=eps)), float(batch_z.min().clamp(max=-eps)))


def hapo_entropy_scores(entropies: list, loss_mask: list | None, pivot: float, eps: float = 1e-8) -> list[Tensor]:
    """HAPO's entropy score over a whole train batch (the authors' compute_entropy_h on its policy tokens, loss_mask 1;
    all when None): g = log max(H, eps) − the pivot-quantile of g (nearest rank, as torch_quantile "nearest"),
    divided by its root mean square; ĥ = g / max(g > 0) where g > 0, g / |min(g < 0)| where g <= 0, so ĥ in [-1, 1]
    with the low-entropy side negative (hapo_entropy_stats). [A] The released code multiplies that side by
    1 / min(g < 0), a negative number, which turns it positive (every token then counts as high-entropy); we keep
    the sign the abstract's asymmetric treatment needs. [A] The statistics are the whole batch's, computed once
    before the mini-batch split (the released code takes them per micro-batch), so no split changes them.
    Non-policy tokens get 0. -> per sample a float64 tensor."""
    lengths = [len(e) for e in entropies]
    stats = hapo_entropy_stats(entropies, loss_mask, pivot, eps)
    if stats is None:
        return [torch.zeros(n, dtype=torch.float64) for n in lengths]
    centre, scale, top, bottom = stats
    out = []
    for e, m in zip(entropies, _policy_tokens(loss_mask, lengths)):
        z = (torch.log(torch.as_tensor(e, dtype=torch.float64).reshape(-1).clamp(min=eps)) - centre) / scale
        out.append(torch.where(m, torch.where(z > 0, z / top, z / -bottom), torch.zeros_like(z)))
    return out


def dynamic_bounds(old_logp: Tensor, eps_low: float, eps_high: float, ratio_cap: float) -> tuple[Tensor, Tensor]:
    """DCPO's per-token ratio bounds in log space, from q = π_old(y_t) [P: the formula of a public DCPO
    implementation, not the abstract]: [(1 + √max(1 - 4ε_low/q, 0))/2, min((1 + √(1 + 4ε_high/q))/2, cap)].
    Both widen as q falls (the lower one to 1/2); at q = 1 they are [(1+√(1-4ε_low))/2, (1+√(1+4ε_high))/2]."""
    q = torch.exp(old_logp)
    low = (1 + torch.sqrt((1 - 4 * eps_low / q).clamp(min=0))) / 2
    high = ((1 + torch.sqrt(1 + 4 * eps_high / q)) / 2).clamp(max=ratio_cap)
    return torch.log(low), torch.log(high)


@register(
    "ppo", "objective", "token",
    "Schulman et al. 2017, PPO (arXiv:1707.06347); clip-higher: DAPO, Yu et al. 2025 "
    "(arXiv:2503.14476); dual clip: Ye et al. 2020 (arXiv:1912.09729); clip_mode=dynamic: Yang et al. "
    "2025, DCPO: Dynamic Clipping Policy Optimization (arXiv:2509.02333); clip_mode=entropy: "
    "Liu et al. 2025, From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature "
    "(arXiv:2509.16591), HAPO: clip_mode=hapo its Asymmetric Adaptive Clipping and Differential Advantage "
    "Redistribution (the authors' code), clip_mode=entropy an entropy-level reading of the abstract",
    PPOOptions,
    loss_agg="token-mean",  # PPO's per-token mean, as DAPO writes it
)
def ppo(b: TokenBatch, o: PPOOptions) -> ObjectiveOut:
    """loss_t = max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)); with dual clip c and A_t<0:
    loss_t = min(loss_t, -c·A_t).
    clip_mode=dynamic (DCPO; its smooth advantage standardisation is not part of this objective): the
    bounds depend on the token's prior probability q = π_old(y_t), wider for rare tokens (abstract),
    [(1 + √max(1 - 4ε_low/q, 0))/2, min((1 + √(1 + 4ε_high/q))/2, ratio_cap)] [P].
    clip_mode=hapo: HAPO's Asymmetric Adaptive Clipping and Differential Advantage Redistribution as the authors'
    released code (hapo_terms; π_old's entropy scored over the whole batch, hapo_entropy_scores; its token-level
    group average is the estimator hapo_tga; its adaptive sampling temperature is not built).
    clip_mode=entropy (an earlier reading of HAPO's clipping from its abstract alone): h_t = 1 - e^{-H_t/τ} from π_old's entropy H_t
    [A: the map], ε_low,t = ε_low + (ε_low_wide - ε_low)·(1 - h_t) (low-entropy tokens may fall further: the
    abstract's aggressive reduction of noisy low-entropy tokens), ε_high,t = ε_high + (ε_high_wide - ε_high)·h_t
    (high-entropy tokens may rise further: exploration) [A: the linear form and the wide ends' defaults]."""
    adv = b.advantages
    log_r = _log_ratio(b)
    ratio = torch.exp(log_r)
    if o.clip_mode == "dynamic":
        lo, hi = dynamic_bounds(b.old_logp, o.eps_low, o.eps_high, o.ratio_cap)
    elif o.clip_mode == "entropy":
        lo, hi = entropy_bounds(b, o)
    elif o.clip_mode == "hapo":
        lo, hi, adv = hapo_terms(b, o, log_r)
    else:
        lo, hi = _log_bounds(o.eps_low, o.eps_high)
    neg_cap = None if o.dual_clip is None else math.log(o.dual_clip)
    loss = _pessimistic(log_r, adv, lo, hi, neg_cap)
    dual = torch.zeros_like(b.mask)
    if o.dual_clip is not None:
        bound = -o.dual_clip * adv
        dual = (adv < 0) & (ratio > o.dual_clip)
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return ObjectiveOut(
        loss, ratio,
        clip_low=(adv < 0) & (log_r < lo) & b.mask,
        clip_high=(adv > 0) & (log_r > hi) & b.mask,
        clip_dual=dual,
    )


# ----------------------------------------------------------------------------------------- gspo


@dataclass
class GSPOOptions:
    eps_low: float = 3e-4
    eps_high: float = 4e-4

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)


def _seq_ratio_clip(b: TokenBatch, log_s: Tensor, o) -> ObjectiveOut:
    adv = b.advantages
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    loss = _pessimistic(log_s, adv, lo, hi)
    s = torch.exp(log_s.detach())
    return ObjectiveOut(
        loss, s,
        clip_low=(adv < 0) & (s < 1 - o.eps_low) & b.mask,
        clip_high=(adv > 0) & (s > 1 + o.eps_high) & b.mask,
    )


@register(
    "gspo", "objective", "sequence",
    "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)",
    GSPOOptions,
    loss_agg="seq-mean-token-mean",  # the paper's 1/G Σ_i over sequences
)
def gspo(b: TokenBatch, o: GSPOOptions) -> ObjectiveOut:
    """s_i = exp((1/|y_i|)·Σ_t log r_{i,t}); loss = max(-A·s_i, -A·clip(s_i, 1-ε_low, 1+ε_high)),
    the same value on every token of sequence i (its default loss_agg "seq-mean-token-mean" gives the
    paper's 1/G Σ_i form)."""
    log_s = b.seq_mean(_log_ratio(b))[:, None].expand_as(b.logp)
    return _seq_ratio_clip(b, log_s, o)


@register(
    "gspo_token", "objective", "token",
    "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071), GSPO-token",
    GSPOOptions,
    loss_agg="seq-mean-token-mean",  # the paper's 1/G Σ_i 1/|y_i| Σ_t
)
def gspo_token(b: TokenBatch, o: GSPOOptions) -> ObjectiveOut:
    """s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)] (value s_i, gradient s_i·∇log π_θ(y_t));
    loss_t = max(-A_t·s_{i,t}, -A_t·clip(s_{i,t}, 1-ε_low, 1+ε_high))."""
    log_s = b.seq_mean(_log_ratio(b)).detach()[:, None] + b.logp - b.logp.detach()
    return _seq_ratio_clip(b, log_s, o)


# ----------------------------------------------------------------------------------------- gmpo


@dataclass
class GMPOOptions:
    eps_low: float = 0.4  # log-space: ratio bounds [e^-0.4, e^0.4]
    eps_high: float = 0.4

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)


@register(
    "gmpo", "objective", "sequence",
    "Zhao et al. 2025, Geometric-Mean Policy Optimization (arXiv:2507.20673)",
    GMPOOptions,
    loss_agg="seq-mean-token-mean",  # the paper's 1/G Σ_i over sequences
)
def gmpo(b: TokenBatch, o: GMPOOptions) -> ObjectiveOut:
    """ℓ_t = log r_t, c_t = clip(ℓ_t, -ε_low, ε_high), sgn = sign(A_t);
    ℓ'_t = sgn·min(sgn·ℓ_t, sgn·c_t)  (pessimistic: A>0 clips only from above, A<0 from below);
    ρ_i = exp((1/|y_i|)·Σ_t ℓ'_t) (geometric mean of the clipped token ratios); loss = -A·ρ_i."""
    adv = b.advantages
    log_r = _log_ratio(b)
    sgn = torch.sign(adv)
    clipped = log_r.clamp(-o.eps_low, o.eps_high)
    log_final = sgn * torch.minimum(sgn * log_r, sgn * clipped)
    rho = torch.exp(b.seq_mean(log_final))[:, None].expand_as(b.logp)
    return ObjectiveOut(
        -adv * rho, rho,
        clip_low=(adv < 0) & (log_r < -o.eps_low),
        clip_high=(adv > 0) & (log_r > o.eps_high),
    )


# ----------------------------------------------------------------------------------------- sapo


@dataclass
class SAPOOptions:
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self):
        for key in ("tau_pos", "tau_neg"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{key}: must be > 0, got {value!r}")


@register(
    "sapo", "objective", "token",
    "Gao et al. 2025, Soft Adaptive Policy Optimization (arXiv:2511.20347)",
    SAPOOptions,
    loss_agg="seq-mean-token-mean",  # the paper's 1/G Σ_i 1/|y_i| Σ_t (GRPO's form)
)
def sapo(b: TokenBatch, o: SAPOOptions) -> ObjectiveOut:
    """f(r) = σ(τ·(r-1))·4/τ with τ = τ_pos if A_t > 0 else τ_neg; loss_t = -f(r_t)·A_t.
    f'(1) = 1, so on-policy the gradient is REINFORCE's; far from 1 it decays smoothly."""
    adv = b.advantages
    ratio = torch.exp(_log_ratio(b))
    # the gate is flat (σ' = 0 in floating point) long before e^20; capping there keeps an
    # overflowing ratio from turning 0·inf into a NaN gradient
    gate_ratio = torch.exp(_log_ratio(b).clamp(max=20.0))
    tau = torch.where(adv > 0, torch.full_like(adv, o.tau_pos), torch.full_like(adv, o.tau_neg))
    gate = torch.sigmoid(tau * (gate_ratio - 1)) * 4 / tau
    return ObjectiveOut(-gate * adv, ratio)


# ----------------------------------------------------------------------------------------- cispo


@dataclass
class CISPOOptions:
    eps_low: float = 1.0  # 1.0: no lower bound on the weight, as in the paper's experiments
    eps_high: float = 0.28

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)


@register(
    "cispo", "objective", "token",
    "MiniMax 2025, MiniMax-M1 (arXiv:2506.13585), CISPO",
    CISPOOptions,
    loss_agg="token-mean",  # the paper normalises by Σ_i |o_i|
)
def cispo(b: TokenBatch, o: CISPOOptions) -> ObjectiveOut:
    """loss_t = -sg[clip(r_t, 1-ε_low, 1+ε_high)]·A_t·log π_θ(y_t); every token keeps a gradient."""
    ratio = torch.exp(_log_ratio(b))
    weight = ratio.clamp(1 - o.eps_low, 1 + o.eps_high).detach()
    return ObjectiveOut(
        -weight * b.advantages * b.logp, ratio,
        clip_low=(ratio < 1 - o.eps_low) & b.mask,
        clip_high=(ratio > 1 + o.eps_high) & b.mask,
    )


# ----------------------------------------------------------------------------------------- vespo


@dataclass
class VESPOOptions:
    k: float = 2.0
    lam: float = 2.0  # φ peaks at W = k/λ; k = λ keeps the on-policy weight φ(1) = 1 at the peak

    def __post_init__(self):
        _check_nonneg(k=self.k, lam=self.lam)


@register(
    "vespo", "objective", "sequence",
    "Shen et al. 2026, VESPO: Variational Sequence-level Soft Policy Optimization (arXiv:2602.10693)",
    VESPOOptions,
    loss_agg="seq-mean-token-sum",  # the paper's Σ_t log π per sequence
)
def vespo(b: TokenBatch, o: VESPOOptions) -> ObjectiveOut:
    """W_i = Π_t r_{i,t} (no length normalisation), computed as log W_i = Σ_t log r_{i,t};
    φ(W) = e^λ·W^k·e^{-λW} = exp(λ + k·log W - λ·W) (φ(1) = 1);
    loss_t = -sg[φ(W_i)]·A_t·log π_θ(y_t): the importance-weighted policy gradient with W replaced
    by the reshaped weight φ(W). Its value is a surrogate; only its gradient is meaningful. Its
    default loss_agg "seq-mean-token-sum" is the paper's Σ_t log π per sequence."""
    log_w = b.seq_sum(_log_ratio(b))
    # W = e^{log W} may overflow to inf: then -λW = -inf and φ = 0, which is the kernel's limit
    log_phi = o.lam + o.k * log_w - o.lam * torch.exp(log_w)
    phi = torch.exp(log_phi).detach()[:, None]
    w = torch.exp(log_w)[:, None].expand_as(b.logp)
    return ObjectiveOut(-phi * b.advantages * b.logp, w)


# ----------------------------------------------------------------------------------------- ctpo


@dataclass
class CTPOOptions:
    eps_low: float = 0.2  # log-space bound at t = 1; at position t it is ε·√t
    eps_high: float = 0.2
    detach_prefix: bool = True  # gradient ρ_{≤t}·∇log π_t (the paper's token-level PG term)

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)


@register(
    "ctpo", "objective", "token",
    "Zhang et al. 2026, Rethinking Importance Sampling in LLM Policy Optimization: "
    "A Cumulative Token Perspective (arXiv:2605.07331), CTPO",
    CTPOOptions,
    loss_agg="token-mean",  # the paper's choice not verified here: DAPO's token mean
)
def ctpo(b: TokenBatch, o: CTPOOptions) -> ObjectiveOut:
    """c_t = Σ_{s≤t} log r_s (cumulative token log-ratio; with detach_prefix the prefix Σ_{s<t} is
    sg[·], so the gradient is ρ_{≤t}·∇log π_t); ρ_{≤t} = e^{c_t};
    bounds in log space: [-ε_low·√t, ε_high·√t], t = 1-based position among valid tokens;
    loss_t = max(-A_t·e^{c_t}, -A_t·e^{clip(c_t, -ε_low√t, ε_high√t)})."""
    adv = b.advantages
    log_r = _log_ratio(b)
    cum = torch.cumsum(log_r, -1)
    if o.detach_prefix:
        cum = (cum - log_r).detach() + log_r
    sqrt_t = torch.sqrt(b.positions.clamp(min=1))
    lo, hi = -o.eps_low * sqrt_t, o.eps_high * sqrt_t
    loss = _pessimistic(cum, adv, lo, hi)
    return ObjectiveOut(
        loss, torch.exp(cum.detach()),
        clip_low=(adv < 0) & (cum < lo) & b.mask,
        clip_high=(adv > 0) & (cum > hi) & b.mask,
    )


# ----------------------------------------------------------------------------------------- minirl


@dataclass
class MiniRLOptions:
    eps_low: float = 0.2
    eps_high: float = 0.28
    mismatch_cap: float | None = None  # optional truncation C of the mismatch weight π_old/μ

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if self.mismatch_cap is not None and not self.mismatch_cap > 0:
            raise ValueError(f"mismatch_cap: must be > 0, got {self.mismatch_cap!r}")


@register(
    "minirl", "objective", "token",
    "Zheng et al. 2025, Stabilizing Reinforcement Learning with LLMs: Formulation and Practices "
    "(arXiv:2512.01374), MiniRL",
    MiniRLOptions,
    loss_agg="token-mean",  # the paper's choice not verified here: DAPO's token mean
)
def minirl(b: TokenBatch, o: MiniRLOptions) -> ObjectiveOut:
    """w_t = sg[π_θ/μ] = sg[r_t]·sg[π_old/μ] (staleness × train-inference mismatch; μ = the engine's
    rollout_logp, mismatch factor 1 when it is not given, optionally capped at C);
    M_t = 0 when A_t > 0 and r_t > 1+ε_high, or A_t < 0 and r_t < 1-ε_low, else 1;
    loss_t = -M_t·w_t·A_t·log π_θ(y_t)."""
    adv = b.advantages
    ratio = torch.exp(_log_ratio(b))
    if b.rollout_logp is None:
        mismatch = torch.ones_like(ratio)
    else:
        mismatch = torch.exp((b.old_logp - b.rollout_logp) * b.fmask)
        if o.mismatch_cap is not None:
            mismatch = mismatch.clamp(max=o.mismatch_cap)
    high = (adv > 0) & (ratio > 1 + o.eps_high)
    low = (adv < 0) & (ratio < 1 - o.eps_low)
    keep = (~(high | low)).to(ratio.dtype)
    weight = (ratio * mismatch).detach()
    return ObjectiveOut(-keep * weight * adv * b.logp, ratio, clip_low=low, clip_high=high)


# ----------------------------------------------------------------------------------------- reinforce


@dataclass
class ReinforceOptions:
    importance_weight: bool = False  # multiply by sg[r_t] (off-policy correction to π_old)


@register(
    "reinforce", "objective", "token",
    "Williams 1992, Simple statistical gradient-following algorithms (REINFORCE)",
    ReinforceOptions,
    loss_agg="token-mean",  # Williams fixes none: DAPO's token mean
)
def reinforce(b: TokenBatch, o: ReinforceOptions) -> ObjectiveOut:
    """loss_t = -A_t·log π_θ(y_t), or -sg[r_t]·A_t·log π_θ(y_t) with importance_weight."""
    ratio = torch.exp(_log_ratio(b))
    weight = ratio.detach() if o.importance_weight else torch.ones_like(ratio)
    return ObjectiveOut(-weight * b.advantages * b.logp, ratio)


# ----------------------------------------------------------------------------------------- fipo


def discounted_future_sum(values: Tensor, gamma: float, chunk: int = 256) -> Tensor:
    """[S, T] -> [S, T]: F_t = Σ_{s>=t} γ^{s-t}·values_s along each row. Blocks of `chunk` columns from the end:
    inside a block a [c, c] matrix of γ^{s-t} (s >= t), plus γ^{e-t}·F_e for the block after it (e its first
    column), so the Python loop runs T/chunk times and no γ^{-s} overflows."""
    rows, width = values.shape
    out = torch.empty_like(values)
    carry = values.new_zeros(rows)
    g = torch.tensor(gamma, dtype=values.dtype, device=values.device)
    for end in range(width, 0, -chunk):
        start = max(0, end - chunk)
        n = end - start
        idx = torch.arange(n, device=values.device)
        dist = idx[None, :] - idx[:, None]  # [t, s]: s - t
        decay = torch.where(dist >= 0, g ** dist.clamp(min=0).to(values.dtype), torch.zeros((), dtype=values.dtype,
                                                                                              device=values.device))
        block = values[:, start:end] @ decay.T + carry[:, None] * g ** (n - idx).to(values.dtype)[None, :]
        out[:, start:end] = block
        carry = block[:, 0]
    return out


@dataclass
class FIPOOptions:
    eps_low: float = 0.2
    eps_high: float = 0.28  # [P] DAPO's clip-higher: FIPO keeps DAPO's scaffold
    half_life: float | None = 32.0  # [P] tokens: γ = 2^(-1/half_life); null: no discount (γ = 1)
    clip: float = 0.2  # [P] ε_f of the influence weight's clip
    clip_high_only: bool = True  # [P] the weight in [1, 1 + ε_f] (else [1 - ε_f, 1 + ε_f])
    dual_clip: float | None = None  # [P] δ > 1 (10.0 in the paper's 32B recipe): dual clip, and r_t > δ leaves F
    safety_threshold: float | None = 4.0  # [P] A_t < 0 and r_t above it: the weight is held in [0.8, 1]

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        h = self.half_life
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h)
                              or not h > 0):
            raise ValueError(f"half_life: must be a finite number > 0 (null: no discount), got {h!r}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0 <= self.clip < 1:
            raise ValueError(f"clip: must be in [0, 1), got {self.clip!r}")
        if not isinstance(self.clip_high_only, bool):
            raise ValueError(f"clip_high_only: must be true or false, got {self.clip_high_only!r}")
        if self.dual_clip is not None and (isinstance(self.dual_clip, bool) or not isinstance(self.dual_clip, (int, float))
                                           or not math.isfinite(self.dual_clip) or not self.dual_clip > 1 + self.eps_high):
            raise ValueError(f"dual_clip: must be a finite number > 1 + eps_high, got {self.dual_clip!r}")
        s = self.safety_threshold
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0):
            raise ValueError(f"safety_threshold: must be a finite number > 0 (null: off), got {s!r}")

    @property
    def gamma(self) -> float:
        return 1.0 if self.half_life is None else 2.0 ** (-1.0 / self.half_life)


def fipo_weight(b: TokenBatch, o: FIPOOptions) -> Tensor:
    """[S, T] detached influence weight f_t of objective fipo (its docstring)."""
    log_r = _log_ratio(b).detach()
    delta = log_r
    if o.dual_clip is not None:
        delta = torch.where(log_r > math.log(o.dual_clip), torch.zeros_like(log_r), log_r)
    future = discounted_future_sum(delta, o.gamma)
    lo = 1.0 if o.clip_high_only else 1.0 - o.clip
    weight = torch.exp(future.clamp(max=math.log1p(o.clip))).clamp(lo, 1.0 + o.clip)
    if o.safety_threshold is not None:
        unsafe = (b.advantages < 0) & (log_r > math.log(o.safety_threshold))
        weight = torch.where(unsafe, weight.clamp(0.8, 1.0), weight)
    return weight


@register(
    "fipo", "objective", "token",
    "Ma et al. 2026, FIPO: Eliciting Deep Reasoning with Future-KL Influenced Policy Optimization (arXiv:2603.19835)",
    FIPOOptions,
    loss_agg="token-mean",  # [P] DAPO's token mean (the public implementation normalises by all response tokens)
)
def fipo(b: TokenBatch, o: FIPOOptions) -> ObjectiveOut:
    """Δ_t = log π_θ(y_t) - log π_old(y_t), the policy's drift inside the update (detached), 0 where r_t > δ when
    dual_clip δ is given [P]; F_t = Σ_{s>=t} γ^{s-t}·Δ_s over the rest of the response (the discounted future KL),
    γ = 2^(-1/half_life); f_t = sg[clip(exp(F_t), lo, 1 + ε_f)], lo = 1 (clip_high_only) or 1 - ε_f; where
    A_t < 0 and r_t > safety_threshold, f_t is held in [0.8, 1] [P]; Ã_t = A_t·f_t (the dense advantage: a token
    whose continuation this update is making likelier gets up to 1 + ε_f times the sequence advantage);
    loss_t = max(-Ã_t·r_t, -Ã_t·clip(r_t, 1-ε_low, 1+ε_high)), with dual clip δ for A_t < 0: min(loss_t, -δ·Ã_t).
    The abstract gives only "discounted future-KL divergence re-weights token advantages"; Δ's sign, γ, the
    exp-then-clip weight, the δ filter and the safety hold are [P: the public FIPO implementation and ms-swift's
    documentation of it]. At the first mini-batch of a step π_θ = π_old, so f_t = 1 and this is PPO: the weight
    acts as the update moves the policy (train.mini_batches > 1)."""
    weight = fipo_weight(b, o)
    ppo_opts = PPOOptions(eps_low=o.eps_low, eps_high=o.eps_high, dual_clip=o.dual_clip)
    out = ppo(TokenBatch(b.logp, b.old_logp, b.advantages * weight, b.mask, b.rollout_logp, b.extra), ppo_opts)
    return ObjectiveOut(out.loss, out.ratio, out.clip_low, out.clip_high, out.clip_dual)


# ----------------------------------------------------------------------------------------- search_sapo


SEARCH_SAPO_KL = ("k1", "k3")


@dataclass
class SearchSAPOOptions:
    eps_low: float = 0.2  # GRPO's clip (Search-R1's, the baseline it modifies)
    eps_high: float = 0.2
    beta: float = 0.1  # [A] weight of the conditional KL term
    prob_max: float = 0.2  # [A] "low probability": π_θ(y_t) below it
    drift: float = 0.2  # [A] "shifted excessively": r_t < 1 - drift (the lower clip edge by default)
    kl_approx: str = "k3"  # [A] KL(π_old‖π_θ) at the sampled token: k3 = r - 1 - log r (>= 0), k1 = -log r

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.beta)
        for key in ("prob_max", "drift"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{key}: must be in (0, 1], got {v!r}")
        if self.kl_approx not in SEARCH_SAPO_KL:
            raise ValueError(f"kl_approx: must be one of {', '.join(SEARCH_SAPO_KL)}, got {self.kl_approx!r}")


@register(
    "search_sapo", "objective", "token",
    "Li et al. 2026, Improving Search Agent with One Line of Code (arXiv:2603.10069), SAPO (Search Agent Policy "
    "Optimization; not the Soft Adaptive PO registered as sapo)",
    SearchSAPOOptions,
    loss_agg="seq-mean-token-mean",  # GRPO's 1/G Σ_i 1/|y_i| Σ_t, the objective it adds one line to
)
def search_sapo(b: TokenBatch, o: SearchSAPOOptions) -> ObjectiveOut:
    """GRPO's clipped surrogate plus a conditional token-level KL(π_old‖π_θ):
    loss_t = max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)) + β·M_t·k_t,
    M_t = 1 only where A_t > 0 (a positive token), π_θ(y_t) < prob_max (low probability) and r_t < 1 - drift
    (the policy has shifted it excessively away from π_old: the importance-sampling-ratio collapse the paper
    names), else 0, M_t detached; k_t = r_t - 1 - log r_t (kl_approx=k3) or -log r_t (k1), the sampled-token
    estimate of KL(π_old‖π_θ) with y_t ~ π_old. Where PPO's gradient -A_t·r_t·∇log π_θ vanishes as r_t → 0,
    the KL term's β·(1 - r_t) (k3) or β (k1) keeps pulling the token back. The abstract fixes the three conditions
    and the KL's direction; the thresholds, the estimator and β are assumptions [A]."""
    adv = b.advantages
    log_r = _log_ratio(b)
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    loss = _pessimistic(log_r, adv, lo, hi)
    ratio = torch.exp(log_r)
    ell = log_r.detach()
    drifted = (adv > 0) & (b.logp.detach() < math.log(o.prob_max)) & (ell < math.log1p(-o.drift)) & b.mask \
        if o.drift < 1 else torch.zeros_like(b.mask)
    # k on the drifted tokens only (elsewhere ℓ is replaced by 0 so that no overflowing e^ℓ meets a 0 weight)
    safe = torch.where(drifted, log_r, torch.zeros_like(log_r))
    kl = torch.expm1(safe) - safe if o.kl_approx == "k3" else -safe
    loss = loss + o.beta * drifted.to(loss.dtype) * kl
    return ObjectiveOut(loss, ratio,
                        clip_low=(adv < 0) & (ell < lo) & b.mask, clip_high=(adv > 0) & (ell > hi) & b.mask)


# ----------------------------------------------------------------------------------------- dgpo


@dataclass
class DGPOOptions:
    eps_low: float = 0.2
    eps_high: float = 0.28  # [A] DAPO's clip-higher, the baseline the paper compares with
    mix: float = 1.0  # [A] λ: the share of the sequence advantage redistributed by the gated scores (0: GRPO's)
    entropy_scale: float = 1.0  # [A] τ of the entropy gate g_t = 1 - e^{-H_t/τ}

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0 <= self.mix <= 1:
            raise ValueError(f"mix: must be in [0, 1], got {self.mix!r}")
        check_entropy_scale(self.entropy_scale)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("old_entropy",)

    # π_ref's per-token log-probs, which policy_loss hands every objective as ref_logp (the run loads a reference)
    reference_inputs = ("ref_logp",)


def binary_hellinger(logp: Tensor, other_logp: Tensor) -> Tensor:
    """Hellinger distance between the two-outcome distributions (the sampled token vs the rest) of p = e^logp
    and q = e^other: H = √(1 - √(p·q) - √((1-p)(1-q))), in [0, 1] (log-probs above 0 count as 0)."""
    lp, lq = logp.clamp(max=0), other_logp.clamp(max=0)
    bc = torch.exp((lp + lq) / 2) + torch.sqrt((-torch.expm1(lp)) * (-torch.expm1(lq)))
    return torch.sqrt((1 - bc).clamp(min=0))


def dgpo_token_advantages(b: TokenBatch, o: DGPOOptions) -> Tensor:
    """[S, T] detached Ã_t of objective dgpo (its docstring)."""
    if "ref_logp" not in b.extra:
        raise ValueError("ref_logp: objective dgpo measures each token's deviation from π_ref (policy_loss ref_logp=; "
                         "a run must load the reference)")
    dev = binary_hellinger(b.old_logp, b.extra["ref_logp"].detach())
    score = entropy_level(old_entropy(b), o.entropy_scale) * dev * b.fmask
    total = score.sum(-1, keepdim=True)
    share = torch.where(total > 0, b.lengths[:, None] * score / torch.where(total > 0, total, torch.ones_like(total)),
                        torch.ones_like(score))
    return b.advantages * (1 - o.mix + o.mix * share) * b.fmask


@register(
    "dgpo", "objective", "token",
    "Jin et al. 2026, DGPO: Distribution-Guided Policy Optimization for Fine-Grained Credit Assignment "
    "(arXiv:2605.03327)",
    DGPOOptions,
    loss_agg="token-mean",  # [A] the abstract names none: DAPO's token mean, the baseline it reports against
)
def dgpo(b: TokenBatch, o: DGPOOptions) -> ObjectiveOut:
    """D_t = Hellinger distance between π_old and π_ref at the token, in the binary form (the sampled token vs
    the rest): D_t = √(1 - √(q·p) - √((1-q)(1-p))), q = π_old(y_t), p = π_ref(y_t), bounded in [0, 1] where KL is
    not [A: which pair of policies and the binary form]; g_t = 1 - e^{-H_t/τ} the entropy gate from π_old's
    entropy H_t (a confident, low-entropy deviation scores near 0) [A: the map]; s_t = g_t·D_t the gated deviation
    score; the sequence advantage is redistributed over the sequence's L tokens in proportion to it:
    Ã_t = A·(1 - λ + λ·L·s_t/Σ_u s_u) (Σ_t Ã_t = L·A: the sequence's total credit kept; λ = mix; every factor 1
    when Σ_u s_u = 0) [A: the proportional form]; Ã detached. loss_t = max(-Ã_t·r_t, -Ã_t·clip(r_t, 1-ε_low,
    1+ε_high)). No KL penalty: the reference enters only through D_t (keep kl_coef 0; the run must still load
    π_ref and pass ref_logp)."""
    adv = dgpo_token_advantages(b, o)
    out = ppo(TokenBatch(b.logp, b.old_logp, adv, b.mask, b.rollout_logp, b.extra),
              PPOOptions(eps_low=o.eps_low, eps_high=o.eps_high))
    return ObjectiveOut(out.loss, out.ratio, out.clip_low, out.clip_high)


# ----------------------------------------------------------------------------------------- simko


@dataclass
class SimKOOptions:
    eps_low: float = 0.2
    eps_high: float = 0.2  # the released code clips symmetrically (its clip_ratio_low on both sides)
    k: int = 3  # K: π_θ's top-K candidates boosted at a correct response's high-entropy tokens (run scripts: 3)
    mix: float = 0.01  # α: the share of the ratio moved onto the top-K candidates (mix_topk_coef, run scripts: 0.01)
    tau: float = 0.8  # τ: a token is high-entropy above the τ-quantile of its response's entropies (code: 0.8)
    neg_scale: float = 1.1  # λ: the advantage factor of an incorrect response's top-1 high-entropy tokens (code: 1.1)

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k: must be an integer >= 1, got {self.k!r}")
        for name in ("mix", "tau"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {value!r}")
        if isinstance(self.neg_scale, bool) or not isinstance(self.neg_scale, (int, float)) \
                or not math.isfinite(self.neg_scale) or self.neg_scale < 0:
            raise ValueError(f"neg_scale: must be a finite number >= 0, got {self.neg_scale!r}")

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("old_entropy", "topk_logp_sum", "top1")

    @property
    def policy_topk(self) -> int:
        """How many of π_θ's most likely tokens the learner sums into topk_logp_sum (its top-k seam)."""
        return self.k


def high_entropy_tokens(entropy: Tensor, mask: Tensor, tau: float) -> Tensor:
    """[S, T] bool: H_t above the τ-quantile (linear interpolation) of its own sequence's valid tokens' entropies
    (a sequence without valid tokens has none)."""
    masked = torch.where(mask, entropy, torch.full_like(entropy, math.nan))
    threshold = torch.nanquantile(masked, tau, dim=-1, keepdim=True)
    return (entropy > threshold) & mask


@register(
    "simko", "objective", "token",
    "Peng et al. 2025, SimKO: Simple Pass@K Policy Optimization (arXiv:2510.14807)",
    SimKOOptions,
    loss_agg="token-mean",  # the released code's masked mean over all tokens
)
def simko(b: TokenBatch, o: SimKOOptions) -> ObjectiveOut:
    """γ_t = π_θ(y_t)/π_old(y_t); w_t = 1[H_t > q_τ(H of the response's tokens)] (high-entropy tokens);
    correct responses (Σ_t A_t > 0): r_t = (1 - α·w_t)·γ_t + (α·w_t/K)·Σ_{k=1..K} sg(γ_t)·π_θ(v_k)/sg(π_θ(v_k)),
    v_1..v_K π_θ's K most likely tokens at t: the value stays γ_t, the gradient moves the share α of it from
    log π_θ(y_t) onto the top-K candidates (the top-K boost); otherwise r_t = γ_t. Incorrect responses
    (Σ_t A_t < 0): A_t <- λ·A_t where w_t = 1 and y_t is π_θ's top-1 token (the stronger top-1 penalty).
    loss_t = max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)) (PPO's clip, decided on the value γ_t).
    The paper's ratio γ_k = π_θ(v_k)/π_old(v_k) enters only as sg(γ)/sg(γ_k)·γ_k, whose value is γ and whose
    gradient is γ·∇log π_θ(v_k): π_old's top-K log-probs cancel, so the learner supplies only
    topk_logp_sum = Σ_k log π_θ(v_k) (differentiable) and top1 [formula from the authors' released code].
    Assumptions: "correct" is a positive advantage sum (objectives see advantages, not verdicts; with binary rewards
    and group baselines they agree wherever A ≠ 0, and A = 0 trains nothing); H_t is π_old's entropy (on-policy
    steps: this forward's, as the released code; off-policy: the old-log-prob pass's); π_θ's top-K come from
    this forward's logits, as in the released code."""
    adv = b.advantages
    log_r = _log_ratio(b)
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    sums = (adv * b.fmask).sum(-1, keepdim=True)
    high = high_entropy_tokens(old_entropy(b), b.mask, o.tau)
    if "topk_logp_sum" not in b.extra or "top1" not in b.extra:
        raise ValueError("topk_logp_sum: objective simko needs π_θ's top-k log-prob sum and top1 flags "
                         "(policy_loss topk_logp_sum=, top1=; the learner computes them)")
    top1 = b.extra["top1"].detach() > 0.5
    adv = torch.where((sums < 0) & high & top1, o.neg_scale * adv, adv)
    clipped = ((adv > 0) & (log_r > hi)) | ((adv < 0) & (log_r < lo))
    gamma = torch.exp(torch.where(clipped, torch.zeros_like(log_r), log_r))  # no inf where the clip decides
    s = b.extra["topk_logp_sum"] * b.fmask
    boost = (o.mix * (high & (sums > 0)).to(gamma.dtype))
    ratio = (1 - boost) * gamma + (boost / o.k) * gamma.detach() * (o.k + s - s.detach())
    bound = torch.where(adv > 0, torch.full_like(adv, 1 + o.eps_high), torch.full_like(adv, max(1 - o.eps_low, 0.0)))
    loss = torch.where(clipped, -adv * bound, -adv * ratio)
    return ObjectiveOut(loss, torch.exp(log_r).detach(), clip_low=(adv < 0) & clipped & b.mask,
                        clip_high=(adv > 0) & clipped & b.mask)


# ----------------------------------------------------------------------------------------- lp_reg

LP_REG_THRESHOLDS = ("relative", "fixed")


@dataclass
class LpRegOptions:
    eps_low: float = 1.0  # the released recipes' clip_ratio_low 1.0 (no lower bound; their runs are on-policy)
    eps_high: float = 9.0  # the released recipes' clip_ratio_high
    min_p: float = 0.02  # κ (minp_p_threshold): the proxy drops tokens below τ = κ·max_v π(v) (or κ: threshold fixed)
    threshold: str = "relative"  # relative: τ = κ·max_v π(v) (the code's regular_type minp); fixed: τ = κ
    # ρ₋ (logp_neg_k_percent): the lowest-probability share of the train batch's negative tokens considered
    neg_fraction: float = 0.01
    pos_fraction: float = 0.0  # ρ₊ (logp_pos_k_percent, 0 in every released recipe): the same for positive tokens
    beta: float = 1.0  # β (ppo_kl_coef): weight of the KL to the proxy

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high, beta=self.beta)
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 < self.min_p <= 1:
            raise ValueError(f"min_p: must be in (0, 1], got {self.min_p!r}")
        if self.threshold not in LP_REG_THRESHOLDS:
            raise ValueError(f"threshold: must be one of {', '.join(LP_REG_THRESHOLDS)}, got {self.threshold!r}")
        for name in ("neg_fraction", "pos_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {value!r}")

    @property
    def token_inputs(self) -> tuple[str, ...]:
        """proxy_logp from the train forward; low_prob, the batch-global quantile's selection, from the trainer
        (low_prob_flags, set by megapo.trainer.update.set_low_prob after the old-log-prob pass)."""
        return ("proxy_logp", "low_prob")

    @property
    def policy_proxy(self) -> tuple[float, str]:
        """(min_p, threshold) of the min-p proxy the learner builds from this forward's logits (proxy_logp)."""
        return self.min_p, self.threshold


def low_prob_flags(old_logp: list, advantages: list, loss_mask: list | None, neg_fraction: float,
                   pos_fraction: float) -> list[Tensor]:
    """Lp-Reg's batch-global low-probability selection over a whole train batch: per sample a float64 tensor, 1.0 at
    the policy tokens (loss_mask 1; all when None) whose advantage A_t < 0 and log π_old(y_t) <= δ₋, or A_t > 0 and
    log π_old(y_t) <= δ₊, else 0.0. δ_s = the k-th smallest log π_old over the batch's n policy tokens of sign s,
    k = ⌈ρ_s·n⌉ (none where ρ_s = 0 or n = 0; ties at δ_s all selected). `advantages` per sample: a number or one
    per response token (an earlier token stage's)."""
    from megapo.algorithms.token_tensors import per_token_advantages, per_token_values

    lengths = [len(lp) if lp is not None else 0 for lp in old_logp]
    logp = per_token_values("old_logp", old_logp, lengths)
    adv = per_token_advantages(advantages, lengths)
    policy = _policy_tokens(loss_mask, lengths)
    flags = [torch.zeros(n, dtype=torch.float64) for n in lengths]
    for sign, share in ((-1.0, neg_fraction), (1.0, pos_fraction)):
        chosen = [(a * sign > 0) & m for a, m in zip(adv, policy)]
        values = torch.cat([lp[c] for lp, c in zip(logp, chosen)]) if logp else torch.zeros(0, dtype=torch.float64)
        if share <= 0 or values.numel() == 0:
            continue
        k = min(values.numel(), max(1, math.ceil(share * values.numel())))
        delta = torch.kthvalue(values, k).values
        for f, lp, c in zip(flags, logp, chosen):
            f[c & (lp <= delta)] = 1.0
    return flags


@register(
    "lp_reg", "objective", "token",
    "Huang et al. 2025, Low-probability Tokens Sustain Exploration in Reinforcement Learning with Verifiable Reward "
    "(arXiv:2510.03222), Lp-Reg",
    LpRegOptions,
    loss_agg="token-mean",  # the released recipes' loss_agg_mode
)
def lp_reg(b: TokenBatch, o: LpRegOptions) -> ObjectiveOut:
    """Proxy q = π's min-p filtering, renormalised: q(v) = π(v)·1[π(v) ≥ τ] / Σ_u π(u)·1[π(u) ≥ τ], τ = κ·max_u π(u)
    (threshold relative) or κ (fixed); log q(y_t) (proxy_logp) is reduced over the TP ranks' vocabulary slices from this
    forward's logits, detached. Reasoning sparks: M_t = 1 where A_t < 0 and π_old(y_t) <= δ₋, the ρ₋-quantile of
    π_old over the whole train batch's negative tokens (the ⌈ρ₋·n⌉-th smallest of its n; likewise δ₊ with ρ₊ for
    A_t > 0), and π_θ(y_t) < q(y_t) (the proxy keeps the token and raises it: a spark, not noise).
    loss_t = M_t·(−A_t·r_t + β·min(k3_t, 10)) + (1 − M_t)·max(−A_t·r_t, −A_t·clip(r_t, 1−ε_low, 1+ε_high)),
    k3_t = q/π_θ − log(q/π_θ) − 1 at y_t (the regulariser toward the proxy, the released code's low-variance KL
    estimate at the sampled token, clamped at 10; its selected tokens leave PPO's clip). The selection is detached.
    The quantile is batch-global: the trainer computes it once per step over the whole train batch after the
    old-log-prob pass, before any mini-, micro-batch or DP split (low_prob_flags; megapo.trainer.update), and hands
    the selection to every shard as the per-token input low_prob, so the loss does not depend on the split. That needs
    π_old before the update: an lp_reg run always takes the separate old-log-prob pass (a fused on-policy step, whose
    train forward is its own old-log-prob pass, cannot know the batch's quantile before its loss: one more forward
    per step there). [formula: the paper's δ_ρ^B percentile over the batch; the released code (CarlanLark/Lp-Reg-dev)]
    Assumptions: the quantile is taken over π_old (= π_θ on an on-policy step, where the paper and the recipes run;
    off-policy the code ranks each micro-batch by the current π_θ), per advantage sign (the code's split), with
    k = ⌈ρ·n⌉ tokens (the code: ⌊ρ·n⌋ of its micro-batch's, none when that is below 2); the proxy is built from this
    forward's π_θ (on-policy steps: π_old, as the recipes' minp_old_log_prob; off-policy: the code's other mode, the
    current policy)."""
    adv = b.advantages
    log_r = _log_ratio(b)
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    clipped_loss = _pessimistic(log_r, adv, lo, hi)
    if "proxy_logp" not in b.extra:
        raise ValueError("proxy_logp: objective lp_reg needs log q(y_t) of the min-p proxy (policy_loss proxy_logp=; "
                         "the learner computes it)")
    if "low_prob" not in b.extra:
        raise ValueError("low_prob: objective lp_reg needs the batch-global low-probability selection (policy_loss "
                         "low_prob=; the trainer computes it: objectives.low_prob_flags)")
    proxy = b.extra["proxy_logp"].detach()
    logp = b.logp.detach()
    spark = (b.extra["low_prob"].detach() > 0.5) & (adv != 0) & b.mask & (logp < proxy)
    gap = torch.where(spark, proxy - b.logp, torch.zeros_like(b.logp))  # log(q/π_θ), finite where selected
    k3 = (torch.exp(gap) - gap - 1).clamp(max=10.0)
    ratio = torch.exp(torch.where(spark, log_r, torch.zeros_like(log_r)))
    loss = torch.where(spark, -adv * ratio + o.beta * k3, clipped_loss)
    ell = log_r.detach()
    return ObjectiveOut(loss, torch.exp(ell), clip_low=(adv < 0) & (ell < lo) & b.mask & ~spark,
                        clip_high=(adv > 0) & (ell > hi) & b.mask & ~spark)


# ----------------------------------------------------------------------------------------- rlpt


@dataclass
class RLPTOptions:
    eps_low: float = 0.2  # [A] GRPO's clip, the scaffold the paper plugs into (it also runs on DAPO's)
    eps_high: float = 0.2
    k: int = 32  # [A] K: π_θ's K most likely tokens form the promising set (the paper: top-32 holds 99.5% of them)

    def __post_init__(self):
        _check_nonneg(eps_low=self.eps_low, eps_high=self.eps_high)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k: must be an integer >= 1, got {self.k!r}")

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("topk_lse", "in_topk")

    @property
    def policy_topk(self) -> int:
        """K of the learner's top-k seam: topk_lse = log Σ_{v ∈ P_t} π_θ(v) and in_topk over π_θ's K most likely."""
        return self.k


@register(
    "rlpt", "objective", "token",
    "Pang et al. 2026, Reinforcement Learning with Promising Tokens for Large Language Models (arXiv:2602.03195), RLPT",
    RLPTOptions,
    loss_agg="token-mean",  # [A] the abstract names none: DAPO's token mean
)
def rlpt(b: TokenBatch, o: RLPTOptions) -> ObjectiveOut:
    """The policy restricted to the promising set P_t (π_θ's K most likely tokens at t) by masking its softmax:
    π̃_θ(y_t) = π_θ(y_t)·1[y_t ∈ P_t] / Σ_{v ∈ P_t} π_θ(v); r̃_t = π̃_θ(y_t)/π̃_old(y_t) with
    log π̃_old(y_t) = log π_old(y_t) − sg(log Σ_{v ∈ P_t} π_θ(v)), so r̃_t's value is r_t and its gradient
    r_t·∇(log π_θ(y_t) − log Σ_{v ∈ P_t} π_θ(v)) = r_t·∇log π̃_θ(y_t): the policy gradient of the masked policy,
    whose logits outside P_t get none. loss_t = 1[y_t ∈ P_t]·max(−A_t·r̃_t, −A_t·clip(r̃_t, 1−ε_low, 1+ε_high));
    a sampled token outside P_t (π̃ = 0) trains nothing and stays in the normaliser. topk_lse and in_topk come from
    the learner's vocabulary-parallel top-k seam on this forward's logits (O(K) values per token cross TP ranks).
    Assumptions: P_t is the policy's own top-K at the update (the abstract's "semantic priors of the base model": the
    model being trained ranks the candidates; a frozen base model's top-K, MegatronReference.response_topk, is not
    wired); π̃_old's normaliser is this forward's (exact on on-policy steps, where π_θ = π_old; off-policy it keeps the
    value r_t); K, the clip and the aggregation are not in the abstract."""
    if "topk_lse" not in b.extra or "in_topk" not in b.extra:
        raise ValueError("topk_lse: objective rlpt needs log Σ_{v ∈ top-K} π_θ(v) and in_topk flags "
                         "(policy_loss topk_lse=, in_topk=; the learner computes them)")
    adv = b.advantages
    lse = b.extra["topk_lse"] * b.fmask
    inside = (b.extra["in_topk"].detach() > 0.5) & b.mask
    log_r = torch.where(inside, _log_ratio(b) - (lse - lse.detach()), torch.zeros_like(b.logp))
    lo, hi = _log_bounds(o.eps_low, o.eps_high)
    loss = _pessimistic(log_r, adv, lo, hi) * inside.to(b.logp.dtype)
    ell = log_r.detach()
    return ObjectiveOut(loss, torch.exp(ell), clip_low=(adv < 0) & (ell < lo) & inside,
                        clip_high=(adv > 0) & (ell > hi) & inside)

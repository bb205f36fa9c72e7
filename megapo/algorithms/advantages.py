"""Advantage estimators over groups of n responses per prompt.

Input: rewards [P, n] (P prompts, n samples each) or flat [P·n] with `group_size=n`, samples of a
prompt contiguous; `lengths` (response tokens per sample, same shape) for estimators that weigh
tokens. Output: one advantage per response, same shape as the input; the caller broadcasts it over
the response's tokens. Each estimator registers `min_group`, the fewest samples per prompt it is
defined for; compute_advantages refuses fewer, and the run config asks the same number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register


@dataclass
class StdOptions:
    eps: float = 1e-6
    unbiased: bool = True  # std with n-1 (torch.std's default)


@dataclass
class NoOptions:
    pass


WHITEN = ("token", "response")


@dataclass
class WhitenOptions:
    eps: float = 1e-6
    unbiased: bool = False  # population std, as OpenRLHF's token whitening
    whiten: str = "token"  # token: each response weighted by its length (OpenRLHF); response: each once

    def __post_init__(self):
        if self.whiten not in WHITEN:
            raise ValueError(f"whiten: must be one of {', '.join(WHITEN)}, got {self.whiten!r}")


@register("grpo", "advantage", "group", "Shao et al. 2024, DeepSeekMath / GRPO (arXiv:2402.03300)", StdOptions,
          min_group=2)  # the std of one sample is undefined
def grpo(r: Tensor, o: StdOptions, lengths: Tensor | None) -> Tensor:
    """A_i = (R_i - mean_g(R)) / (std_g(R) + eps) within each group g."""
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True, unbiased=o.unbiased) + o.eps)


@register("dr_grpo", "advantage", "group", "Liu et al. 2025, Dr. GRPO (arXiv:2503.20783)", NoOptions,
          min_group=2)  # one sample is its own baseline: every advantage 0
def dr_grpo(r: Tensor, o: NoOptions, lengths: Tensor | None) -> Tensor:
    """A_i = R_i - mean_g(R)  (no division by the std)."""
    return r - r.mean(-1, keepdim=True)


@register(
    "rloo", "advantage", "group",
    "Ahmadian et al. 2024, Back to Basics: REINFORCE-style optimization (RLOO, arXiv:2402.14740)",
    NoOptions, min_group=2,  # no one left out to be the baseline
)
def rloo(r: Tensor, o: NoOptions, lengths: Tensor | None) -> Tensor:
    """A_i = R_i - (1/(n-1))·Σ_{j≠i} R_j  (leave-one-out baseline)."""
    n = r.shape[-1]
    return r - (r.sum(-1, keepdim=True) - r) / (n - 1)


@register(
    "reinforce_pp_baseline", "advantage", "batch",
    "Hu et al. 2025, REINFORCE++ (arXiv:2501.03262), with group-mean baseline; whiten='token' as its "
    "authors' OpenRLHF (reinforce_baseline)",
    WhitenOptions, min_group=2,  # the group-mean baseline of one sample is itself: every advantage 0
)
def reinforce_pp_baseline(r: Tensor, o: WhitenOptions, lengths: Tensor | None) -> Tensor:
    """A'_i = R_i - mean_g(R); then whiten over the batch: A_i = (A'_i - m)/(s + eps), where m and s
    are the mean and std of A' over every response token (whiten="token", default: response i counts
    |y_i| times, OpenRLHF's masked whitening) or over the responses (whiten="response": each once);
    unbiased: s with N-1."""
    a = r - r.mean(-1, keepdim=True)
    if o.whiten == "response":
        return (a - a.mean()) / (a.std(unbiased=o.unbiased) + o.eps)
    if lengths is None:
        raise ValueError("lengths: reinforce_pp_baseline whitens over tokens (whiten='token'): pass each "
                         "response's token count, or whiten='response'")
    w = lengths.to(a.dtype)
    n = w.sum()
    mean = (w * a).sum() / n
    var = (w * (a - mean) ** 2).sum() / (n - 1 if o.unbiased else n)
    return (a - mean) / (var.sqrt() + o.eps)


@dataclass
class TokenGroupAverageOptions:
    eps: float = 1e-6
    fallback: float = 5.0  # a group with any |A_i| >= fallback takes GRPO's advantages (the authors' "smooth score")

    def __post_init__(self):
        for key in ("eps", "fallback"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{key}: must be a finite number > 0, got {v!r}")


@register(
    "hapo_tga", "advantage", "group",
    "Liu et al. 2025, From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature "
    "(HAPO, arXiv:2509.16591), its Token Level Group Average as the authors' released estimator",
    TokenGroupAverageOptions, min_group=2,  # one sample: its own mean, every advantage 0
)
def hapo_tga(r: Tensor, o: TokenGroupAverageOptions, lengths: Tensor | None) -> Tensor:
    """Within each group, the mean and std over the group's response tokens (response i counts L_i times):
    μ = Σ L_i R_i / Σ L_i, σ² = Σ L_i (R_i - μ)² / Σ L_i (population), A_i = (R_i - μ) / (σ + eps); a group where
    some |A_i| >= fallback (a lone long outlier) takes GRPO's (R_i - mean) / (std_{n-1} + eps) instead, as the
    authors' code does."""
    if lengths is None:
        raise ValueError("lengths: hapo_tga averages over tokens: pass each response's token count")
    w = lengths.to(r.dtype)
    total = w.sum(-1, keepdim=True)
    mean = (w * r).sum(-1, keepdim=True) / total
    std = ((w * (r - mean) ** 2).sum(-1, keepdim=True) / total).sqrt()
    a = (r - mean) / (std + o.eps)
    plain = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + o.eps)
    return torch.where((a.abs() >= o.fallback).any(-1, keepdim=True), plain, a)


@dataclass
class RiskPOOptions:
    alpha: float = 0.2  # [P] lower quantile level (the paper's α)
    beta: float = 0.8  # [P] upper quantile level (β)
    mix: float = 1.5  # [P] w: weight of the lower-tail CVaR term against the [α, β] range (0: the range alone)
    bundle_size: int = 1  # [P: 5 in the paper] prompts whose responses are summed into one bundle ("paper")
    normalize: bool = True  # [P] divide by the std of the bundle scores
    eps: float = 1e-6

    def __post_init__(self):
        for key in ("alpha", "beta"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise ValueError(f"{key}: must be in (0, 1), got {v!r}")
        if not self.alpha < self.beta:
            raise ValueError(f"beta: must be > alpha ({self.alpha!r}), got {self.beta!r}")
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not self.mix >= 0 \
                or self.mix == float("inf"):
            raise ValueError(f"mix: must be a finite number >= 0, got {self.mix!r}")
        if isinstance(self.bundle_size, bool) or not isinstance(self.bundle_size, int) or self.bundle_size < 1:
            raise ValueError(f"bundle_size: must be an integer >= 1, got {self.bundle_size!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps: must be > 0, got {self.eps!r}")


@register(
    "riskpo", "advantage", "batch",
    "Ren et al. 2025, RiskPO: Risk-based Policy Optimization via Verifiable Reward for LLM Post-Training "
    "(arXiv:2510.00911), Mixed Value-at-Risk with question bundling",
    RiskPOOptions, min_group=2,  # one bundle score: its quantiles are itself, every advantage 0
)
def riskpo(r: Tensor, o: RiskPOOptions, lengths: Tensor | None) -> Tensor:
    """Bundles: consecutive groups of bundle_size prompts (the last may be smaller); within a bundle the j-th
    response of every prompt forms "paper" j with score S_j = Σ_{prompts p} R_{p,j} (bundle_size 1: S_j = R_j).
    Per bundle: q_α, q_β the α- and β-quantiles of {S_j} (linear interpolation), σ their std (n-1);
    range term V_j = (clip(S_j, q_α, q_β) - q_β)/(β - α + eps) (the [α, β] region, RVaR);
    tail term C_j = -max(q_α - S_j, 0)/(α + eps) (the lower tail, CVaR);
    A_j = (w·C_j + V_j)/(w + 1) (w = mix: the Mixed VaR's weights over the two regions), divided by σ + eps when
    normalize (σ = 1 for a single paper); every response of paper j gets A_j. The quantile levels, w = 1.5,
    bundling by response index and the std normalisation are [P: the paper's public code]; bundle_size
    defaults to 1 [A] (the paper uses 5) so that any prompts_per_step works. Advantages are ≤ 0: the best papers
    get 0 and the worst the largest push (the risk-averse weighting the abstract describes)."""
    p_count, n = r.shape
    out = torch.empty_like(r)
    for start in range(0, p_count, o.bundle_size):
        block = r[start:start + o.bundle_size]
        scores = block.sum(0)  # [n]: one score per paper
        q_lo = torch.quantile(scores, o.alpha)
        q_hi = torch.quantile(scores, o.beta)
        v = (torch.minimum(torch.maximum(scores, q_lo), q_hi) - q_hi) / (o.beta - o.alpha + o.eps)
        c = -(q_lo - scores).clamp(min=0) / (o.alpha + o.eps)
        adv = (o.mix * c + v) / (o.mix + 1)
        if o.normalize:
            sigma = scores.std() if n > 1 else torch.ones((), dtype=r.dtype)
            adv = adv / (sigma + o.eps)
        out[start:start + o.bundle_size] = adv.expand_as(block)
    return out


def compute_advantages(name: str, rewards: Tensor, *, group_size: int | None = None, lengths: Tensor | None = None,
                       **options) -> Tensor:
    """Advantages of estimator `name` for `rewards` ([P, n], or flat [P·n] with group_size); `lengths`:
    response tokens per sample, shaped like `rewards` (used by token-weighted estimators)."""
    entry = get("advantage", name)
    opts = entry.make_options(options)
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards: expected a floating torch.Tensor")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: NaN or inf")
    shape = rewards.shape
    if rewards.dim() == 1:
        if group_size is None or not isinstance(group_size, int) or group_size < 1:
            raise ValueError("group_size: a positive int is required for flat [P*n] rewards")
        if rewards.numel() % group_size:
            raise ValueError(f"group_size: {group_size} does not divide the {rewards.numel()} rewards")
        grouped = rewards.view(-1, group_size)
    elif rewards.dim() == 2:
        if group_size is not None and group_size != rewards.shape[1]:
            raise ValueError(f"group_size: {group_size} differs from rewards.shape[1] = {rewards.shape[1]}")
        grouped = rewards
    else:
        raise ValueError(f"rewards: expected [P, n] or [P*n], got shape {tuple(shape)}")
    if grouped.shape[1] < entry.min_group:
        raise ValueError(f"group_size: {name} needs at least {entry.min_group} samples per group, got "
                         f"{grouped.shape[1]}")
    return entry.fn(grouped, opts, _lengths(lengths, shape, grouped.shape)).reshape(shape)


def _lengths(lengths, shape, grouped_shape) -> Tensor | None:
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths)
    if tuple(lengths.shape) != tuple(shape):
        raise ValueError(f"lengths: expected the rewards' shape {tuple(shape)}, got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()):
        raise ValueError("lengths: every response has at least one token")
    return lengths.reshape(grouped_shape)

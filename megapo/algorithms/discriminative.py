"""DelTA: discriminative token credit assignment (Zhang, Wu and Lin 2026, DelTA: Discriminative Token Credit
Assignment for Reinforcement Learning from Verifiable Rewards, arXiv:2605.21467), from its authors' released code
(github RUCBM/DelTA, verl-DelTA/verl/workers/actor/dp_actor.py, compute_log_prob_h, the "Normal" version).

The paper reads a sequence-level policy-gradient step as a linear discriminator over token-gradient vectors: the
positive side's advantage-weighted centroid against the negative side's. Shared patterns (formatting, boilerplate)
pull both centroids together; DelTA reweights each token by how much its gradient looks like its own side's and not
the other's, so the effective centroids become more contrastive. The token-gradient vector is the last layer's
proxy v_t = (1 − π_old(y_t))·h_t, h_t the LM head's input at the position predicting y_t (what the authors capture
with a pre-hook on lm_head; megapo's Learner.response_hidden keeps it from the same place).

This module holds the math on per-sample tensors; the stage delta (algorithm.stages) runs it after the old-log-prob
pass with one more learner forward for the hidden states (megapo.trainer.update.old_hidden) on the routes the train
steps replay, and multiplies each token's advantage by its weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import register

EPS = 1e-8  # the authors' eps: clamps the centroid denominators and the margins' variance


@dataclass
class DeltaOptions:
    steps: int = 1  # K: refinements of the centroids by the soft side assignment (the authors' delta_K, default 1)
    w_min: float = 0.8  # the weight of a token that looks like the other side (the authors' lam_min)
    w_max: float = 1.2  # the weight of a token that looks like its own side (the authors' lam_max)

    option_field = True  # refusals name the option's field (pipeline.parse_stages)

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps: must be an integer >= 0, got {self.steps!r}")
        for name in ("w_min", "w_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not self.w_min <= self.w_max or self.w_max <= 0:
            raise ValueError(f"w_max: must be > 0 and >= w_min ({self.w_min}), got {self.w_max!r}")


@dataclass(frozen=True)
class _Tokens:
    """The batch's policy tokens laid end to end: their gradient proxies, advantages and sides."""

    v: Tensor  # [T, h] (1 − π_old(y_t))·h_t, float64
    adv: Tensor  # [T] the sample's sequence advantage at each of its tokens
    pos: Tensor  # [T] bool: a token of a response with A > 0
    neg: Tensor  # [T] bool: A < 0


def _centroid(v: Tensor, weight: Tensor) -> Tensor:
    """Σ_t w_t v_t / max(Σ_t w_t, ε) (0 where no token weighs)."""
    return (weight[:, None] * v).sum(0) / weight.sum().clamp(min=EPS)


def _margins(t: _Tokens, mu_pos: Tensor, mu_neg: Tensor) -> tuple[Tensor, Tensor]:
    """(m⁺, m⁻) per token: m⁺ = ‖v − μ⁻‖² − ‖v − μ⁺‖² (how much closer to the positive centroid), m⁻ = −m⁺."""
    d_pos = (t.v - mu_pos).pow(2).sum(-1)
    d_neg = (t.v - mu_neg).pow(2).sum(-1)
    return d_neg - d_pos, d_pos - d_neg


def _scale(margin: Tensor, side: Tensor) -> Tensor:
    """γ = sqrt(max(Var_t(m_t), ε)) over the side's tokens (a side with none: sqrt(ε))."""
    m = margin[side]
    if m.numel() == 0:
        return torch.tensor(math.sqrt(EPS), dtype=margin.dtype)
    return (m.pow(2).mean() - m.mean().pow(2)).clamp(min=EPS).sqrt()


@register(
    "delta", "advantage_stage", "batch",
    "Zhang, Wu and Lin 2026, DelTA: Discriminative Token Credit Assignment for Reinforcement Learning from "
    "Verifiable Rewards (arXiv:2605.21467) (the stage delta: one more learner forward for the LM head's input)",
    DeltaOptions,
)
def delta_weights(advantages: list[float], old_logp: list[Tensor], hidden: list[Tensor], masks: list | None,
                  o: DeltaOptions) -> tuple[list[Tensor], dict]:
    """Per token t of response i (A_i its sequence advantage), v_t = (1 − π_old(y_t))·h_t, h_t the LM head's input
    predicting y_t. Over the batch's policy tokens: μ⁺ = Σ_{A>0} A_i v_t / Σ_{A>0} A_i, μ⁻ = Σ_{A<0} |A_i| v_t /
    Σ_{A<0} |A_i|; margins m⁺_t = ‖v_t − μ⁻‖² − ‖v_t − μ⁺‖² on the positive side's tokens and m⁻_t = −m⁺_t on the
    negative side's, scaled by γ± = the standard deviation of the side's margins. `steps` times: μ±* =
    Σ σ(m±_t/γ±)|A_i| v_t / Σ σ(m±_t/γ±)|A_i| over the side's tokens (margins and γ from the previous centroids).
    Then w_t = w_min + (w_max − w_min)·σ(m±_t/γ±) from the last centroids (w_min on the tokens of A = 0), normalised
    so the policy tokens' weights average 1: w_t ← w_t·T/Σ_t w_t. The stage multiplies each token's advantage by w_t.
    `masks`: per sample, 1 on its policy tokens (None: all); a masked-out token weighs 0. Returns the weights (one
    float64 tensor per sample) and metrics: delta/weight_pos_mean, delta/weight_neg_mean, and
    delta/discriminator_acc, the share of the two sides' tokens on their side of the final discriminator
    W·v + b = (m⁺)/2 (W = μ⁺* − μ⁻*, b = −(‖μ⁺*‖² − ‖μ⁻*‖²)/2). As the authors' code: the diagonal metric d is 1
    (their variance-based d is computed, then overwritten with ones), λ_w = 1 and γ_time = 1. Assumption, marked:
    the statistics are over the whole train batch on every rank (the authors' run over each rank's share), so they
    do not depend on mini-, micro-batches or DP ranks."""
    n = len(advantages)
    if not len(old_logp) == len(hidden) == n:
        raise ValueError(f"hidden: one per sample ({n}), got {len(old_logp)} old_logp and {len(hidden)} hidden")
    t, lengths, keep = _tokens(advantages, old_logp, hidden, masks)
    a = t.adv.abs()
    mu_pos, mu_neg = _centroid(t.v, a * t.pos), _centroid(t.v, a * t.neg)
    m_pos, m_neg = _margins(t, mu_pos, mu_neg)
    g_pos, g_neg = _scale(m_pos, t.pos), _scale(m_neg, t.neg)
    for _ in range(o.steps):
        w_pos, w_neg = torch.sigmoid(m_pos / g_pos) * a * t.pos, torch.sigmoid(m_neg / g_neg) * a * t.neg
        mu_pos, mu_neg = _centroid(t.v, w_pos), _centroid(t.v, w_neg)
        g_pos, g_neg = _scale(m_pos, t.pos), _scale(m_neg, t.neg)
        m_pos, m_neg = _margins(t, mu_pos, mu_neg)
    span = o.w_max - o.w_min
    weight = torch.full_like(t.adv, float(o.w_min))
    weight = torch.where(t.pos, o.w_min + span * torch.sigmoid(m_pos / g_pos), weight)
    weight = torch.where(t.neg, o.w_min + span * torch.sigmoid(m_neg / g_neg), weight)
    if weight.numel():
        weight = weight * (weight.numel() / weight.sum().clamp(min=EPS))
    return _per_sample(weight, lengths, keep), _metrics(weight, t, m_pos)


def _tokens(advantages: list[float], old_logp: list[Tensor], hidden: list[Tensor], masks: list | None):
    """The policy tokens end to end (_Tokens), each sample's response length and its policy-token mask."""
    vs, adv, lengths, keep = [], [], [], []
    for i, (a, lp, h) in enumerate(zip(advantages, old_logp, hidden)):
        lp, h = torch.as_tensor(lp, dtype=torch.float64).reshape(-1), torch.as_tensor(h, dtype=torch.float64)
        if h.dim() != 2 or h.shape[0] != lp.numel():
            raise ValueError(f"hidden[{i}]: expected [{lp.numel()}, hidden] (one row per response token), got "
                             f"{list(h.shape)}")
        mask = torch.ones(lp.numel(), dtype=torch.bool) if masks is None or masks[i] is None \
            else torch.as_tensor(masks[i]).reshape(-1).bool()
        if mask.numel() != lp.numel():
            raise ValueError(f"loss_mask[{i}]: expected {lp.numel()} values, got {mask.numel()}")
        vs.append((1 - lp.exp())[:, None][mask] * h[mask])
        adv.append(torch.full((int(mask.sum()),), float(a), dtype=torch.float64))
        lengths.append(lp.numel())
        keep.append(mask)
    width = hidden[0].shape[-1] if hidden else 0
    v = torch.cat(vs) if vs else torch.zeros(0, width, dtype=torch.float64)
    adv_t = torch.cat(adv) if adv else torch.zeros(0, dtype=torch.float64)
    return _Tokens(v, adv_t, adv_t > 0, adv_t < 0), lengths, keep


def _per_sample(weight: Tensor, lengths: list[int], keep: list[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for n, mask in zip(lengths, keep):
        w = torch.zeros(n, dtype=torch.float64)
        count = int(mask.sum())
        w[mask] = weight[start:start + count]
        out.append(w)
        start += count
    return out


def _metrics(weight: Tensor, t: _Tokens, m_pos: Tensor) -> dict:
    sides = t.pos | t.neg
    right = torch.where(t.pos, m_pos > 0, m_pos < 0)[sides]
    return {"delta/weight_pos_mean": float(weight[t.pos].mean()) if t.pos.any() else 0.0,
            "delta/weight_neg_mean": float(weight[t.neg].mean()) if t.neg.any() else 0.0,
            "delta/discriminator_acc": float(right.double().mean()) if right.numel() else 0.0}

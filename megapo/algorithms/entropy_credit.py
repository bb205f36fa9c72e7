"""Entropy credit: the token stages erpo and aepo of algorithm.stages (megapo/algorithms/pipeline.py declares their
inputs), per-token advantages from π_old's per-token entropy H_{i,t} (sample.old_entropy, kept by the old-log-prob
pass only when such a stage is listed):

    erpo   A'_{i,t} = A_i·w_{i,t}, w ∝ 1 + α·1[H_{i,t}/m_{g,b(i,t)} ≥ κ], mean 1 per response   (pivots amplified)
    aepo   A'_{i,t} = A_i + λ_d·1[H̄_{i,t} ≥ τ] − β_d·(log π_old − log π_ref)                 (window entropy)

m_{g,b} is the mean entropy of group g's tokens in progress bucket b (erpo), H̄ a sliding-window mean entropy, τ the
train batch's top-ρ window entropy, d the group's difficulty level from its pass rate (aepo). Each runs on the whole
train batch once, after the old-log-prob pass and before any mini-, micro-batch or DP split, so its batch and group
statistics do not depend on how the learner splits the batch. `entropy_credit_advantages` at the end runs one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.options import check_choice, check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.token_tensors import per_token_advantages, per_token_values

STAGES = ("erpo", "aepo")
LEVELS = ("easy", "medium", "hard")


# ----------------------------------------------------------------------------- ERPO


@dataclass
class ErpoOptions:
    buckets: int = 10  # B: token progress windows a response is cut into (bucket of token t: ⌊B·t/|y|⌋)
    threshold: float = 1.5  # κ: a critical decision pivot's entropy over its group's bucket mean
    amplify: float = 1.0  # α: a pivot's gate is 1 + α (0: plain GRPO)
    anchor: str = "sequence"  # sequence: the gates' mean over a response is 1 (Σ_t A'_t = |y|·A); none: raw gates
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_number("buckets", self.buckets, low=1, integer=True)
        check_number("threshold", self.threshold, above=0)
        check_number("amplify", self.amplify, low=0)
        check_choice("anchor", self.anchor, ("sequence", "none"))


def progress_buckets(length: int, buckets: int) -> Tensor:
    """b_t = ⌊B·t/L⌋ for t = 0 … L − 1: the token progress window of each token of a response of L tokens."""
    return torch.div(torch.arange(length) * buckets, max(length, 1), rounding_mode="floor")


@register(
    "erpo", "advantage_stage", "group",
    "Yu, Li, Zhao, Yang 2026, ERPO: Token-Level Entropy-Regulated Policy Optimization for Large Reasoning Models "
    "(arXiv:2603.28204): entropy-aware gating, bucket-based implicit normalization, result-anchored advantage "
    "synthesis",
    ErpoOptions,
)
def erpo(adv: list[Tensor], entropy: list[Tensor], o: ErpoOptions) -> list[Tensor]:
    """One group: A'_{i,t} = A_{i,t}·w_{i,t}, w_{i,t} = g_{i,t}/mean_s g_{i,s} (anchor=sequence; g_{i,t} with
    anchor=none), g_{i,t} = 1 + α·1[Ĥ_{i,t} ≥ κ], Ĥ_{i,t} = H_{i,t}/m_{b(i,t)}, m_b = the mean of H over the group's
    tokens in progress bucket b, b(i,t) = ⌊B·t/|y_i|⌋ (0 where m_b = 0). H = π_old's entropy at the token, A_{i,t}
    the estimator's sequence advantage (or an earlier token stage's). Entropy-aware gating: a critical decision
    pivot (CDP) is a token whose entropy stands out, by κ, from the tokens at the same relative progress of the
    same prompt's responses, and its advantage is amplified by 1 + α; bucket-based implicit normalization: the
    entropy is judged against its (prompt, progress window) bucket, so neither a hard prompt's uniformly higher
    entropy nor the usual decay of entropy along a response makes every token a pivot; result-anchored advantage
    synthesis: the gates are renormalised so a response's token advantages sum to its outcome advantage ×
    length — the sign and total come from the result, the gates only move credit and blame onto the pivots.
    assumption: the abstract names the three parts, not their forms: the hard gate, the bucket mean over the group
    (not the batch), B = 10, κ = 1.5, α = 1 and the renormalisation as the outcome anchor are ours; the gate acts on
    both signs (a wrong response's blame also goes to its pivots)."""
    if not adv:
        return []
    idx = [progress_buckets(len(h), o.buckets) for h in entropy]
    flat_h, flat_b = torch.cat(entropy), torch.cat(idx)
    total = torch.zeros(o.buckets, dtype=torch.float64).index_add_(0, flat_b, flat_h)
    count = torch.zeros(o.buckets, dtype=torch.float64).index_add_(0, flat_b, torch.ones_like(flat_h))
    mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
    out = []
    for a, h, b in zip(adv, entropy, idx):
        m = mean[b]
        rel = torch.where(m > 0, h / torch.where(m > 0, m, torch.ones_like(m)), torch.zeros_like(h))
        gate = 1.0 + o.amplify * (rel >= o.threshold).to(torch.float64)
        if o.anchor == "sequence" and gate.numel():
            gate = gate / gate.mean()
        out.append(a * gate)
    return out


# ----------------------------------------------------------------------------- ARES / AEPO


@dataclass
class AepoOptions:
    window: int = 5  # w: tokens in the sliding window of the window entropy H̄_t
    hwe_frac: float = 0.2  # ρ: the share of the batch's tokens that are high window-entropy (HWE) tokens
    easy_above: float = 0.75  # a group with pass rate >= this is easy
    hard_below: float = 0.25  # a group with pass rate <= this is hard (between the two: medium)
    bonus_easy: float = -0.1  # λ_easy: entropy reward per HWE token of an easy group's response (< 0: fewer)
    bonus_medium: float = 0.0  # λ_medium
    bonus_hard: float = 0.1  # λ_hard (> 0: more exploration on hard problems)
    kl_easy: float = 0.0  # β_easy: per-token KL penalty toward π_ref on an easy group's responses (0: none)
    kl_medium: float = 0.0  # β_medium
    kl_hard: float = 0.0  # β_hard
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_number("window", self.window, low=1, integer=True)
        check_number("hwe_frac", self.hwe_frac, above=0, high=1)
        check_number("easy_above", self.easy_above, low=0, high=1)
        check_number("hard_below", self.hard_below, low=0, below=self.easy_above)
        for level in LEVELS:
            check_number(f"bonus_{level}", getattr(self, f"bonus_{level}"))
            check_number(f"kl_{level}", getattr(self, f"kl_{level}"), low=0)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        """π_old's and π_ref's log-probs only for the KL term."""
        return ("old_logp", "ref_logp") if any(getattr(self, f"kl_{lv}") > 0 for lv in LEVELS) else ()

    def level(self, pass_rate: float) -> str:
        return "easy" if pass_rate >= self.easy_above else "hard" if pass_rate <= self.hard_below else "medium"


def window_entropy(entropy: Tensor, window: int) -> Tensor:
    """H̄_t = (1/|W_t|)·Σ_{τ∈W_t} H_τ, W_t = {t, …, min(t + w, L) − 1}: the mean entropy of the window starting at
    token t (shorter at the response's end)."""
    n = entropy.numel()
    if n == 0:
        return entropy.clone()
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), entropy.to(torch.float64).cumsum(0)])
    start = torch.arange(n)
    end = torch.clamp(start + window, max=n)
    return (csum[end] - csum[start]) / (end - start).to(torch.float64)


def hwe_threshold(values: Tensor, frac: float) -> float:
    """τ = the k-th largest of `values`, k = max(1, ⌈ρ·N⌉): the tokens with H̄ ≥ τ are (ties aside) the top ρ."""
    n = values.numel()
    if n == 0:
        return math.inf
    k = max(1, math.ceil(frac * n - 1e-9))
    return float(torch.kthvalue(values.to(torch.float64), n - k + 1).values)


@register(
    "aepo", "advantage_stage", "batch",
    "Chen et al. 2025, ARES: Multimodal Adaptive Reasoning via Difficulty-Aware Token-Level Entropy Shaping "
    "(arXiv:2510.08457), AEPO (Adaptive Entropy Policy Optimization); the adaptive cold start (curated SFT data) "
    "is not a stage",
    AepoOptions,
)
def aepo(adv: Tensor, hwe: Tensor, level: str, kl: Tensor | None, o: AepoOptions) -> Tensor:
    """One response of a group at difficulty level d: A'_{i,t} = A_{i,t} + λ_d·1[H̄_{i,t} ≥ τ] − β_d·(log π_old(y_t)
    − log π_ref(y_t)). H̄_{i,t} = the mean of π_old's entropy over the window of w tokens starting at t (window
    entropy; truncated at the response's end); τ = the k-th largest H̄ of the whole train batch, k = ⌈ρ·N⌉ of its N
    response tokens, so the HWE tokens (H̄ ≥ τ) are the batch's top ρ — the exploration triggers (when to explore).
    d from the group's pass rate p (the verifier's verdicts): easy p ≥ easy_above, hard p ≤ hard_below, else medium;
    the hierarchical entropy reward λ_d per HWE token (how much to explore: λ_easy < 0 cuts HWE usage on easy
    problems, λ_hard > 0 adds it on hard ones) and the difficulty-dependent KL coefficient β_d (the KL term only
    where some β_d > 0; it then reads π_ref). assumption: the abstract gives neither form: the window [t, t + w),
    w = 5, ρ = 0.2, the levels' pass-rate cut-offs 0.75 / 0.25, λ = −0.1 / 0 / +0.1, the reward added to the
    advantage at the HWE token itself, and the k1 estimate log π_old − log π_ref as the KL term are ours; the KL
    control is per step (β fixed per level, β = 0 by default): no controller carries it across steps."""
    out = adv + getattr(o, f"bonus_{level}") * hwe.to(torch.float64)
    if kl is not None:
        out = out - getattr(o, f"kl_{level}") * kl
    return out


# ----------------------------------------------------------------------------- one stage over a train batch


def entropy_credit_advantages(name: str, *, advantages: list, entropy: list, group_size: int,
                              correct: list | None = None, old_logp: list | None = None, ref_logp: list | None = None,
                              **options) -> list[Tensor]:
    """Stage `name` (STAGES) on a train batch, groups of `group_size` contiguous samples: `advantages` per sample (a
    number, or one per response token), π_old's `entropy` per response token; aepo also the verifier's `correct` per
    sample and, where a kl_* > 0, π_old's / π_ref's `old_logp` / `ref_logp`. One float64 tensor per sample."""
    if name not in STAGES:
        raise ValueError(f"stage: unknown entropy-credit stage {name!r}; choose from {', '.join(STAGES)}")
    entry = get("advantage_stage", name, argument="stage")
    o = entry.make_options(options)
    if entropy is None or any(e is None for e in entropy):
        raise ValueError(f"entropy: stage {name} needs π_old's per-token entropy (sample.old_entropy)")
    lengths = [len(e) for e in entropy]
    if len(advantages) != len(lengths) or len(lengths) % group_size:
        raise ValueError(f"advantages: {len(advantages)} for {len(lengths)} samples in groups of {group_size}")
    h = per_token_values("entropy", entropy, lengths)
    adv = per_token_advantages(advantages, lengths)
    groups = range(0, len(lengths), group_size)
    if name == "erpo":
        return [a for g in groups for a in erpo(adv[g:g + group_size], h[g:g + group_size], o)]
    if correct is None or len(correct) != len(lengths):
        raise ValueError(f"correct: aepo needs the verifier's verdict of each of the {len(lengths)} samples")
    kl = [None] * len(lengths)
    if o.token_inputs:
        old, ref = per_token_values("old_logp", old_logp, lengths), per_token_values("ref_logp", ref_logp, lengths)
        kl = [p - r for p, r in zip(old, ref)]
    windows = [window_entropy(x, o.window) for x in h]
    tau = hwe_threshold(torch.cat(windows) if windows else torch.zeros(0, dtype=torch.float64), o.hwe_frac)
    out = []
    for g in groups:
        level = o.level(sum(bool(c) for c in correct[g:g + group_size]) / group_size)
        out += [aepo(adv[i], windows[i] >= tau, level, kl[i], o) for i in range(g, g + group_size)]
    return out

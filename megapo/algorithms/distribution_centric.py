"""Distribution-Centric Policy Optimization: Li, Wang, Bai, Cui, Lan, Zhao, Wang 2026, Distribution-Centric Policy
Optimization Dominates Exploration-Exploitation Trade-off (arXiv:2601.12730), the token stage `distribution_centric`.

Not megapo's `dcpo` names: the clip_mode `dynamic` of objective ppo and the stage `cumulative_std` are DCPO: Dynamic
Clipping Policy Optimization (Yang et al. 2025, arXiv:2509.02333), another paper with the same acronym.

Exploration is steered toward a "better" target distribution π^T_old = softmax(z_old/T) (π_old at a temperature T,
higher when the policy's entropy is below the target H_0, lower above it) while sampling stays on-policy: a
REINFORCE term on the correct responses, importance-weighted by ρ_{i,t} = π^T_old(y_t)/π_old(y_t) (the second of
the paper's two importance ratios), is mixed into the advantage; the objective's own ratio r_t = π_θ/π_old (the
first, clipped) then trains on it:

    A'_{i,t} = (1 − α)·A_{i,t} + α·b_i·ρ_{i,t}

b_i = 1 for a correct response (the verifier's verdict), α from the distance of the batch's entropy to H_0. The
stage runs on the whole train batch after the old-log-prob pass, before any mini-, micro-batch or DP split, so H, the
correct share and α do not depend on how the learner splits the batch; log π^T_old(y_t) comes from one more learner
forward (Learner.response_tempered_logp: log softmax(z/T) at the sampled token, reduced over the TP ranks' vocabulary
slices, one value per token crossing them), as the authors' code runs a second old-log-prob pass at temperature T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.options import check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.token_tensors import per_token_advantages, per_token_values

STAGE = "distribution_centric"
PAPER = ("Li et al. 2026, Distribution-Centric Policy Optimization Dominates Exploration-Exploitation Trade-off "
         "(arXiv:2601.12730), DCPO (distribution-centric; not the dynamic-clipping DCPO of clip_mode dynamic)")


@dataclass
class DistributionCentricOptions:
    target_entropy: float = 0.5  # H_0 (the code's entropy_base; its run script's 0.5, the paper's ablation best 0.25)
    temp_high: float = 1.2  # T where H <= H_0: a flatter target raises the entropy
    temp_low: float = 0.8  # T where H > H_0: a sharper target lowers it
    alpha_cap: float = 0.1  # c: |H_0 − H| is capped at c before the division by the correct share
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_number("target_entropy", self.target_entropy, low=0)
        check_number("temp_high", self.temp_high, above=0)
        check_number("temp_low", self.temp_low, above=0)
        check_number("alpha_cap", self.alpha_cap, low=0)


def response_policy_mask(loss_mask: list | None, length: int) -> Tensor:
    """[length] bool: the tokens the policy sampled (loss_mask 1; all when there is no loss_mask)."""
    if loss_mask is None:
        return torch.ones(length, dtype=torch.bool)
    return torch.as_tensor(loss_mask).reshape(-1) == 1


def entropy_estimate(old_logp: list[Tensor], masks: list[Tensor]) -> float:
    """H = −(1/N)·Σ log π_old(y_t) over the batch's N policy tokens (the sampled-token estimate of the entropy the
    authors' code monitors); 0 for a batch without policy tokens."""
    total = sum(float(lp[m].sum()) for lp, m in zip(old_logp, masks))
    count = sum(int(m.sum()) for m in masks)
    return -total / count if count else 0.0


def target_temperature(entropy: float, o: DistributionCentricOptions) -> float:
    """T = temp_high where H <= H_0 (raise the entropy), temp_low where H > H_0 (lower it)."""
    return o.temp_high if entropy <= o.target_entropy else o.temp_low


def mixing_weight(entropy: float, correct_share: float, o: DistributionCentricOptions) -> float:
    """α = α̃/(1 + α̃), α̃ = min(|H_0 − H|, c)/p, p the batch's share of correct responses; 0 where p = 0 (no
    correct response: the REINFORCE term is empty)."""
    if correct_share <= 0:
        return 0.0
    raw = min(abs(o.target_entropy - entropy), o.alpha_cap) / correct_share
    return raw / (1.0 + raw)


@register(STAGE, "advantage_stage", "batch", PAPER, DistributionCentricOptions)
def distribution_centric(adv: Tensor, correct: bool, rho: Tensor, alpha: float) -> Tensor:
    """One response: A'_{i,t} = (1 − α)·A_{i,t} + α·b_i·ρ_{i,t}, b_i = 1[response i is correct],
    ρ_{i,t} = π^T_old(y_t)/π_old(y_t) = exp(log softmax(z_old/T)(y_t) − log π_old(y_t)) (the target-distribution
    ratio: E_{y~π_old}[ρ·∇log π] = E_{y~π^T_old}[∇log π], the REINFORCE regulariser's gradient evaluated under the
    target distribution), T = temp_high if H <= H_0 else temp_low, α = α̃/(1 + α̃) with
    α̃ = min(|H_0 − H|, alpha_cap)/p, H = −mean log π_old(y_t) over the train batch's policy tokens, p = the batch's
    share of correct responses. The objective's clipped ratio π_θ/π_old (the first importance ratio) trains on A'.
    [formula from the authors' released code (597358816/DCPO, ray_trainer: DCPO branch)]
    Assumptions: H is this batch's π_old estimate (the code reads the previous update's mean −log π_θ, one step
    older; ours needs no state across steps and does not depend on the split); "correct" is megapo's verdict
    (reward >= data.correct_threshold; the code: score > 0.05); α = 0 where no response is correct (the code divides
    by zero there); with algorithm.old_policy=engine π_old is μ, the sampling distribution, so ρ = π^T_learner/μ is
    still the importance weight from the samples to the target."""
    return (1.0 - alpha) * adv + alpha * float(bool(correct)) * rho


def distribution_centric_advantages(*, advantages: list, old_logp: list, tempered_logp: list, correct: list,
                                    loss_mask: list | None = None, **options) -> tuple[list[Tensor], dict]:
    """The stage on a whole train batch: `advantages` per sample (a number, or one per response token), π_old's
    `old_logp` and π^T_old's `tempered_logp` (at target_temperature(H)) per response token, the verifier's `correct`
    per sample, `loss_mask` per sample (None: every token the policy's). One float64 tensor per sample, and the
    stage's metrics (H, T, α, the correct share, the mean ρ over policy tokens)."""
    o = get("advantage_stage", STAGE, argument="stage").make_options(options)
    lengths = [len(lp) if lp is not None else 0 for lp in old_logp]
    if len(advantages) != len(lengths) or correct is None or len(correct) != len(lengths):
        raise ValueError(f"correct: stage {STAGE} needs the verifier's verdict and an advantage for each of the "
                         f"{len(lengths)} samples")
    old = per_token_values("old_logp", old_logp, lengths)
    tempered = per_token_values("tempered_logp", tempered_logp, lengths)
    adv = per_token_advantages(advantages, lengths)
    masks = [response_policy_mask(None if loss_mask is None else loss_mask[i], n) for i, n in enumerate(lengths)]
    entropy = entropy_estimate(old, masks)
    share = sum(bool(c) for c in correct) / len(correct) if correct else 0.0
    alpha = mixing_weight(entropy, share, o)
    rhos = [torch.exp(t - lp) for t, lp in zip(tempered, old)]
    out = [distribution_centric(a, c, r, alpha) for a, c, r in zip(adv, correct, rhos)]
    flat = torch.cat([r[m] for r, m in zip(rhos, masks)]) if rhos else torch.zeros(0, dtype=torch.float64)
    metrics = {f"{STAGE}/entropy": entropy, f"{STAGE}/temperature": target_temperature(entropy, o),
               f"{STAGE}/alpha": alpha, f"{STAGE}/correct_share": share,
               f"{STAGE}/rho_mean": float(flat.mean()) if flat.numel() else math.nan}
    return out, metrics


def batch_temperature(old_logp: list, loss_mask: list | None, options: DistributionCentricOptions) -> float:
    """The target temperature T of this train batch (what the learner's tempered pass runs at): from H over the
    batch's policy tokens."""
    lengths = [len(lp) for lp in old_logp]
    old = per_token_values("old_logp", old_logp, lengths)
    masks = [response_policy_mask(None if loss_mask is None else loss_mask[i], n) for i, n in enumerate(lengths)]
    return target_temperature(entropy_estimate(old, masks), options)


def run_dc_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner: per sample the per-token A' (ctx.tempered_logp: the learner's tempered pass,
    update.advantage_stages; ctx.correct: the verdicts), and the stage's metrics."""
    if ctx.tempered_logp is None:
        raise ValueError(f"old_tempered_logp: stage {STAGE} needs log π^T_old from the learner's tempered pass "
                         "(update.advantage_stages)")
    masks = [x.loss_mask for x in batch]
    values, metrics = distribution_centric_advantages(
        advantages=[x.advantage for x in batch], old_logp=[x.old_logp for x in batch],
        tempered_logp=ctx.tempered_logp, correct=ctx.correct,
        loss_mask=masks if any(m is not None for m in masks) else None, **s.given)
    return values, metrics

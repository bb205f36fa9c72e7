"""Stages between the advantage estimator and the loss.

    adv = apply_polarity(adv, "negative")                        # [P, n] sequence advantages (WAPO/NSR-style)
    per_token = token_advantages("gtpo", adv, old_logp, old_entropy)   # one tensor per sample
    weights = token_select_weights(per_token, old_entropy, step=7, rho=0.2)   # per-token loss weights

- `advantage_stage` entries reshape advantages after the estimator: `polarity` on the sequence
  advantages, the others turn them into per-token advantages from π_old's per-token statistics
  (sample.old_logp, sample.old_entropy: the old-log-prob pass's); future_drift also from the reference's
  (sample.ref_logp) or the engine's (sample.rollout_logp) log-probs.
- tempo, ktae, gtpo_trajectory and tw_grpo: token credit from group statistics, megapo/algorithms/token_credit.py.
- `token_weight` entries give a detached weight per token that multiplies the objective's per-token
  loss as a correction does (policy_loss's `token_weight`); the normaliser's token count is unchanged.

Inputs are lists with one 1-D tensor per sample (its response tokens), samples of a prompt contiguous
(`group_size` of them). Statistics over the batch (a quantile) are taken once over every token given,
so the result does not depend on how the learner later splits the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register

POLARITIES = ("both", "positive", "negative")
SCORES = ("entropy", "adv_entropy")


# ----------------------------------------------------------------------------- sequence polarity


def _check_anneal(end_name: str, end, anneal_steps) -> None:
    """A linear schedule's options: anneal_steps an integer >= 0, given together with its end value."""
    if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or anneal_steps < 0:
        raise ValueError(f"anneal_steps: must be an integer >= 0, got {anneal_steps!r}")
    if (end is None) != (anneal_steps == 0):
        raise ValueError(f"{end_name}: give {end_name} and anneal_steps > 0 together (or neither)")


def _annealed(start: float, end: float | None, anneal_steps: int, step: int) -> float:
    """`start` at trainer step 1 (1-based), moving linearly to `end` over anneal_steps steps; start when no end."""
    if end is None:
        return start
    return start + (end - start) * min(1.0, max(step - 1, 0) / anneal_steps)


@dataclass
class PolarityOptions:
    polarity: str = "both"
    pos_scale: float = 1.0
    neg_scale: float = 1.0

    def __post_init__(self):
        if self.polarity not in POLARITIES:
            raise ValueError(f"polarity: must be one of {', '.join(POLARITIES)}, got {self.polarity!r}")
        for name in ("pos_scale", "neg_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")


@register(
    "polarity", "advantage_stage", "sequence",
    "sample polarity (Tang et al. 2025, Rethinking Sample Polarity in Reinforcement Learning with Verifiable "
    "Rewards (arXiv:2512.21625), A3PO's positive/negative split); negative-only and weighted-positive "
    "training as Zhu et al. 2025, The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning "
    "(NSR, W-REINFORCE)",
    PolarityOptions,
)
def polarity(adv: Tensor, o: PolarityOptions) -> Tensor:
    """A'_i = pos_scale·A_i if A_i > 0, neg_scale·A_i if A_i < 0 (0 stays 0); polarity=positive drops the
    negative ones (A'_i = 0), negative drops the positive ones. Applied to the estimator's output."""
    pos = torch.where(adv > 0, adv * o.pos_scale, torch.zeros_like(adv))
    neg = torch.where(adv < 0, adv * o.neg_scale, torch.zeros_like(adv))
    if o.polarity == "positive":
        return pos
    if o.polarity == "negative":
        return neg
    return pos + neg


def apply_polarity(adv: Tensor, polarity_name: str = "both", pos_scale: float = 1.0,
                   neg_scale: float = 1.0) -> Tensor:
    """The `polarity` stage; the default (both, 1, 1) returns `adv` itself."""
    o = PolarityOptions(polarity_name, pos_scale, neg_scale)
    if (o.polarity, o.pos_scale, o.neg_scale) == ("both", 1.0, 1.0):
        return adv
    return polarity(adv, o)


# ----------------------------------------------------------------------------- per-token advantages


@dataclass
class TokenStats:
    """π_old per-token statistics on a padded [S, T] view (0 past each response's end)."""

    old_logp: Tensor
    entropy: Tensor | None
    mask: Tensor  # bool
    rollout_logp: Tensor | None = None  # the engine's μ of the sampled tokens (sample.rollout_logp)
    ref_logp: Tensor | None = None  # π_ref's (sample.ref_logp, when a reference is loaded)


def _check_weights(alpha1: float, alpha2: float) -> None:
    for name, v in (("alpha1", alpha1), ("alpha2", alpha2)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}: must be a finite number >= 0, got {v!r}")


@dataclass
class EntropyWeightOptions:
    alpha1: float = 0.5  # weight of the plain advantage
    alpha2: float = 0.5  # weight of the entropy share (alpha1 + alpha2 = 1 keeps the mean factor 1)
    eps: float = 1e-6  # in 1/(H + eps) for the negative side

    def __post_init__(self):
        _check_weights(self.alpha1, self.alpha2)
        if not (isinstance(self.eps, (int, float)) and self.eps > 0):
            raise ValueError(f"eps: must be > 0, got {self.eps!r}")


@dataclass
class ReweightOptions:
    alpha: float = 0.3

    def __post_init__(self):
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha: must be in [0, 1], got {self.alpha!r}")


def _side_share(values: Tensor, side: Tensor, mask: Tensor) -> Tensor:
    """[P, n, T]: d_t·v_{i,t}/Σ_{k in side, alive at t} v_{k,t} for i on `side` ([P, n]) and alive at t, where
    d_t is the number of such k (the share's mean over them is 1); 1 where the sum is 0, 0 elsewhere."""
    on = side[..., None] & mask
    v = torch.where(on, values, torch.zeros_like(values))
    total = v.sum(1, keepdim=True)
    alive = on.to(values.dtype).sum(1, keepdim=True)
    share = torch.where(total > 0, alive * v / torch.where(total > 0, total, torch.ones_like(total)),
                        torch.ones_like(v))
    return torch.where(on, share, torch.zeros_like(v))


@register(
    "gtpo", "advantage_stage", "token",
    "Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy "
    "(arXiv:2508.04349), GTPO",
    EntropyWeightOptions,
)
def gtpo(adv: Tensor, s: TokenStats, o: EntropyWeightOptions) -> Tensor:
    """Ã_{i,t} = A_i·(α₁ + α₂·w_{i,t}) within each group. A_i > 0: w_{i,t} = d_t·H_{i,t}/Σ_{k∈G₊,|y_k|≥t} H_{k,t}
    (d_t = how many positive samples reach t: high-entropy tokens of correct responses get more credit);
    A_i < 0: the same share of 1/(H + eps) (low-entropy, confident tokens of wrong responses get more blame).
    H = π_old's entropy at the token. Assumptions (the abstract gives the weight ratio H_{i,t}/Σ_k H_{k,t}
    only): the weight multiplies the estimator's advantage instead of the reward before normalisation;
    α₁ = α₂ = 0.5 by default (ours), so the mean factor over a position's samples is 1."""
    pos, neg = adv > 0, adv < 0
    share = _side_share(s.entropy, pos, s.mask) + _side_share(1.0 / (s.entropy + o.eps), neg, s.mask)
    return adv[..., None] * (o.alpha1 + o.alpha2 * share) * s.mask


@register(
    "grpo_s", "advantage_stage", "sequence",
    "Tan et al. 2025, GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy "
    "(arXiv:2508.04349), GRPO-S",
    EntropyWeightOptions,
)
def grpo_s(adv: Tensor, s: TokenStats, o: EntropyWeightOptions) -> Tensor:
    """Ã_i = A_i·(α₁ + α₂·w_i) on every token of sample i, Ĥ_i = mean_t H_{i,t} (π_old's entropy). A_i > 0:
    w_i = |G₊|·Ĥ_i/Σ_{k∈G₊} Ĥ_k (correct responses with higher mean entropy get more credit); A_i < 0: the
    same share of 1/(Ĥ + eps). Same assumptions as gtpo (weight on the advantage, α₁ = α₂ = 0.5 ours)."""
    m = s.mask.to(s.entropy.dtype)
    mean_h = (s.entropy * m).sum(-1) / m.sum(-1).clamp(min=1)
    one = torch.ones_like(mean_h, dtype=torch.bool)[..., None]
    share = (_side_share(mean_h[..., None], adv > 0, one) + _side_share(1.0 / (mean_h[..., None] + o.eps), adv < 0, one))
    return adv[..., None] * (o.alpha1 + o.alpha2 * share) * s.mask


@register(
    "advantage_reweighting", "advantage_stage", "token",
    "Yang et al. 2025, Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs, Advantage "
    "Reweighting (its Low-Probability Token Isolation is the stage lopti: list both for AR + Lopti)",
    ReweightOptions,
)
def advantage_reweighting(adv: Tensor, s: TokenStats, o: ReweightOptions) -> Tensor:
    """Ã_{i,t} = (α·π_old(y_t) + 1 − α)·A_i: low-probability tokens' advantages are attenuated
    (α ∈ [0, 1]; 0 is the plain advantage). The paper's other method, Lopti (the low-probability tokens updated
    in their own optimizer step first), is the stage lopti (megapo/algorithms/lopti.py)."""
    return adv[..., None] * (o.alpha * torch.exp(s.old_logp) + 1 - o.alpha) * s.mask


AGAINST = ("reference", "engine")


@dataclass
class FutureDriftOptions:
    half_life: float | None = 32.0  # tokens: the discount γ = 2^(−1/half_life); null: no discount (γ = 1)
    clip: float = 0.2  # ε of the influence weight's clip
    clip_high_only: bool = True  # the weight in [1, 1 + ε] (else [1 − ε, 1 + ε])
    against: str = "reference"  # the log-ratio's other policy: reference (π_ref) | engine (μ, the sampler)

    def __post_init__(self):
        h = self.half_life
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h)
                              or not h > 0):
            raise ValueError(f"half_life: must be a finite number > 0 (null: no discount), got {h!r}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0 <= self.clip < 1:
            raise ValueError(f"clip: must be in [0, 1), got {self.clip!r}")
        if not isinstance(self.clip_high_only, bool):
            raise ValueError(f"clip_high_only: must be true or false, got {self.clip_high_only!r}")
        if self.against not in AGAINST:
            raise ValueError(f"against: must be one of {', '.join(AGAINST)}, got {self.against!r}")

    @property
    def gamma(self) -> float:
        return 1.0 if self.half_life is None else 2.0 ** (-1.0 / self.half_life)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        """The sample field the log-ratio is taken against (token_advantages' keyword)."""
        return ("ref_logp",) if self.against == "reference" else ("rollout_logp",)


def discounted_to_go(values: Tensor, gamma: float) -> Tensor:
    """[..., T] -> [..., T]: Σ_{s≥t} γ^{s−t}·values_s (a reverse scan: no γ^{−s} that overflows on long responses)."""
    out = torch.zeros_like(values)
    acc = torch.zeros_like(values[..., 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        acc = values[..., t] + gamma * acc
        out[..., t] = acc
    return out


@register(
    "future_drift", "advantage_stage", "token",
    "FIPO's future-KL influence weight (Ma et al. 2026, FIPO: Eliciting Deep Reasoning with Future-KL Influenced "
    "Policy Optimization, arXiv:2603.19835) applied before the update to π_old's drift from π_ref (or from the "
    "engine's μ): not FIPO's in-update Δ = log π_θ − log π_old, which is objective fipo",
    FutureDriftOptions,
)
def future_drift(adv: Tensor, s: TokenStats, o: FutureDriftOptions) -> Tensor:
    """Ã_{i,t} = A_i·f_t, f_t = clip(exp(F_t), lo, 1 + ε), F_t = Σ_{s=t}^{L} γ^{s−t}·Δ_s the discounted future drift,
    Δ_s = log π_old(y_s) − log b(y_s), γ = 2^(−1/half_life) (1: half_life null), lo = 1 (clip_high_only) or 1 − ε: a
    token whose continuation the training so far has made likelier (F_t > 0) gets up to 1 + ε times the sequence
    advantage. The discount, the exp-then-clip weight and its defaults are FIPO's [P: ms-swift's FIPO
    documentation]; its Δ is not: FIPO's Δ_s = log π_θ − log π_old is measured inside each update (objective fipo),
    where this stage runs once before the updates, where π_θ = π_old. So the other policy b here is [A]:
    against=reference (default) π_ref, the frozen start of training (Δ: how far training has moved each token;
    loads the reference as kl_coef > 0 does), or against=engine μ = sample.rollout_logp, the policy that drew the
    sample (Δ: staleness plus the engine's numerics; refused with old_policy=engine, where π_old is μ). The
    weight is a detached constant. (Registered as `fipo` until issue 32; that name now refuses, naming this.)"""
    other = s.ref_logp if o.against == "reference" else s.rollout_logp
    delta = torch.where(s.mask, s.old_logp - other, torch.zeros_like(s.old_logp))
    future = discounted_to_go(delta, o.gamma)
    lo = 1.0 if o.clip_high_only else 1.0 - o.clip
    weight = torch.clamp(torch.exp(future), lo, 1.0 + o.clip)
    return adv[..., None] * weight * s.mask


FIPO_RENAMED = ("the stage registered as fipo measured π_old's drift from π_ref (or μ) once before the update, not "
                "FIPO's drift of π_θ inside it: it is now algorithm.stages: [{name: future_drift, ...}] (same "
                "options); FIPO itself is algorithm.objective=fipo")


@dataclass
class RenamedFipoOptions(FutureDriftOptions):
    """The old stage name: accepts future_drift's options (so the message below is the one a config gets) and
    refuses."""

    def __post_init__(self):
        raise ValueError(FIPO_RENAMED)


@register(
    "fipo", "advantage_stage", "token",
    "renamed: the stage is future_drift, FIPO (Ma et al. 2026, arXiv:2603.19835) the objective fipo",
    RenamedFipoOptions,
)
def renamed_fipo(adv: Tensor, s: TokenStats, o) -> Tensor:
    """Refused: the stage fipo is now future_drift (π_old's drift from π_ref before the update); FIPO's
    in-update future-KL weight is objective fipo."""
    raise ValueError(FIPO_RENAMED)


NEEDS_ENTROPY = ("gtpo", "grpo_s")
# advantage_stage entries that do not turn sequence advantages into per-token ones (token_advantages refuses them)
NOT_TOKEN_ADVANTAGE = ("polarity", "future_kl", "d3s_select", "cumulative_std", "tempo", "gtpo_trajectory", "ktae",
                       "opid", "credit", "srpo",  # these three: megapo/algorithms/self_distill.py
                       "erpo", "aepo",  # megapo/algorithms/entropy_credit.py
                       "a3po")  # megapo/algorithms/a3po.py


def _padded(values: list, width: int, dtype) -> Tensor:
    out = torch.zeros(len(values), width, dtype=dtype)
    for i, v in enumerate(values):
        v = torch.as_tensor(v, dtype=dtype).reshape(-1)
        out[i, : v.numel()] = v
    return out


def _other_logp(name: str, values: list | None, lengths: list[int], width: int) -> Tensor:
    """[S, width] of a per-token log-prob list (`name` the sample field), each as long as its response."""
    for i, (v, n) in enumerate(zip(values or [None] * len(lengths), lengths)):
        if v is None or len(v) != n:
            raise ValueError(f"{name}[{i}]: expected {n} values (one per response token), got "
                             f"{None if v is None else len(v)}")
    return _padded(values, width, torch.float64)


def token_advantages(name: str, advantages: Tensor, old_logp: list, entropy: list | None = None, *,
                     group_size: int, rollout_logp: list | None = None, ref_logp: list | None = None,
                     **options) -> list[Tensor]:
    """Per-token advantages of stage `name`: `advantages` [S] (one per sample, groups of `group_size`
    contiguous), `old_logp` / `entropy` one sequence of π_old's response-token values per sample,
    `rollout_logp` / `ref_logp` the engine's / reference's where the stage reads them (its options' token_inputs).
    Returns one float64 tensor per sample, as long as its old_logp."""
    entry = get("advantage_stage", name, argument="token_advantage")
    if name in NOT_TOKEN_ADVANTAGE:
        raise ValueError(f"token_advantage: {name!r} is not a per-token advantage stage")
    opts = entry.make_options(options)
    lengths = [len(v) for v in old_logp]
    if advantages.numel() != len(lengths) or len(lengths) % group_size:
        raise ValueError(f"advantages: {advantages.numel()} for {len(lengths)} samples in groups of {group_size}")
    if name in NEEDS_ENTROPY and (entropy is None or any(e is None for e in entropy)):
        raise ValueError(f"entropy: token_advantage {name!r} needs π_old's per-token entropy (sample['old_entropy'])")
    for i, (n, e) in enumerate(zip(lengths, entropy or [None] * len(lengths))):
        if e is not None and len(e) != n:
            raise ValueError(f"entropy[{i}]: {len(e)} values for {n} response tokens")
    width, dt = max(lengths), torch.float64
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    shape = (-1, group_size, width)
    stats = TokenStats(_padded(old_logp, width, dt).view(shape),
                       None if entropy is None or any(e is None for e in entropy)  # kept only where read
                       else _padded(entropy, width, dt).view(shape), mask.view(shape))
    others = {"rollout_logp": rollout_logp, "ref_logp": ref_logp}
    for field_name in getattr(opts, "token_inputs", ()):
        setattr(stats, field_name, _other_logp(field_name, others[field_name], lengths, width).view(shape))
    out = entry.fn(advantages.to(dt).view(-1, group_size), stats, opts).reshape(len(lengths), width)
    return [out[i, :n] for i, n in enumerate(lengths)]


# ----------------------------------------------------------------------------- token weights


SELECT_SCOPES = ("batch", "trajectory")


@dataclass
class TokenSelectOptions:
    score: str = "entropy"  # entropy: H_t; adv_entropy: |A_t|·H_t
    rho: float = 0.2  # fraction of the batch's tokens with weight 1 (the top scores)
    weight: float = 0.0  # weight of the other tokens (0: masked out)
    rho_end: float | None = None  # anneal rho linearly to this over anneal_steps trainer steps
    anneal_steps: int = 0
    scope: str = "batch"  # batch: the top ρ of the whole batch's tokens; trajectory: the top ρ of each response's

    def __post_init__(self):
        if self.scope not in SELECT_SCOPES:
            raise ValueError(f"scope: must be one of {', '.join(SELECT_SCOPES)}, got {self.scope!r}")
        if self.score not in SCORES:
            raise ValueError(f"score: must be one of {', '.join(SCORES)}, got {self.score!r}")
        for name in ("rho", "rho_end"):
            v = getattr(self, name)
            if v is None and name == "rho_end":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {v!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not 0 <= self.weight <= 1:
            raise ValueError(f"weight: must be in [0, 1], got {self.weight!r}")
        _check_anneal("rho_end", self.rho_end, self.anneal_steps)

    def rho_at(self, step: int) -> float:
        """ρ at trainer step `step` (1-based): rho, moving linearly to rho_end over anneal_steps steps."""
        return _annealed(self.rho, self.rho_end, self.anneal_steps, step)


@register(
    "token_select", "token_weight", "batch",
    "token selection by entropy: D³S token level, |A|·H (Wang et al. 2025, Learning More with Less: A Dynamic "
    "Dual-Level Down-Sampling Framework for Efficient Policy Optimization, arXiv:2509.22115); EGSPO's entropy "
    "gate, attenuated low-entropy tokens (Hu et al. 2026, Entropy-Gated Selective Policy Optimization, "
    "arXiv:2602.03309); the high-entropy-minority rule (Wang et al. 2025, Beyond the 80/20 Rule); a schedule "
    "of the selection over training (Zhang et al. 2026, Not only where, But when: Temporal Scheduling for RLVR, "
    "arXiv:2605.25381)",
    TokenSelectOptions,
)
def token_select(scores: Tensor, o: TokenSelectOptions, step: int, lengths: list[int] | None = None) -> Tensor:
    """w_t = 1 if s_t ≥ τ else w; scope=batch: τ the k-th largest score over every response token of the batch,
    k = ⌈ρ·N⌉; scope=trajectory (the temporal-scheduling paper's trajectory percentiles): per response i, τ_i the
    k_i-th largest of its own scores, k_i = ⌈ρ·L_i⌉, i.e. its tokens at or above its (1 − ρ) percentile (ties at τ
    all get 1); s_t = H_t (score=entropy) or |A_t|·H_t (adv_entropy), H π_old's entropy, A the final per-token
    advantage; ρ moves linearly from rho to rho_end over anneal_steps trainer steps (rho_end = 1 with weight 0
    attenuates to uniform, the schedule that paper finds best). The weight multiplies the per-token loss; the
    normaliser still counts every token. Both scopes read only whole responses of the whole train batch, so the
    weights do not depend on micro-batch or DP splits. Assumption: the paper's percentile is per trajectory
    over π_old's token entropies, with its rank rule k_i = ⌈ρ·L_i⌉ ours. `lengths`: the responses' token counts,
    in order, for scope=trajectory."""
    rho = o.rho_at(step)
    if o.scope == "trajectory":
        if lengths is None or sum(lengths) != scores.numel():
            raise ValueError("lengths: token_select scope=trajectory needs each response's token count")
        out = []
        for part in torch.split(scores, list(lengths)):
            if part.numel() == 0:
                out.append(part.clone())
                continue
            k = max(1, math.ceil(rho * part.numel() - 1e-9))
            tau = torch.topk(part, k).values[-1]
            out.append(torch.where(part >= tau, torch.ones_like(part), torch.full_like(part, float(o.weight))))
        return torch.cat(out) if out else scores.clone()
    k = max(1, math.ceil(rho * scores.numel() - 1e-9))  # 0.3·20 is 6.000000000000001 in floats
    tau = torch.topk(scores, k).values[-1]
    return torch.where(scores >= tau, torch.ones_like(scores), torch.full_like(scores, float(o.weight)))


def token_select_weights(advantages: list, entropy: list, *, step: int = 1, **options) -> list[Tensor]:
    """Per-token loss weights of `token_select` for a batch: per-sample `advantages` (per token, or one
    number) and π_old `entropy` (per token); the quantile is taken once over the whole batch."""
    entry = get("token_weight", "token_select")
    opts = entry.make_options(options)
    if any(e is None for e in entropy):
        raise ValueError("entropy: token_select needs π_old's per-token entropy (sample['old_entropy'])")
    ent = [torch.as_tensor(e, dtype=torch.float64).reshape(-1) for e in entropy]
    adv = [torch.as_tensor(a, dtype=torch.float64).reshape(-1).expand(len(e)) for a, e in zip(advantages, ent)]
    flat_h = torch.cat(ent)
    scores = flat_h if opts.score == "entropy" else torch.cat(adv).abs() * flat_h
    weights = entry.fn(scores, opts, step, [len(e) for e in ent])
    return list(torch.split(weights, [len(e) for e in ent]))


# ----------------------------------------------------------------------------- future KL (FRPO)


@register(
    "future_kl", "advantage_stage", "token",
    "Yao, Wang, Bai, Zhang 2026, Future-KL Regularized GRPO: Process-Level Credit Assignment from f-Divergence "
    "Regularization (arXiv:2601.10201), FRPO; algorithm.stages {name: future_kl}, β = algorithm.kl_coef",
)
def future_kl(adv: Tensor, old_logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """A_{i,t} = A_{i,t} − β·Σ_{s≥t}(log π_old(y_s) − log π_ref(y_s)) over the response's tokens s from t to
    its end (the causal future-KL return-to-go of the reverse KL); A_{i,t} is the estimator's advantage
    (after the other advantage stages), log π_old the old-log-prob pass's, log π_ref the frozen reference's
    (the one algorithm.kl_coef > 0 already loads). No loss-side KL term (the KL is still measured, train/kl).
    [A: the log-ratio is taken against π_old, the policy that drew the samples, as a constant.]"""
    diff = torch.where(mask, old_logp - ref_logp, torch.zeros_like(old_logp))
    to_go = torch.flip(torch.cumsum(torch.flip(diff, [-1]), -1), [-1])
    return (adv - beta * to_go) * mask


def future_kl_advantages(advantages: list, old_logp: list, ref_logp: list, *, beta: float) -> list[Tensor]:
    """future_kl per sample: `advantages` one number or one per response token, `old_logp` / `ref_logp` one
    per response token. Returns one float64 tensor per sample."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta: must be a finite number >= 0, got {beta!r}")
    lengths = [len(v) for v in old_logp]
    for i, (r, n) in enumerate(zip(ref_logp, lengths)):
        if r is None or len(r) != n:
            raise ValueError(f"ref_logp[{i}]: expected {n} values (one per response token), got "
                             f"{None if r is None else len(r)}")
    width, dt = max(lengths), torch.float64
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    adv = _padded([torch.as_tensor(a, dtype=dt).reshape(-1).expand(n) for a, n in zip(advantages, lengths)],
                  width, dt)
    out = get("advantage_stage", "future_kl").fn(adv, _padded(old_logp, width, dt), _padded(ref_logp, width, dt),
                                                 mask, float(beta))
    return [out[i, :n] for i, n in enumerate(lengths)]


# ----------------------------------------------------------------------------- token masks


RENORMS = ("batch", "sequence", "none")


@dataclass
class StapoOptions:
    prob_max: float = 0.01  # [P] a spurious token's π_old(y_t) is below this
    # and π_old's entropy there below the entropy_percentile-th percentile of the train batch's token entropies
    # (unset: the paper's 5th), or below entropy_max (nats), an absolute threshold, when that is given instead
    entropy_percentile: float | None = None
    entropy_max: float | None = None
    renorm: str = "batch"  # batch: N/N_kept (token-mean's normaliser); sequence: L_i/L_i,kept; none

    def __post_init__(self):
        if isinstance(self.prob_max, bool) or not isinstance(self.prob_max, (int, float)) or not 0 < self.prob_max <= 1:
            raise ValueError(f"prob_max: must be in (0, 1], got {self.prob_max!r}")
        if self.entropy_max is not None and (isinstance(self.entropy_max, bool)
                                             or not isinstance(self.entropy_max, (int, float))
                                             or not math.isfinite(self.entropy_max) or self.entropy_max <= 0):
            raise ValueError(f"entropy_max: must be a finite number > 0, got {self.entropy_max!r}")
        q = self.entropy_percentile
        if q is not None:
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or not 0 < q < 100:
                raise ValueError(f"entropy_percentile: must be a number in (0, 100), got {q!r}")
            if self.entropy_max is not None:
                raise ValueError("entropy_percentile: give entropy_percentile (a batch percentile) or entropy_max "
                                 "(an absolute threshold), not both")
        if self.renorm not in RENORMS:
            raise ValueError(f"renorm: must be one of {', '.join(RENORMS)}, got {self.renorm!r}")


STAPO_ENTROPY_PERCENTILE = 5.0  # the paper's τ_h: the 5th percentile of the token entropies


def stapo_entropy_threshold(entropy: Tensor, o: StapoOptions) -> float:
    """τ_h of stapo: entropy_max when given, else the entropy_percentile-th (default 5th) percentile of `entropy`,
    every response token of the train batch (linear interpolation between order statistics, as torch.quantile,
    by a sort: no element limit); an empty batch gives -inf."""
    if o.entropy_max is not None:
        return float(o.entropy_max)
    if entropy.numel() == 0:
        return -math.inf
    q = (STAPO_ENTROPY_PERCENTILE if o.entropy_percentile is None else float(o.entropy_percentile)) / 100.0
    ordered = torch.sort(entropy.reshape(-1).to(torch.float64)).values
    pos = q * (ordered.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, ordered.numel() - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@register(
    "stapo", "token_weight", "batch",
    "Liu et al. 2026, STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare Spurious Tokens "
    "(arXiv:2602.15620), the S2T mask",
    StapoOptions,
)
def stapo(prob: Tensor, entropy: Tensor, positive: Tensor, owner: Tensor, o: StapoOptions) -> Tensor:
    """M_t = 0 where the response is positive (sign of Σ_t A_t > 0: a correct response's tokens inherit the
    reward) and π_old(y_t) < τ_p and H_t < τ_h (H π_old's entropy), else 1. τ_p = prob_max (the paper: 0.01);
    τ_h = the q-th percentile of H over every response token of the whole train batch (q = entropy_percentile, the
    paper's 5 when unset; linear interpolation between order statistics, torch.quantile's), taken once over the
    batch so it does not depend on micro-batch or DP splits; or τ_h = entropy_max when that absolute threshold is
    given instead. Assumption: the percentile is over all the batch's response tokens (positive and negative
    responses alike), not per trajectory. The loss is renormalised over the kept tokens [A: as a weight, the
    normaliser itself unchanged]: renorm=batch w_t = M_t·N/Σ M (N every response token of the train batch, so a
    token-mean loss divides by the kept count), sequence w_t = M_t·L_i/Σ_{t∈i} M_t (per response, for the seq-mean
    aggregations), none w_t = M_t. Inputs are flat over the batch's tokens; `owner` maps each to its sample."""
    keep = ~(positive[owner] & (prob < o.prob_max) & (entropy < stapo_entropy_threshold(entropy, o)))
    kept = keep.to(prob.dtype)
    if o.renorm == "batch":
        total = kept.sum()
        return kept * (kept.numel() / total) if total > 0 else kept
    if o.renorm == "sequence":
        n = len(positive)
        per = torch.zeros(n, dtype=prob.dtype).index_add_(0, owner, kept)
        size = torch.zeros(n, dtype=prob.dtype).index_add_(0, owner, torch.ones_like(kept))
        return kept * (size / per.clamp(min=1))[owner]
    return kept


@dataclass
class NatPrefixOptions:
    # drop the tokens after each cut from the train steps' batch (megapo/algorithms/nat_cut.py: the forward and
    # backward never see them); False: they stay in it at weight 0 (any objective and aggregation)
    cut: bool = True

    def __post_init__(self):
        if not isinstance(self.cut, bool):
            raise ValueError(f"cut: must be true or false, got {self.cut!r}")


def nat_prefix_cuts(lengths: list[int], rng) -> list[int]:
    """nat_prefix's cut c ~ Uniform{1, …, L} per response of L tokens (0 for an empty one), in batch order."""
    return [int(rng.integers(1, n + 1)) if n else 0 for n in lengths]


@register(
    "nat_prefix", "token_weight", "sequence",
    "Sang et al. 2026, Not all tokens are needed (NAT): token efficient reinforcement learning (arXiv:2603.06619), "
    "Random Prefix Cutting with Horvitz-Thompson reweighting",
    NatPrefixOptions,
)
def nat_prefix(lengths: list[int], rng) -> list[Tensor]:
    """Per response of L tokens a cut c ~ Uniform{1, …, L}; tokens t ≤ c are kept with weight
    1/P(t kept) = L/(L − t + 1) (Horvitz–Thompson: P(c ≥ t) = (L − t + 1)/L, so the weighted sum of a
    per-token loss is unbiased for the full sum), tokens t > c get weight 0. `rng` a numpy Generator (the loop
    seeds it from (train.seed, trainer step), so a resumed run cuts as the unstopped one). With cut (the default)
    the train steps never see the tokens after c: each sample ends at prompt + c before packing, and the kept
    tokens' weights absorb the change of the loss normalisers, so the policy loss and its gradient are those of
    the uncut batch at weight 0 (megapo/algorithms/nat_cut.py). Assumption: the normalisers stay those of the full
    responses (the unbiased estimate of the full loss); the KL and entropy terms, unweighted, average over the kept
    tokens."""
    return nat_prefix_weights(lengths, nat_prefix_cuts(lengths, rng))


def nat_prefix_weights(lengths: list[int], cuts: list[int]) -> list[Tensor]:
    """nat_prefix's weights of given cuts: L/(L − t + 1) at the tokens t ≤ c of a response of L tokens, 0 after
    (the trainer draws the cuts once per step and hands them to the stage: megapo/algorithms/nat_cut.py)."""
    out = []
    for n, cut in zip(lengths, cuts):
        t = torch.arange(1, n + 1, dtype=torch.float64)
        out.append(torch.where(t <= cut, n / (n - t + 1), torch.zeros_like(t)))
    return out


@dataclass
class NatUniformOptions:
    keep: float = 0.5  # q: each response token is kept with this probability

    def __post_init__(self):
        q = self.keep
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or not 0 < q <= 1:
            raise ValueError(f"keep: must be in (0, 1], got {q!r}")


@register(
    "nat_uniform", "token_weight", "sequence",
    "Sang et al. 2026, Not all tokens are needed (NAT): token efficient reinforcement learning (arXiv:2603.06619), "
    "Uniform Random Sampling with Horvitz-Thompson reweighting",
    NatUniformOptions,
)
def nat_uniform(lengths: list[int], rng, o: NatUniformOptions) -> list[Tensor]:
    """Each response token is kept independently with probability q = keep, at weight 1/q (Horvitz–Thompson:
    E[w_t] = q·(1/q) = 1, so the weighted sum of a per-token loss is unbiased for the full sum); a dropped token
    gets weight 0. One uniform draw per token, the batch's responses in order, from `rng` (a numpy Generator seeded
    from (train.seed, trainer step), as nat_prefix). A causal model still needs every token as context, so the
    dropped ones still run forward and backward at weight 0 (no compute saved, unlike nat_prefix's cut).
    Assumption: the loss normalisers stay those of the full responses (the unbiased estimate of the full loss)."""
    out = []
    for n in lengths:
        kept = torch.from_numpy(rng.random(n)) < o.keep
        out.append(kept.to(torch.float64) / o.keep)
    return out


TOKEN_MASKS = ("stapo", "nat_prefix", "nat_uniform")


def _sequence_sign(advantages: list, lengths: list[int]) -> Tensor:
    """[S] bool: Σ_t A_t > 0 per sample (a scalar advantage counts once per token), in float64."""
    return torch.tensor([float(torch.as_tensor(a, dtype=torch.float64).reshape(-1).expand(n).sum()) > 0
                         for a, n in zip(advantages, lengths)])


def token_mask_weights(name: str, *, lengths: list[int], advantages: list | None = None, old_logp: list | None = None,
                       entropy: list | None = None, seed: int = 0, step: int = 1, **options) -> list[Tensor]:
    """Per-token loss weights of token mask `name` (stapo | nat_prefix | nat_uniform) for a whole train batch of
    responses of `lengths` tokens: stapo from per-sample `advantages` (a number or one per token), π_old's
    `old_logp` and `entropy` (per token); nat_prefix and nat_uniform draw from numpy's default_rng([seed, step])."""
    import numpy as np

    if name not in TOKEN_MASKS:
        raise ValueError(f"token_mask: unknown {name!r}; choose from {', '.join(TOKEN_MASKS)}")
    entry = get("token_weight", name, argument="token_mask")
    opts = entry.make_options(options)
    lengths = [int(n) for n in lengths]
    if name == "nat_prefix":
        return entry.fn(lengths, np.random.default_rng([int(seed), int(step)]))
    if name == "nat_uniform":
        return entry.fn(lengths, np.random.default_rng([int(seed), int(step)]), opts)
    if old_logp is None or [len(v) for v in old_logp] != lengths:
        raise ValueError("old_logp: token_mask 'stapo' needs π_old's log-prob at every response token")
    if entropy is None or any(e is None for e in entropy):
        raise ValueError("entropy: token_mask 'stapo' needs π_old's per-token entropy (sample['old_entropy'])")
    prob = torch.exp(torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in old_logp]))
    ent = torch.cat([torch.as_tensor(e, dtype=torch.float64).reshape(-1) for e in entropy])
    if ent.numel() != prob.numel():
        raise ValueError("entropy: one value per response token expected, as old_logp")
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    weights = entry.fn(prob, ent, _sequence_sign(advantages, lengths), owner, opts)
    return list(torch.split(weights, lengths))


# ----------------------------------------------------------------------------- sample selection (D³S)


@dataclass
class SampleSelectOptions:
    keep: float = 0.5  # fraction of each group's rollouts kept (⌈keep·n⌉, at least 2)
    keep_end: float | None = None  # anneal keep linearly to this over anneal_steps trainer steps
    anneal_steps: int = 0

    def __post_init__(self):
        for name in ("keep", "keep_end"):
            v = getattr(self, name)
            if v is None and name == "keep_end":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name}: must be in (0, 1], got {v!r}")
        _check_anneal("keep_end", self.keep_end, self.anneal_steps)

    def keep_at(self, step: int) -> float:
        return _annealed(self.keep, self.keep_end, self.anneal_steps, step)


def max_variance_subset(values: list[float], k: int) -> list[int]:
    """Indices of a k-subset of `values` with the largest (population) variance. Such a subset is the j
    smallest and k - j largest values for some j (moving any kept value toward the rest's mean can only
    lower the variance), so the k + 1 splits are compared; the first best (smallest j) wins a tie."""
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    best, best_var = None, -1.0
    for j in range(k + 1):
        chosen = order[:j] + order[len(order) - (k - j):]
        vals = [values[i] for i in chosen]
        mean = sum(vals) / k
        var = sum((v - mean) ** 2 for v in vals) / k
        if var > best_var + 1e-15:
            best, best_var = chosen, var
    return sorted(best)


@register(
    "d3s_select", "advantage_stage", "group",
    "Wang et al. 2025, Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy "
    "Optimization (arXiv:2509.22115), D³S sample level",
    SampleSelectOptions,
)
def d3s_select(adv: Tensor, o: SampleSelectOptions, step: int) -> Tensor:
    """Per group of n rollouts: k = max(2, ⌈keep_t·n⌉) (at most n) of them, the subset S maximising
    Var_{i∈S}(A_i) (population variance of the estimator's advantages); A_i is kept for i ∈ S and set to 0
    otherwise [A: a dropped rollout still runs forward and backward and its tokens still count in the loss's
    normaliser; it only gets no gradient]. keep_t moves linearly from keep to keep_end over anneal_steps
    trainer steps (the abstract's schedule from aggressive to relaxed down-sampling; the linear form is ours)
    [A: the selection is per group (a summary of the paper names this intra-group variant D³S-I); the
    cross-group variant is not implemented]."""
    n = adv.shape[-1]
    k = min(n, max(2, math.ceil(o.keep_at(step) * n - 1e-9)))
    out = torch.zeros_like(adv)
    for g, row in enumerate(adv.tolist()):
        for i in max_variance_subset(row, k):
            out[g, i] = adv[g, i]
    return out


def select_samples(adv: Tensor, *, step: int = 1, **options) -> Tensor:
    """d3s_select on [P, n] sequence advantages (groups as rows) at trainer step `step`."""
    entry = get("advantage_stage", "d3s_select", argument="stage")
    return entry.fn(adv, entry.make_options(options), step)


# ----------------------------------------------------------------------------- DCPO smoothed standardisation


@dataclass
class CumulativeStdOptions:
    eps: float = 1e-6

    def __post_init__(self):
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not self.eps > 0:
            raise ValueError(f"eps: must be > 0, got {self.eps!r}")


class PromptRewardStats:
    """Running count, mean and sum of squared deviations (Welford, float64) of each prompt's rewards over
    every trainer step so far, by prompt key; `state_dict()` is JSON (the trainer checkpoint keeps it)."""

    def __init__(self, state: dict | None = None):
        self.stats: dict[str, list[float]] = {}
        if state:
            self.load_state_dict(state)

    def update(self, key: str, rewards: list[float]) -> tuple[float, float]:
        """Add `rewards`; returns the prompt's cumulative (mean, population std), these rewards included."""
        count, mean, m2 = self.stats.get(key, [0.0, 0.0, 0.0])
        for r in rewards:
            count += 1
            delta = r - mean
            mean += delta / count
            m2 += delta * (r - mean)
        self.stats[key] = [count, mean, m2]
        return mean, math.sqrt(max(m2, 0.0) / count)

    def state_dict(self) -> dict:
        return {k: list(v) for k, v in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if not (isinstance(value, list) and len(value) == 3 and all(isinstance(x, (int, float)) for x in value)
                    and value[0] >= 1):
                raise ValueError(f"prompt_stats[{key!r}]: expected [count >= 1, mean, m2], got {value!r}")
        self.stats = {k: [float(x) for x in v] for k, v in state.items()}


def prompt_key(prompt: str) -> str:
    """A short stable key of a prompt's text (the running statistics' index)."""
    import hashlib

    return hashlib.sha256(prompt.encode()).hexdigest()[:20]


@register(
    "cumulative_std", "advantage_stage", "group",
    "Yang et al. 2025, DCPO: Dynamic Clipping Policy Optimization (arXiv:2509.02333), smooth advantage "
    "standardisation",
    CumulativeStdOptions,
)
def cumulative_std(rewards: Tensor, keys: list[str], stats: PromptRewardStats, o: CumulativeStdOptions) -> Tensor:
    """A_i = (R_i − μ_p)/(σ_p + eps), μ_p and σ_p the mean and population std of every reward prompt p has
    received over the training so far, this step's group included (the abstract: rewards standardised across
    cumulative training steps), so a group of equal rewards still gets a signal once the prompt has varied;
    0 while σ_p = 0. Replaces GRPO's per-group statistics [A: the cumulative form with equal weight for every
    past step; no decay]. The running statistics live in the trainer checkpoint."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for g, (key, row) in enumerate(zip(keys, rewards.tolist())):
        mean, std = stats.update(key, row)
        if std > 0:
            out[g] = (torch.tensor(row, dtype=torch.float64) - mean) / (std + o.eps)
    return out


def cumulative_advantages(rewards: Tensor, prompts: list[str], stats: PromptRewardStats, **options) -> Tensor:
    """cumulative_std on [P, n] rewards of the prompts `prompts` (their text), updating `stats`."""
    entry = get("advantage_stage", "cumulative_std", argument="stage")
    if len(prompts) != rewards.shape[0]:
        raise ValueError(f"prompts: {len(prompts)} for {rewards.shape[0]} groups")
    return entry.fn(rewards.to(torch.float64), [prompt_key(p) for p in prompts], stats, entry.make_options(options))


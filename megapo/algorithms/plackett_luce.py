"""HAEPO: Trivedi et al. 2025, HAEPO: History-Aggregated Exploratory Policy Optimization (arXiv:2508.18884).

Each trajectory is compressed into its cumulative log-likelihood L_i = Σ_t log π(y_{i,t}); a Plackett-Luce softmax
across trajectories turns these into weights w_i = e^{L_i} / Σ_j e^{L_j}, and the objective is the return under
those weights, J = Σ_i w_i·R_i, with an entropy bonus and a soft KL penalty to the previous policy (abstract).

The softmax couples the trajectories of a group, and the learner cuts a batch into micro-batches and DP shards
without regard to groups. So HAEPO is two pieces here, which together are split-invariant:

- the token stage `plackett_luce` (algorithm.stages, after the old-log-prob pass, on the whole train batch) turns
  each group's returns and π_old's trajectory log-likelihoods into one detached number per trajectory,
  Â_i = w_i^old·(R_i − Σ_j w_j^old·R_j), the coefficient of ∇L_i in ∇J;
- the objective `haepo` gives each trajectory the loss -ρ_i·Â_i with ρ_i = e^{L_i(θ) − L_i^old} its trajectory
  likelihood ratio (per sequence, so any split sums to the same loss), plus the soft KL to π_old per token.

At θ = θ_old (the first update on a rollout batch) the gradient of the pair is exactly -∇J; on later updates ρ_i
carries the trajectory's move, with the Plackett-Luce normaliser held at π_old's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.objectives import ObjectiveOut
from megapo.algorithms.registry import register

PAPER = "Trivedi et al. 2025, HAEPO: History-Aggregated Exploratory Policy Optimization (arXiv:2508.18884)"
STAGE = "plackett_luce"  # the stage the objective haepo needs (algorithm.stages)


# ----------------------------------------------------------------------------------------- the stage


@register(STAGE, "advantage_stage", "group", PAPER + ", the Plackett-Luce trajectory weights")
def plackett_luce_advantages(returns: Tensor, traj_logp: Tensor) -> Tensor:
    """[P, n] -> [P, n], one group per row: L_i = Σ_t log π_old(y_{i,t}) over trajectory i's policy tokens (its
    cumulative log-likelihood), w_i = e^{L_i} / Σ_j e^{L_j} (the Plackett-Luce softmax across the group's
    trajectories: the probability that trajectory i ranks first), Â_i = w_i·(R_i − Σ_j w_j·R_j), so that
    Σ_i Â_i·∇L_i = ∇_θ Σ_i w_i(θ)·R_i at θ = θ_old. Each token of trajectory i gets Â_i (objective haepo).
    assumption: the trajectories of one prompt's group are the list the softmax runs across (the abstract's "across
    trajectories"; likelihoods of different prompts do not compare), and the returns R_i are the configured
    estimator's per-sample values (grpo: the group-standardised rewards)."""
    if returns.shape != traj_logp.shape or returns.dim() != 2:
        raise ValueError(f"traj_logp: shape {tuple(traj_logp.shape)} does not match returns' {tuple(returns.shape)} "
                         "(both [P, n])")
    w = torch.softmax(traj_logp, dim=-1)
    return w * (returns - (w * returns).sum(-1, keepdim=True))


def run_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `plackett_luce`: the whole train batch, groups of ctx.group_size contiguous;
    L_i sums π_old (sample.old_logp) over the tokens the policy sampled (sample.loss_mask, all when None). Per
    sample its Â_i at every token, and plackett_luce/weight_max."""
    returns, sums = [], []
    for x in batch:
        if isinstance(x.advantage, (list, tuple)):
            raise ValueError(f"advantage: stage {STAGE} needs one return per trajectory; an earlier token stage made "
                             "it per token (list plackett_luce first among the token stages)")
        lp = torch.tensor(x.old_logp, dtype=torch.float64)
        if x.loss_mask is not None:
            lp = lp * torch.tensor(x.loss_mask, dtype=torch.float64)
        returns.append(float(x.advantage))
        sums.append(float(lp.sum()))
    n = ctx.group_size
    if len(batch) % n:
        raise ValueError(f"group_size: {len(batch)} samples do not make groups of {n}")
    r = torch.tensor(returns, dtype=torch.float64).view(-1, n)
    ll = torch.tensor(sums, dtype=torch.float64).view(-1, n)
    adv = plackett_luce_advantages(r, ll).reshape(-1)
    values = [torch.full((len(x.old_logp),), a, dtype=torch.float64) for x, a in zip(batch, adv.tolist())]
    return values, {f"{STAGE}/weight_max": float(torch.softmax(ll, -1).max(-1).values.mean())}


# ----------------------------------------------------------------------------------------- the objective


@dataclass
class HAEPOOptions:
    kl_prev: float = 0.01  # β of the soft KL to π_old (assumption: the default)
    max_log_ratio: float = 20.0  # numerics: log ρ_i is capped here (gradient 0 beyond)

    def __post_init__(self):
        for key in ("kl_prev", "max_log_ratio"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{key}: must be a finite number >= 0, got {value!r}")
        if not self.max_log_ratio > 0:
            raise ValueError(f"max_log_ratio: must be > 0, got {self.max_log_ratio!r}")


@register("haepo", "objective", "sequence", PAPER, HAEPOOptions,
          loss_agg="seq-mean-token-mean")  # every token of i carries i's value: the mean over trajectories
def haepo(b: TokenBatch, o: HAEPOOptions) -> ObjectiveOut:
    """ρ_i = exp(min(Σ_t log r_{i,t}, max_log_ratio)) = π_θ(y_i)/π_old(y_i), the trajectory likelihood ratio
    (L_i(θ) − L_i^old, the cumulative log-likelihoods); A_t = Â_i from stage plackett_luce (algorithm.stages:
    w_i^old·(R_i − Σ_j w_j^old·R_j), the Plackett-Luce weights of the group); KL_t = r_t − 1 − log r_t (k3 of
    KL(π_old ‖ π_θ) on π_old's samples: the soft KL to the frozen previous policy);
    loss_t = -ρ_i·A_t + kl_prev·KL_t. With the default loss_agg "seq-mean-token-mean" this is
    -(1/S)·Σ_i ρ_i·Â_i + kl_prev·(1/S)·Σ_i mean_t KL_{i,t}, whose gradient at θ = θ_old is -(1/S)·∇_θ Σ_groups
    Σ_i w_i(θ)·R_i. Entropy regularisation is the spec's entropy bonus (algorithm.entropy_coef: − c·H, aggregated
    alike), which RunConfig requires > 0 with haepo.
    assumption: the Plackett-Luce normaliser is held at π_old's (the per-sequence ρ_i carries the move on later
    updates), which keeps the loss a sum over trajectories and so independent of the micro-batch / DP split; the
    KL estimator k3 and kl_prev = 0.01 are this library's choices."""
    log_r = (b.logp - b.old_logp) * b.fmask
    log_rho = b.seq_sum(log_r).clamp(max=o.max_log_ratio)
    rho = torch.exp(log_rho)[:, None].expand_as(b.logp)
    kl = torch.exp(log_r.clamp(max=o.max_log_ratio)) - 1 - log_r
    return ObjectiveOut(-rho * b.advantages + o.kl_prev * kl, rho.detach())

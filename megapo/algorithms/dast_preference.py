"""DAST's budget preference optimisation: Shen et al. 2025, DAST: Difficulty-Adaptive Slow-Thinking for Large
Reasoning Models (arXiv:2503.04472).

DAST has two pieces. Its budget-aware reward shaping is the length reward `dast` (megapo/algorithms/length.py: the
Token Length Budget B = p̂·L̄_c + (1 − p̂)·L_max and each response's budget score, added to its reward). Its budget
preference optimisation turns those shaped scores into preference pairs of responses to one question (a shorter
correct response over a longer one, a longer incorrect one over a shorter one) and trains on them with SimPO
(Meng et al. 2024, SimPO: Simple Preference Optimization with a Reference-Free Reward, arXiv:2405.14734):
−log σ(β/|y_w|·log π(y_w|x) − β/|y_l|·log π(y_l|x) − γ). This module is that second piece, the stage

    data: {length_reward: dast}
    algorithm: {stages: [{name: dast_simpo, coef: 1.0, beta: 2.0, gamma: 1.0, margin: 0.1}]}

The paper samples once, builds the pairs offline and runs SimPO as its own training stage. Here (Assumption) the
pairs are on-policy: each RL step's groups (the rollout.n_samples responses of a prompt, with the `dast` length
reward's shaped rewards R' and the verifier's verdicts) give that step's pairs, and the SimPO term joins the RL
loss. A pair couples two sequences, and the learner cuts a train batch into DP shards and micro-batches by length,
without regard to groups; so, as HAEPO's stage does (megapo/algorithms/plackett_luce.py), the coupling is resolved
once, on the whole train batch after the old-log-prob pass: with ℓ̄_i = mean_t log π(y_{i,t}) (over policy tokens)
and every pair's weight σ(−z) taken at π_old, the SimPO gradient is Σ_i (∂L/∂ℓ̄_i)·∇ℓ̄_i, a sum over sequences, and
the stage adds each sequence's coefficient to its advantage. Under the aggregation seq-mean-token-mean (which the
config requires) an objective whose gradient at θ = θ_old is −A_t·∇log π(y_t) (ppo, gspo, ...) then gets exactly
the RL gradient plus coef·∇ of the preference loss there, whatever the micro-batch / DP split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from megapo.algorithms.options import check_number
from megapo.algorithms.registry import register
from megapo.algorithms.token_tensors import group_ranges, per_token_advantages

PAPER = ("Shen et al. 2025, DAST: Difficulty-Adaptive Slow-Thinking for Large Reasoning Models (arXiv:2503.04472), "
         "budget preference optimisation with SimPO")
STAGE = "dast_simpo"
LENGTH_REWARD = "dast"  # the length reward whose shaped scores make the pairs
AGGREGATION = "seq-mean-token-mean"  # the one aggregation whose per-sequence normaliser is SimPO's 1/|y|


@dataclass
class DastSimpoOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)
    coef: float = 1.0  # α, the preference loss's weight beside the RL loss (Assumption: this library's)
    beta: float = 2.0  # β, SimPO's reward scale (Assumption: in SimPO's usual range; DAST's value not at hand)
    gamma: float = 1.0  # γ, SimPO's target reward margin (Assumption, as beta)
    margin: float = 0.1  # δ: a pair needs R'_w − R'_l > δ (Assumption: the gap rule and its value are ours)
    cross_pairs: bool = False  # also a correct response over an incorrect one (Assumption: not DAST's two pair types)

    def __post_init__(self):
        check_number("coef", self.coef, above=0)
        check_number("beta", self.beta, above=0)
        check_number("gamma", self.gamma, low=0)
        check_number("margin", self.margin, low=0)
        if not isinstance(self.cross_pairs, bool):
            raise ValueError(f"cross_pairs: must be true or false, got {self.cross_pairs!r}")


# ----------------------------------------------------------------------------------------- the pieces


def budget_pairs(rewards: Tensor, correct: Tensor, margin: float, cross_pairs: bool = False) -> Tensor:
    """[n] shaped rewards R' and verdicts of one group -> [m, 2] (w, l) index pairs, in (w, l) order: both correct
    (Dual-Correct: the higher R', the shorter response under dast) or both incorrect (Dual-Incorrect: the higher R',
    the longer one), with R'_w − R'_l > margin; with cross_pairs also a correct w over an incorrect l."""
    r = rewards.to(torch.float64)
    c = correct.to(torch.bool)
    same = c[:, None] == c[None, :]
    eligible = same | (c[:, None] & ~c[None, :]) if cross_pairs else same
    return torch.nonzero(eligible & (r[:, None] - r[None, :] > margin))


def simpo_loss(mean_logp_w: Tensor, mean_logp_l: Tensor, beta: float, gamma: float) -> Tensor:
    """−log σ(β·ℓ̄_w − β·ℓ̄_l − γ), ℓ̄ = log π(y|x)/|y| (elementwise)."""
    return -F.logsigmoid(beta * (mean_logp_w - mean_logp_l) - gamma)


@register(STAGE, "advantage_stage", "group", PAPER, DastSimpoOptions)
def dast_simpo_advantages(rewards: Tensor, correct: Tensor, mean_logp: Tensor, group_size: int,
                          o: DastSimpoOptions) -> tuple[Tensor, dict]:
    """Per group g (its n responses, R' the dast length reward's shaped rewards: R + w·s with s the budget score) the
    pairs P_g: (w, l) both correct or both incorrect (DAST's Dual-Correct and Dual-Incorrect pairs) with
    R'_w − R'_l > δ (margin), and with cross_pairs also correct w over incorrect l. The preference loss
    L = Σ_g (n/|P_g|)·Σ_{(w,l)∈P_g} −log σ(β·ℓ̄_w − β·ℓ̄_l − γ) (SimPO; ℓ̄_i = mean over i's policy tokens of
    log π(y_{i,t}): the length-normalised log-likelihood), so that, with the loss aggregation seq-mean-token-mean's
    1/S, it is the mean over prompts of their mean pair loss (a prompt without pairs adds 0). The stage adds to
    every token's advantage of response i ΔA_i = −coef·∂L/∂ℓ̄_i at π_old, = coef·β·(n/|P_g|)·(Σ_{(i,l)} σ(−z_il) −
    Σ_{(w,i)} σ(−z_wi)), z_wl = β·(ℓ̄_w^old − ℓ̄_l^old) − γ; under seq-mean-token-mean the RL loss's gradient at
    θ = θ_old then gains coef·(1/S)·∇_θ L.
    Assumption: on-policy pairs from each step's groups, trained inside the RL step (the paper builds the pairs once
    from sampled responses and runs SimPO offline, as a stage of its own); the pair weights σ(−z) are held at π_old
    (exact at the first update on a rollout batch; later updates move ℓ̄ through the objective's ratio); the pairs
    compare the shaped rewards R' (R + w·s, so within a pair type the budget scores s); the two pair types are the
    paper's Dual-Correct and Dual-Incorrect pairs as summaries of it describe them (its method section was not at
    hand: the gap rule R'_w − R'_l > δ, cross_pairs, δ, β, γ, coef and the n/|P_g| normalisation are this library's
    choices)."""
    n = rewards.numel()
    if not correct.numel() == mean_logp.numel() == n:
        raise ValueError(f"mean_logp: rewards, correct and mean_logp must have one entry per sample ({n})")
    coeff = torch.zeros(n, dtype=torch.float64)
    losses, wins, per_group = [], [], []
    for r in group_ranges(n, group_size):
        g = slice(r.start, r.stop)
        pairs = budget_pairs(rewards[g], correct[g], o.margin, o.cross_pairs)
        per_group.append(len(pairs))
        if not len(pairs):
            continue
        ell = mean_logp[g].to(torch.float64)
        w, l = pairs[:, 0], pairs[:, 1]
        z = o.beta * (ell[w] - ell[l]) - o.gamma
        weight = torch.sigmoid(-z) * (group_size / len(pairs))
        local = torch.zeros(group_size, dtype=torch.float64)
        local.index_add_(0, w, weight)
        local.index_add_(0, l, -weight)
        coeff[g] = local
        losses.append(simpo_loss(ell[w], ell[l], o.beta, o.gamma))
        wins.append((z > 0).to(torch.float64))
    shift = o.coef * o.beta * coeff
    flat = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
    metrics = {f"{STAGE}/pairs": sum(per_group) / max(len(per_group), 1),
               f"{STAGE}/groups_with_pairs": sum(1 for k in per_group if k) / max(len(per_group), 1),
               f"{STAGE}/loss_old": float(flat.mean()) if flat.numel() else 0.0,
               f"{STAGE}/margin_won": float(torch.cat(wins).mean()) if wins else 0.0,
               f"{STAGE}/adv_shift": float(shift.abs().mean()) if n else 0.0}
    return shift, metrics


def mean_policy_logp(old_logp, loss_mask) -> float:
    """ℓ̄ = mean over the response's policy tokens (loss_mask 1; all when None) of log π_old; 0 for none."""
    lp = torch.as_tensor(old_logp, dtype=torch.float64)
    m = torch.ones_like(lp) if loss_mask is None else torch.as_tensor(loss_mask, dtype=torch.float64)
    return float((lp * m).sum() / m.sum()) if float(m.sum()) > 0 else 0.0


def run_dast_simpo_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `dast_simpo`: the whole train batch, groups of ctx.group_size contiguous; per
    sample its advantage (its one value, or the per-token values an earlier stage set) per token, each + ΔA_i."""
    if ctx.rewards is None or ctx.correct is None:
        raise ValueError(f"reward: stage {STAGE} needs the shaped rewards and the verdicts (update.advantage_stages)")
    rewards = torch.tensor([float(r) for r in ctx.rewards], dtype=torch.float64)
    correct = torch.tensor([bool(c) for c in ctx.correct], dtype=torch.bool)
    mean_logp = torch.tensor([mean_policy_logp(x.old_logp, x.loss_mask) for x in batch], dtype=torch.float64)
    shift, metrics = dast_simpo_advantages(rewards, correct, mean_logp, ctx.group_size, s.options)
    per_token = per_token_advantages([x.advantage for x in batch], [len(x.old_logp) for x in batch])
    return [a + d for a, d in zip(per_token, shift.tolist())], metrics


# ----------------------------------------------------------------------------------------- the run's rules


def check_run_config(cfg) -> None:
    """A run with stage dast_simpo: its pairs come from data.length_reward dast's shaped rewards; its per-sequence
    coefficients reach SimPO's 1/|y| only under loss aggregation seq-mean-token-mean; haepo's trajectory ratio would
    weigh Σ_t log π instead. ConfigError naming the field."""
    from megapo.algorithms.aggregation import resolve
    from megapo.config import ConfigError

    a = cfg.algorithm
    where = [i for i, s in enumerate(a.pipeline()) if s.name == STAGE]
    if not where:
        return
    at = f"stage {STAGE} (algorithm.stages[{where[0]}])"
    if cfg.data.length_reward != LENGTH_REWARD:
        raise ConfigError("data.length_reward", f"{at} builds its preference pairs from the {LENGTH_REWARD} length "
                          f"reward's shaped scores: set {LENGTH_REWARD}, got {cfg.data.length_reward!r}")
    agg = resolve(a.loss_agg, a.objective)
    if agg != AGGREGATION:
        raise ConfigError("algorithm.loss_agg", f"{at} gives each response SimPO's length-normalised term, which "
                          f"only {AGGREGATION} aggregates as 1/|y| per sequence; got {agg!r}")
    if a.objective == "haepo":
        raise ConfigError("algorithm.objective", f"{at} needs an objective whose gradient at π_old is −A·∇log π per "
                          "token; haepo's trajectory ratio weighs the whole sequence's log-likelihood")

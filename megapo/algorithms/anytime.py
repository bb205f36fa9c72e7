"""AnytimeReasoner's dense budget rewards and Budget Relative Policy Optimization (stage anytime).

Qi, Liu, Pang, Du, Lee, Lin 2025, Optimizing Anytime Reasoning via Budget Relative Policy Optimization
(arXiv:2505.13438); the formulas below are transcribed from the authors' released code (AnytimeReasoner,
verl/trainer/ppo/brpo.py: compute_cot_advantage, compute_summary_advantage, compute_token_level_advantage).

Each response z (the "thinking") of a group is cut at every budget b_s of the prior's support b_0 < ... < b_{S-1}
(megapo/trainer/anytime.py, rank 0): the engine draws `summaries` short answers behind x ⊕ z[:b_s] ⊕ trigger (the
task's "stop thinking, answer" text), each scored by the task's reward. R_{g,s} is the mean score of thinking g's
summaries at budget s (the dense reward along the thinking). ASSUMPTION: a thinking that ended on its own
(end-of-sequence) within b_s already holds its answer, so R_{g,s} is its own verifier score and no summary is drawn
there (the authors append the answer delimiter to the complete thinking and draw a summary).

Thinking tokens (BRPO, the authors' variance_reduction "brpo"; p_s the prior's weights, normalised):

    ret_{g,s} = Σ_{j≥s} p_j R_{g,j}                                   the return from segment s on
    V2_s      = mean_{g'} ret_{g',s}                                  (0 when the group has one thinking)
    V1_{g,s}  = (Σ_{j<s} 2^j R_{g,j} / Σ_{j<s} 2^j) · Σ_{j≥s} p_j      (0 at s = 0; the authors' discounted mean)
    A_{g,s}   = ret_{g,s} − (s·V1_{g,s} + (S−s)·V2_s) / S

and token t of thinking g gets A_{g,s} for the first s with t < b_s (the segment between two budgets); a token past
the largest budget of the support gets 0 (no budget's reward depends on it).

Summary tokens (decoupled, the authors' summary method "brpo"): every summary's tokens get r − baseline, with the
baseline the mean R_{·,s} over the group's thinkings at the same budget when summaries = 1, else the mean score of
the same thinking's summaries after the same truncation.

Budgets: `prior` uniform | linear (p_s ∝ b_s) | base (all mass on the largest budget) over `budgets`, as the
authors' budget_probs. With `draws` = 0 every budget of the support is summarised each step, weighted by the prior
(the authors' code). ASSUMPTION (ours, `draws` = k > 0): each step draws k budgets i.i.d. from the prior, seeded by
(train.seed, step) so a resumed run draws the same; the step's support is the distinct draws, each weighted by its
share of the k draws (a Monte-Carlo estimate of the prior's expectation), and the formulas above run on it.

Evaluation (the paper's anytime accuracy, megapo/trainer/anytime_eval.py): at each eval step the greedy thinking of
each held-out example is cut at every budget of `eval_budgets` (default: `budgets`), the summary forced as above and
verified; eval/anytime_acc@<b> per budget and eval/anytime_auc, their mean (`megapo bench anytime` for any model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from megapo.algorithms.registry import register

STAGE = "anytime"
PRIORS = ("uniform", "linear", "base")
DISCOUNT = 2.0  # the authors' discount_factor: V1 weighs the reward at budget j by 2^j
DRAW_STREAM = 0xA7  # the budget draws' own random stream beside train.seed and the step


@dataclass
class AnytimeOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    budgets: list = field(default_factory=list)  # the prior's support, response tokens, increasing
    prior: str = "uniform"  # uniform | linear | base (the authors' budget_probs)
    draws: int = 0  # 0: every budget each step (the authors'); k: k seeded draws from the prior per step (ours)
    summaries: int = 1  # summaries drawn per (thinking, budget): the authors' n_summary
    summary_tokens: int = 16  # max new tokens of a summary (the authors': 118 behind an 8000-token thinking)
    trigger: str = ""  # the text after a truncated thinking that asks for the answer ("": the task's summary_trigger)
    # the held-out anytime accuracy's budgets (megapo/trainer/anytime_eval.py; []: `budgets`), response tokens
    eval_budgets: list = field(default_factory=list)

    def __post_init__(self):
        self.budgets = checked_budgets("budgets", self.budgets)
        self.eval_budgets = checked_budgets("eval_budgets", self.eval_budgets) if self.eval_budgets != [] else []
        if self.prior not in PRIORS:
            raise ValueError(f"prior: must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        for name, low in (("draws", 0), ("summaries", 1), ("summary_tokens", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {v!r}")
        if not isinstance(self.trigger, str):
            raise ValueError(f"trigger: must be a string, got {self.trigger!r}")

    def evaluated_budgets(self) -> list[int]:
        """The budgets of the held-out anytime accuracy: eval_budgets, else the prior's support."""
        return list(self.eval_budgets or self.budgets)


def checked_budgets(name: str, b) -> list[int]:
    """`b` as a list of ints when it is a non-empty, strictly increasing list of positive ints; else ValueError
    naming `name` (a budgets field: the stage's options, or a command's flag)."""
    if not isinstance(b, (list, tuple)) or not b or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
        raise ValueError(f"{name}: must be a non-empty list of positive ints (response tokens), got {b!r}")
    if list(b) != sorted(set(b)):
        raise ValueError(f"{name}: must be strictly increasing, got {b!r}")
    return [int(x) for x in b]


@dataclass(frozen=True)
class BudgetRewards:
    """What a group carries for stage anytime (megapo/trainer/anytime.py sets it on rank 0): the step's budgets and
    their weights, R[g][s] of each of the thinking group's samples, and, on a summary group, each summary's
    (thinking index g, budget slot s, truncation length) in `slots` (None: the group is the thinkings)."""

    budgets: list[int]
    weights: list[float]
    rewards: list[list[float]]
    slots: list[tuple[int, int, int]] | None = None


def prior_weights(budgets: list[int], prior: str) -> list[float]:
    """The prior's probability of each budget (the authors' TRAIN_BUDGET_PROBS)."""
    if prior == "uniform":
        return [1.0 / len(budgets)] * len(budgets)
    if prior == "linear":
        return [b / sum(budgets) for b in budgets]
    if prior == "base":
        return [0.0] * (len(budgets) - 1) + [1.0]
    raise ValueError(f"prior: must be one of {', '.join(PRIORS)}, got {prior!r}")


def step_budgets(o: AnytimeOptions, seed: int, step: int) -> tuple[list[int], list[float]]:
    """This step's support and weights: the whole prior (draws 0), or the distinct budgets of `draws` i.i.d. draws
    from it seeded by (seed, step), each weighted by its share of the draws."""
    probs = prior_weights(o.budgets, o.prior)
    if o.draws == 0:
        return list(o.budgets), probs
    rng = np.random.default_rng([int(seed), int(step), DRAW_STREAM])
    drawn = rng.choice(len(o.budgets), size=o.draws, replace=True, p=np.asarray(probs, dtype=np.float64))
    counts = np.bincount(drawn, minlength=len(o.budgets))
    return ([o.budgets[i] for i in range(len(o.budgets)) if counts[i]],
            [counts[i] / o.draws for i in range(len(o.budgets)) if counts[i]])


@register(
    STAGE, "advantage_stage", "token",
    "Qi, Liu, Pang, Du, Lee, Lin 2025, Optimizing Anytime Reasoning via Budget Relative Policy Optimization "
    "(arXiv:2505.13438)",
    AnytimeOptions,
)
def brpo_advantages(rewards: Tensor, weights: Tensor) -> Tensor:
    """BRPO on a group's [G, S] budget rewards R (thinking g cut at budget b_s, summarised and verified), p the
    prior's weights (normalised): ret_{g,s} = Σ_{j≥s} p_j R_{g,j}; V2_s = mean_g' ret_{g',s} (0 when G = 1);
    V1_{g,s} = (Σ_{j<s} 2^j R_{g,j} / Σ_{j<s} 2^j) · Σ_{j≥s} p_j (0 at s = 0); A_{g,s} = ret_{g,s} −
    (s·V1_{g,s} + (S−s)·V2_s)/S, on thinking g's tokens b_{s−1} ≤ t < b_s (0 past the largest budget). Summary
    tokens: r − mean R_{·,s} over the group (summaries = 1), else r − the mean of the same thinking's summaries at
    that truncation. Assumption: a thinking that ended within b_s is scored by its own reward there (no summary);
    with draws k > 0 the support is k seeded draws from the prior, each weighted by its share (ours)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    p = torch.as_tensor(weights, dtype=torch.float64)
    p = p / p.sum()
    G, S = r.shape
    ret = (r * p).flip(-1).cumsum(-1).flip(-1)  # ret[g, s] = Σ_{j≥s} p_j R_{g,j}
    v2 = ret.mean(0, keepdim=True).expand(G, S) if G > 1 else torch.zeros_like(ret)
    disc = DISCOUNT ** torch.arange(S, dtype=torch.float64)
    prev = (r * disc).cumsum(-1) / disc.cumsum(-1)  # prev[g, s] = discounted mean of R_{g, ≤s}
    tail = p.flip(0).cumsum(0).flip(0)  # Σ_{j≥s} p_j
    v1 = torch.zeros_like(ret)
    v1[:, 1:] = prev[:, :-1] * tail[1:]
    s = torch.arange(S, dtype=torch.float64)
    return ret - (s * v1 + (S - s) * v2) / S


def segment_of(t: int, budgets: list[int]) -> int | None:
    """The segment of response token t: the first s with t < b_s (None: past the largest budget)."""
    return next((s for s, b in enumerate(budgets) if t < b), None)


def thinking_token_advantages(length: int, budgets: list[int], segment_adv: Tensor) -> Tensor:
    """Token t of a thinking of `length` tokens gets segment_adv[s], s its segment; 0 past the largest budget."""
    out = torch.zeros(length, dtype=torch.float64)
    start = 0
    for s, b in enumerate(budgets):
        out[start:min(b, length)] = float(segment_adv[s])
        start = b
    return out


def summary_baselines(info: BudgetRewards, scores: list[float], n_summaries: int) -> list[float]:
    """Each summary's baseline (summary group `info`, `scores` its summaries' rewards): the mean R_{·,s} over the
    group's thinkings (one summary each), else the mean score of the summaries of the same thinking cut at the same
    length (the authors' grpo_id2mean; a lone one: 0)."""
    if info.slots is None:
        raise ValueError("slots: a summary group's BudgetRewards says which thinking and budget each summary is of")
    r = torch.as_tensor(info.rewards, dtype=torch.float64)
    if n_summaries == 1:
        return [float(r[:, s].mean()) for _, s, _ in info.slots]
    pools: dict[tuple[int, int], list[float]] = {}
    for (g, _, cut), score in zip(info.slots, scores):
        pools.setdefault((g, cut), []).append(float(score))
    return [math.fsum(pools[(g, cut)]) / len(pools[(g, cut)]) if len(pools[(g, cut)]) > 1 else 0.0
            for g, _, cut in info.slots]


def run_anytime_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `anytime`: per sample the per-token advantages megapo/trainer/anytime.py computed
    from the step's budget rewards (ctx.anytime), as float64 tensors; anytime/thinking_adv_abs and
    anytime/summary_adv_abs, the mean |A| over the thinkings' and the summaries' tokens."""
    if ctx.anytime is None or len(ctx.anytime) != len(batch):
        raise ValueError("anytime: stage anytime needs each sample's per-token advantages (update.advantage_stages)")
    for x, a in zip(batch, ctx.anytime):
        if len(a) != len(x.tokens) - x.prompt_len:
            raise ValueError(f"anytime: {len(a)} advantages for a response of {len(x.tokens) - x.prompt_len} tokens")
    return [torch.as_tensor(a, dtype=torch.float64) for a in ctx.anytime], {}

"""Length control at the token level, as token stages of algorithm.stages (megapo/algorithms/pipeline.py): DECS's
decoupled token reward and Bingo's significance-aware and dynamic length reward.

    algorithm:
      stages:
        - {name: decs, beta: 0.1}            # reward, correct, first_correct: replaces the estimator's advantage
        - {name: bingo, threshold: 0.9}      # reward, correct, old_logp, step: replaces the estimator's advantage
    data:
      group_filter: decs_curriculum          # DECS's curriculum batch scheduling (a group filter, below)
      group_filter_options: {kappa_lr: 0.2}

Both run on the whole train batch after the old-log-prob pass, group by group (a prompt's `group_size` samples are
contiguous), and put a per-token advantage into each sample in place of the estimator's (as otb's does).

DECS reads where each correct response first gives its answer (the input first_correct): the token count through
the first step whose prefix the task's answer checker (data.reward, the task's when auto) scores
>= data.correct_threshold, found with the same primitives as the post_answer length reward's
(megapo.algorithms.process_rewards: token_texts, step_ends, first_accepted_end; `first_correct_ends` here), which
megapo.trainer.update computes only when a stage reads it.

DECS's curriculum batch scheduling is the group filter `decs_curriculum` (data.group_filter, below): DAPO's dynamic
sampling with a share κ of easy (all-correct) prompts put back, κ following how much of the correct responses is
needed (the necessary reasoning prefix ratio): when that share rises, more easy prompts come in to press on
redundancy, when it falls fewer, so exploration on hard prompts is not suppressed. It keeps whole groups or drops
them, does the dynamic sampling itself (data.dynamic_sampling would drop the all-correct groups it adds: refused)
and reads a_i of the groups it kept (megapo/trainer/length_stage.py finds it with `first_correct_ends` below, only
for this filter and only on the correct responses of kept groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.length import GroupFilter, ScoredGroup, _check_state_keys, _is_int, _is_number
from megapo.algorithms.options import check_choice, check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.token_tensors import group_ranges

DECS_PAPER = ("Jiang et al. 2025, Overthinking Reduction with Decoupled Rewards and Curriculum Data Scheduling "
              "(arXiv:2509.25827), DECS's decoupled token-level reward (the necessary reasoning prefix found with "
              "the task's answer checker)")
DECS_CURRICULUM_PAPER = ("Jiang et al. 2025, Overthinking Reduction with Decoupled Rewards and Curriculum Data "
                         "Scheduling, DECS's curriculum batch scheduling (a share κ of all-correct prompts put back "
                         "into dynamic sampling, κ following the necessary reasoning prefix ratio)")
BINGO_PAPER = ("Liu et al. 2025, Bingo: Boosting Efficient Reasoning of LLMs via Dynamic and Significance-based "
               "Reinforcement Learning (arXiv:2506.08125), significance-aware and dynamic length rewards "
               "(significance from π_old)")


# ----------------------------------------------------------------------------- DECS


@dataclass
class DecsOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)
    beta: float = 0.1  # β, the length reward's scale (the authors' length_reward_beta default)
    step_delimiter: str = "\n"  # where a prefix is checked for the answer (post_answer's default)
    eps: float = 1e-6  # ε in the per-position standardisation (the authors')

    def __post_init__(self):
        check_number("beta", self.beta, low=0)
        if not (isinstance(self.step_delimiter, str) and self.step_delimiter):
            raise ValueError(f"step_delimiter: must be a non-empty string, got {self.step_delimiter!r}")
        check_number("eps", self.eps, above=0)


def first_correct_ends(responses: list[list[int]], answers: list, correct: list[bool], tokenizer, checker,
                       threshold: float, delimiter: str) -> list[int]:
    """Per response, the token count through the first step (cut at `delimiter`) whose prefix `checker`(text,
    answer) scores >= `threshold`; -1 for an incorrect response (not checked) and for one with no such step."""
    from megapo.algorithms.process_rewards import first_accepted_end, step_ends, token_texts

    cache: dict = {}
    out = []
    for ids, answer, ok in zip(responses, answers, correct):
        if not ok:
            out.append(-1)
            continue
        texts = token_texts(tokenizer, list(ids), cache)
        accept = lambda text, a=answer: float(checker(text, a)) >= threshold  # noqa: E731
        out.append(first_accepted_end(texts, step_ends(texts, delimiter), accept, delimiter))
    return out


def decs_token_rewards(reward: float, correct: bool, first: int, length: int, budget: int, beta: float) -> Tensor:
    """[L] r_t = R·(1 + β) on the necessary prefix t < a, R + β·(1 − L/L_max) on the redundant tokens t >= a of a
    correct response whose answer first appears at a (0 <= a < L); R·(1 + β) on every token otherwise."""
    r = torch.full((length,), reward * (1 + beta), dtype=torch.float64)
    if correct and 0 <= first < length:
        r[first:] = reward + beta * (1 - length / max(budget, length))  # a trajectory may run past the budget
    return r


@register("decs", "advantage_stage", "group", DECS_PAPER, DecsOptions)
def decs_advantages(rewards: list[float], correct: list[bool], first_correct: list[int], lengths: list[int],
                    group_size: int, budget: int, o: DecsOptions) -> list[Tensor]:
    """r_{i,t} = R_i·(1 + β) for t < a_i (the necessary prefix: through the first step at which the answer is already
    correct, the task's checker on each step's prefix), r_{i,t} = R_i + β·(1 − L_i/L_max) for a_i <= t < L_i (the
    redundant tokens) of a correct response i; r_{i,t} = R_i·(1 + β) on every token of an incorrect response or one
    whose answer appears only at its end. Beyond its end a response counts r_{i,t} = R_i·(1 + β) (the authors' padded
    rows). A_{i,t} = (r_{i,t} − mean_j r_{j,t}) / (std_j r_{j,t} + ε): a per-position baseline over the group's n
    responses, std unbiased; a group of one: A = r/(1 + ε). L_max = rollout.max_new_tokens (L_i where longer). The
    prefix tokens keep the outcome's advantage (R(1 + β) against the group), the redundant ones lose β·L_i/L_max
    more the longer the response: essential exploration is not penalised, post-answer redundancy is.
    Assumptions: the authors' redundant-chunk detector (a trained model judging each chunk) is replaced by the task's
    answer checker on each step's prefix (post_answer's a_i, step_delimiter); correctness is the verifier's verdict
    (the authors' score > 0); the "constant" length reward (their default script). The curriculum batch scheduling
    is the group filter decs_curriculum (module docstring)."""
    n = len(rewards)
    if not len(correct) == len(first_correct) == len(lengths) == n:
        raise ValueError("lengths: rewards, correct, first_correct and lengths must have one entry per sample")
    if budget < 1:
        raise ValueError(f"budget: L_max must be a token count >= 1, got {budget!r}")
    out: list[Tensor] = [torch.zeros(0)] * n
    for idx in group_ranges(n, group_size):
        width = max(lengths[i] for i in idx)
        rows = torch.stack([torch.cat([decs_token_rewards(rewards[i], correct[i], first_correct[i], lengths[i],
                                                          budget, o.beta),
                                       torch.full((width - lengths[i],), rewards[i] * (1 + o.beta),
                                                  dtype=torch.float64)]) for i in idx])
        if len(idx) == 1:
            adv = rows / (1 + o.eps)
        else:
            adv = (rows - rows.mean(0)) / (rows.std(0) + o.eps)
        for k, i in enumerate(idx):
            out[i] = adv[k, :lengths[i]].clone()
    return out


def run_decs_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `decs`: per sample its per-token advantages; decs/redundant_frac, the share of
    the correct responses' tokens after their first correct answer."""
    if ctx.first_correct is None or ctx.rewards is None or ctx.correct is None:
        raise ValueError("first_correct: stage decs needs each correct response's answer end, the rewards and the "
                         "verdicts (update.advantage_stages)")
    lengths = [len(x.tokens) - x.prompt_len for x in batch]
    values = decs_advantages([float(r) for r in ctx.rewards], [bool(c) for c in ctx.correct],
                             [int(a) for a in ctx.first_correct], lengths, ctx.group_size, ctx.max_new_tokens,
                             s.options)
    right = [(a, n) for a, n, c in zip(ctx.first_correct, lengths, ctx.correct) if c]
    total = sum(n for _, n in right)
    redundant = sum(n - a for a, n in right if 0 <= a < n)
    return values, {"decs/redundant_frac": redundant / total if total else 0.0}


# ----------------------------------------------------------------------------- DECS's curriculum batch scheduling


NRP_UNITS = ("steps", "tokens")


@dataclass
class DecsCurriculumOptions:
    option_field: ClassVar[bool] = True  # its refusals name data.group_filter_options.<option> (config)
    kappa_lr: float = 0.2  # lr in κ ← κ + lr·(p̄_t − p̄_{t−1}) (the authors' kappa_lr)
    kappa_init: float = 0.0  # κ_0 (the authors': 0, no easy prompt until p̄ has risen)
    initial_ratio: float = 0.5  # p̄_0 (the authors' last_mean_nrp_ratio at start); 0: the first step only sets p̄
    ratio: str = "steps"  # p̄'s unit: steps, (k_i + 1)/K_i (the authors' code); tokens, a_i/L_i
    step_delimiter: str = "\n"  # where a prefix is checked for the answer (stage decs's default; must match it)

    def __post_init__(self):
        check_number("kappa_lr", self.kappa_lr, above=0)
        check_number("kappa_init", self.kappa_init, low=0, below=1)
        check_number("initial_ratio", self.initial_ratio, low=0, high=1)
        check_choice("ratio", self.ratio, NRP_UNITS)
        if not (isinstance(self.step_delimiter, str) and self.step_delimiter):
            raise ValueError(f"step_delimiter: must be a non-empty string, got {self.step_delimiter!r}")


def is_mixed(g: ScoredGroup, eps: float = 1e-8) -> bool:
    """The group's verifier rewards differ (DAPO's dynamic sampling keeps it; the authors' std > 0)."""
    return g.size > 1 and float(g.rewards.max() - g.rewards.min()) > eps


def is_all_correct(g: ScoredGroup) -> bool:
    """Every response correct and the rewards equal (the authors' mean > 0 and std = 0)."""
    return bool(g.correct.all()) and not is_mixed(g)


def easy_quota(kappa: float, mixed: int) -> int | None:
    """⌊κ·K/(1 − κ)⌋ all-correct groups for K mixed ones: 0 when κ <= 0; None (all of them) when κ >= 1."""
    if kappa <= 0:
        return 0
    if kappa >= 1:
        return None
    return math.floor(kappa * mixed / (1 - kappa))


def nrp_ratios(g: ScoredGroup, unit: str) -> list[float]:
    """The necessary-prefix ratio of each correct response whose answer is found (first_correct a_i >= 1): unit
    steps, (k_i + 1)/K_i, the steps through the one that first answers over the response's K_i steps (step_lengths);
    tokens, a_i/L_i. Incorrect responses and correct ones without a found answer have none (the authors' 0, left
    out of the mean)."""
    if g.first_correct is None or (unit == "steps" and g.step_lengths is None):
        raise ValueError(f"first_correct: decs_curriculum reads each kept group's first_correct"
                         f"{' and step_lengths' if unit == 'steps' else ''} (the length stage's answer checker)")
    out = []
    for i in range(g.size):
        a = int(g.first_correct[i])
        if not bool(g.correct[i]) or a < 1:
            continue
        if unit == "tokens":
            out.append(a / max(int(g.lengths[i]), a))
        else:
            ends = torch.cumsum(g.step_lengths[i], 0)  # e_k + 1 of each step
            out.append(int((ends <= a).sum()) / len(ends))
    return out


@register("decs_curriculum", "group_filter", "group", DECS_CURRICULUM_PAPER, DecsCurriculumOptions)
class DecsCurriculum(GroupFilter):
    """Each sampling round keeps whole groups: every mixed group (verifier rewards differ), and while κ > 0,
    K ← K + #mixed, q = ⌊κ·K/(1 − κ)⌋ (K reset to 0 when q > 0), and min(q, #all-correct) all-correct groups drawn
    at random without replacement (random.Random seeded by train.seed, the step and the round); every other group
    (all wrong, the all-correct ones not drawn) is dropped. K counts the mixed groups kept since the last round whose
    quota q was positive, within the step (0 at each step's start). After the step, with p̄_t = the mean over the
    kept groups' correct responses of the necessary-prefix ratio ((k_i + 1)/K_i in steps, the authors' code, or
    a_i/L_i in tokens; responses with none left out): κ ← κ + lr·(p̄_t − p̄_{t−1}) when p̄_{t−1} ≠ 0, then
    p̄_{t−1} ← p̄_t (κ_0 = kappa_init = 0, p̄_0 = initial_ratio = 0.5, lr = kappa_lr = 0.2). A rising ratio (the
    policy's answers need more of their text) brings more easy prompts, on which the decoupled reward presses on
    redundancy; a falling one fewer. κ is not clipped (the authors' code).
    Assumptions: κ >= 1 (never reached in the authors' runs, where their quota divides by zero or goes negative)
    puts every all-correct group back; a step whose kept groups hold no correct response with a found answer leaves
    κ and p̄_{t−1} as they were (the authors' mean would be NaN); p̄ is over the groups this filter kept (the authors':
    the trained batch; megapo trims it to a multiple of parallel.dp afterwards); all-correct means every verdict
    correct with equal rewards; the authors' shuffle of the kept groups is left out (the update's order); the
    authors' chunks (cut at newline tokens and a list of words) are the steps cut at step_delimiter, and their
    chunk judge is the task's answer checker on each step's prefix (as stage decs's a_i). Not the authors': one
    sampling round per step (data.dynamic_sampling, which would drop the groups put back, is refused), so a step
    trains on the round's kept groups; the authors draw further rounds until data.train_batch_size prompts are kept
    (at most max_num_gen_batches) and cut the batch there."""

    drops_groups = True
    keeps_whole_groups = True  # answer_delimiter(): it observes its kept groups' first_correct

    def __init__(self, o: DecsCurriculumOptions, budget: int):
        super().__init__(o, budget)
        self.kappa = float(o.kappa_init)
        self.last_ratio = float(o.initial_ratio)  # p̄_{t−1}
        self.mixed_since = 0  # K
        self.step = 0  # the step the counts below belong to (0: none yet)
        self.round = 0  # rounds of that step so far
        self.ratio_sum, self.ratio_count = 0.0, 0  # that step's kept correct responses' ratios
        self.added = 0  # all-correct groups put back in that step

    def answer_delimiter(self) -> str:
        return self.o.step_delimiter

    def check_group_size(self, n: int) -> None:
        if n < 2:
            raise ValueError(f"rollout.n_samples: decs_curriculum keeps the groups whose rewards differ; needs "
                             f">= 2 samples per prompt, got {n}")

    def _begin(self, step: int) -> None:
        """A round of `step`: the first of a new step closes the previous one (κ's update) and resets the counts."""
        if step == self.step:
            return
        if step < self.step:
            raise ValueError(f"step: decs_curriculum is at step {self.step}, got a round of step {step}")
        if self.ratio_count:
            ratio = self.ratio_sum / self.ratio_count
            if self.last_ratio != 0:
                self.kappa += self.o.kappa_lr * (ratio - self.last_ratio)
            self.last_ratio = ratio
        self.step, self.round, self.mixed_since = step, 0, 0
        self.ratio_sum, self.ratio_count, self.added = 0.0, 0, 0

    def select(self, groups, step):
        import random

        self._begin(step)
        mixed = [i for i, g in enumerate(groups) if is_mixed(g)]
        easy = [i for i, g in enumerate(groups) if is_all_correct(g)]
        drawn: list[int] = []
        if self.kappa > 0:
            self.mixed_since += len(mixed)
            quota = easy_quota(self.kappa, self.mixed_since)
            if quota is None or quota > 0:
                self.mixed_since = 0
            take = len(easy) if quota is None else min(quota, len(easy))
            drawn = random.Random(f"decs_curriculum/{self.seed}/{step}/{self.round}").sample(easy, take)
        self.round += 1
        self.added += len(drawn)
        keep = set(mixed) | set(drawn)
        return [torch.arange(g.size, dtype=torch.int64) if i in keep else torch.zeros(0, dtype=torch.int64)
                for i, g in enumerate(groups)]

    def observe(self, kept, step):
        if step != self.step:
            raise ValueError(f"step: decs_curriculum selected for step {self.step}, observed step {step}")
        for g in kept:
            ratios = nrp_ratios(g, self.o.ratio)
            self.ratio_sum += sum(ratios)
            self.ratio_count += len(ratios)

    def metrics(self):
        return {"decs_kappa": self.kappa, "decs_easy_added": self.added,
                "decs_nrp_ratio": self.ratio_sum / self.ratio_count if self.ratio_count else self.last_ratio}

    KEYS = ("kappa", "last_ratio", "mixed_since", "step", "round", "ratio_sum", "ratio_count", "added")

    def state_dict(self):
        return {k: getattr(self, k) for k in self.KEYS}

    def load_state_dict(self, state):
        _check_state_keys(state, self.KEYS, "decs_curriculum")
        for k in ("kappa", "last_ratio", "ratio_sum"):
            if not _is_number(state[k]):
                raise ValueError(f"length state: decs_curriculum {k} must be a finite number, got {state[k]!r}")
        for k in ("mixed_since", "step", "round", "ratio_count", "added"):
            if not (_is_int(state[k]) and state[k] >= 0):
                raise ValueError(f"length state: decs_curriculum {k} must be an int >= 0, got {state[k]!r}")
        for k in self.KEYS:
            setattr(self, k, float(state[k]) if k in ("kappa", "last_ratio", "ratio_sum") else int(state[k]))


# ----------------------------------------------------------------------------- Bingo


@dataclass
class BingoOptions:
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)
    threshold: float = 0.9  # a token with π_old(y_t) > threshold is insignificant (Assumption, module docstring)
    lambda_c: float = 5.0  # λ_c, the correct responses' significance-aware length reward (the authors' script)
    lambda_w_n: float = 2.0  # λ_w_n, the incorrect responses' insignificant-token term
    lambda_w_e: float = 5.0  # λ_w_e, the incorrect responses' significant-token (dynamic) term
    decay_start: int = 50  # the trainer step after which λ_dyn decays (the authors' slope_start_epoch)
    decay_rate: float = 0.5  # λ_dyn's fall per step after decay_start (the authors' per-low-slope step)
    advantage: str = "grpo"  # the advantage estimator (algorithm.advantage's registry) on the shaped rewards

    def __post_init__(self):
        check_number("threshold", self.threshold, above=0, below=1)
        for name in ("lambda_c", "lambda_w_n", "lambda_w_e", "decay_rate"):
            check_number(name, getattr(self, name), low=0)
        check_number("decay_start", self.decay_start, low=0, integer=True)
        get("advantage", self.advantage, "advantage")  # ValueError "advantage: unknown advantage ..."


def significance_counts(old_logp: Tensor, threshold: float) -> tuple[int, int]:
    """(insignificant, significant) token counts of one response: insignificant where π_old(y_t) > threshold."""
    insignificant = int((old_logp.exp() > threshold).sum())
    return insignificant, len(old_logp) - insignificant


def dynamic_weight(step: int, o: BingoOptions) -> float:
    """λ_dyn(t) = λ_w_e/(π/2) through step decay_start, then max(−2·λ_w_e/(π/2), −decay_rate·(t − decay_start))."""
    start = o.lambda_w_e / (math.pi / 2)
    if step <= o.decay_start:
        return start
    return max(-2 * start, -o.decay_rate * (step - o.decay_start))


def bingo_reward(reward: float, correct: bool, ratio_insignificant: float, ratio_significant: float,
                 lam_dyn: float, o: BingoOptions) -> float:
    """R' = R + λ_c·cos(clip(ρ_ins, 0, π/2)) when correct; R + min(0, λ_w_n·(cos(clip(ρ_ins, 0, π/2)) − 1)
    + λ_dyn·ρ_sig − λ_w_e) when not."""
    cos = math.cos(min(max(ratio_insignificant, 0.0), math.pi / 2))
    if correct:
        return reward + o.lambda_c * cos
    return reward + min(0.0, o.lambda_w_n * (cos - 1) + lam_dyn * ratio_significant - o.lambda_w_e)


def _ratios(counts: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """(ρ_ins, ρ_sig) per response: its counts over the group's mean counts; (0, 0) for every response when either
    mean is 0 (the authors' rule for a reference without one kind of token)."""
    ref_ins = sum(c[0] for c in counts) / len(counts)
    ref_sig = sum(c[1] for c in counts) / len(counts)
    if ref_ins <= 0 or ref_sig <= 0:
        return [(0.0, 0.0)] * len(counts)
    return [(i / ref_ins, s / ref_sig) for i, s in counts]


@register("bingo", "advantage_stage", "group", BINGO_PAPER, BingoOptions)
def bingo_advantages(rewards: list[float], correct: list[bool], old_logp: list[Tensor], group_size: int, step: int,
                     o: BingoOptions) -> list[Tensor]:
    """N^ins_i = #{t: π_old(y_{i,t}) > threshold} (the insignificant tokens), N^sig_i = L_i − N^ins_i;
    ρ_ins = N^ins_i / mean_g N^ins, ρ_sig = N^sig_i / mean_g N^sig over the prompt's group (both 0 when a mean is 0).
    Significance-aware length reward, correct response: R'_i = R_i + λ_c·cos(clip(ρ_ins, 0, π/2)) (only the
    insignificant tokens are counted). Incorrect response: R'_i = R_i + min(0, λ_w_n·(cos(clip(ρ_ins, 0, π/2)) − 1)
    + λ_dyn(t)·ρ_sig − λ_w_e), the dynamic length reward: λ_dyn(t) = λ_w_e/(π/2) > 0 through step decay_start (more
    significant tokens, elaborate reasoning, on a question the response got wrong, lose less), then
    max(−2·λ_w_e/(π/2), −decay_rate·(t − decay_start)) (they cost). A_i = the `advantage` estimator on the group's
    R', on every token of response i.
    Assumptions: significance by the paper's external scorer (LLMLingua-2's keep probabilities, min-max normalised,
    insignificant below 0.5) is replaced by π_old: a token is insignificant when π_old(y_t) > threshold (predictable,
    low surprisal); the reference counts (the authors draw a reference-model response per prompt each step) are the
    group's mean counts; λ_dyn's decay (the authors adapt it to the slope of the training reward: the scaled slope
    while it is high, then −0.5 per step of low slope, floored at −2·λ_w_e/(π/2)) is a fixed schedule in trainer
    steps from decay_start on; the shaped rewards go through a group estimator (the authors': PPO with a critic)."""
    from megapo.algorithms.advantages import compute_advantages

    n = len(rewards)
    if not len(correct) == len(old_logp) == n:
        raise ValueError("old_logp: rewards, correct and old_logp must have one entry per sample")
    lam_dyn = dynamic_weight(step, o)
    shaped = torch.zeros(n, dtype=torch.float64)
    for idx in group_ranges(n, group_size):
        ratios = _ratios([significance_counts(old_logp[i], o.threshold) for i in idx])
        for i, (r_ins, r_sig) in zip(idx, ratios):
            shaped[i] = bingo_reward(rewards[i], correct[i], r_ins, r_sig, lam_dyn, o)
    lengths = torch.tensor([len(lp) for lp in old_logp]).view(-1, group_size)
    adv = compute_advantages(o.advantage, shaped.view(-1, group_size), lengths=lengths).reshape(-1)
    return [torch.full((len(lp),), float(a), dtype=torch.float64) for lp, a in zip(old_logp, adv)]


def run_bingo_stage(batch: list, s, ctx) -> tuple[list[Tensor], dict]:
    """pipeline.STAGES' runner for `bingo`: per sample its per-token advantages; bingo/lambda_dyn and
    bingo/insignificant_frac (the share of the batch's tokens with π_old(y_t) > threshold)."""
    if ctx.rewards is None or ctx.correct is None:
        raise ValueError("reward: stage bingo needs the rewards and the verdicts (update.advantage_stages)")
    logps = [torch.as_tensor(x.old_logp, dtype=torch.float64) for x in batch]
    values = bingo_advantages([float(r) for r in ctx.rewards], [bool(c) for c in ctx.correct], logps,
                              ctx.group_size, ctx.step, s.options)
    flat = torch.cat(logps) if logps else torch.zeros(0, dtype=torch.float64)
    return values, {"bingo/lambda_dyn": dynamic_weight(ctx.step, s.options),
            "bingo/insignificant_frac": float(flat.exp().gt(s.options.threshold).double().mean()) if flat.numel()
            else 0.0}

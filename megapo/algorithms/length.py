"""Length control: group-aware length rewards and group filters, applied after the verifier, before advantages.

A step's responses reach this stage as ScoredGroups (one per prompt: the verifier's rewards, correctness,
response lengths, truncation flags, the prompt's key and difficulty). Two kinds of method, each registered
by name with its paper and formula (`megapo objectives --kind length_reward --formulas`):

    data.length_reward   LengthReward.shape(groups, step) -> the shaped reward of every response
    data.group_filter    GroupFilter.select(groups, step) -> the responses of each group kept for training

The methods that read each response's steps (step_pruner, post_answer, grsp) are in megapo/algorithms/step_length.py.
A method that carries state across steps (a target per difficulty bucket, a dual variable, a per-prompt
history) keeps it in `state_dict()` (JSON); the trainer saves it in the checkpoint and restores it on
--resume, so a resumed run shapes as the unstopped one. `budget` is rollout.max_new_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import Tensor

from megapo.algorithms.options import check_choice, check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.stages import _annealed


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt's responses as the verifier scored them (all tensors [G], G the group's size)."""
    prompt_key: str  # stable across steps and resumes (stages.prompt_key of the prompt text)
    difficulty: int | None  # the task's difficulty of the prompt (addition_cot: digits), None when it has none
    rewards: Tensor  # float64: the reward function's scores (a truncated response's is data.truncated_reward)
    correct: Tensor  # bool: the verifier's verdict, reward >= data.correct_threshold, whatever the shaping
    lengths: Tensor  # int64: response tokens, end-of-sequence included
    truncated: Tensor  # bool: cut at rollout.max_new_tokens
    # per response, int64 [K_i]: the tokens of each step, cut where the decoded text completes the method's
    # step_delimiter (process_rewards.step_ends); None unless the method reads steps (LengthMethod.step_delimiter)
    step_lengths: tuple | None = None
    # int64 [G]: tokens through the first step whose prefix the task's answer checker accepts (reward >=
    # data.correct_threshold), -1 when none; None unless the method reads it (LengthMethod.needs_first_correct)
    first_correct: Tensor | None = None
    # int64 [G]: tokens through the first appearance of a group filter's answer marker (duet's abort rule), -1 when
    # none; None unless the filter names one (GroupFilter.marker)
    marker_end: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.rewards.numel())


class LengthMethod:
    """What every length method shares: its options, the generation budget and the state kept across steps."""

    def __init__(self, options, budget: int):
        self.o = options
        self.budget = budget

    needs_first_correct = False  # reads ScoredGroup.first_correct (the answer checker on each step's prefix)
    seed = 0  # train.seed, set by the trainer's length stage: a method's random draws are seeded by it and the step

    def step_delimiter(self) -> str | None:
        """The delimiter its responses are split into steps at (ScoredGroup.step_lengths); None: it reads none."""
        return None

    def check_group_size(self, n: int) -> None:
        """Config time: refuse a group size `n` (rollout.n_samples) the method cannot work with."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"length state: {type(self).__name__} keeps no state, got keys {sorted(state)}")


class LengthReward(LengthMethod):
    """data.length_reward: shape(groups, step) returns one float64 tensor of rewards per group."""

    def shape(self, groups: list[ScoredGroup], step: int) -> list[Tensor]:
        raise NotImplementedError


class GroupFilter(LengthMethod):
    """data.group_filter: select(groups, step) returns, per group, the sorted int64 indices of the responses
    kept for training (the others leave the batch; advantages are computed over the kept ones). A filter with
    `drops_groups` may return an empty tensor: the whole group leaves the batch; one with `keeps_whole_groups`
    keeps all of a group or none (groups keep rollout.n_samples each). A filter whose `answer_delimiter()` is not
    None is handed, after each select, the groups it kept with ScoredGroup.first_correct and step_lengths (cut at
    that delimiter) in `observe(kept, step)`."""

    drops_groups = False
    keeps_whole_groups = False

    def select(self, groups: list[ScoredGroup], step: int) -> list[Tensor]:
        raise NotImplementedError

    def answer_delimiter(self) -> str | None:
        """The step delimiter the groups handed to observe() are cut at; None: observe() gets nothing."""
        return None

    def observe(self, kept: list[ScoredGroup], step: int) -> None:
        """The groups select() kept this round, with first_correct and step_lengths (answer_delimiter)."""


# ----------------------------------------------------------------------------- per-response penalties


@dataclass
class OverlongOptions:
    max_len: int = 0  # L_max, the generation budget (0: rollout.max_new_tokens)
    cache_len: int = 0  # L_cache, width of the soft interval (required)
    factor: float = 1.0  # penalty at L_max

    def __post_init__(self):
        if not (isinstance(self.max_len, int) and self.max_len >= 0):
            raise ValueError(f"max_len: must be an int >= 0 (0: the generation budget), got {self.max_len!r}")
        if not (isinstance(self.cache_len, int) and self.cache_len > 0
                and (self.max_len == 0 or self.cache_len <= self.max_len)):
            raise ValueError(f"cache_len: must be an int in (0, max_len], got {self.cache_len!r}")


@dataclass
class LinearOptions:
    coef: float = 0.0  # penalty per token (or per max_len when given)
    max_len: int | None = None

    def __post_init__(self):
        if self.max_len is not None and not (isinstance(self.max_len, int) and self.max_len > 0):
            raise ValueError(f"max_len: must be a positive int, got {self.max_len!r}")


def overlong_penalty(rewards: Tensor, lengths: Tensor, o: OverlongOptions, budget: int = 0) -> Tensor:
    """R' = R + p(L): p = 0 for L <= L_max - L_cache; p = ((L_max - L_cache) - L)/L_cache·factor
    for L_max - L_cache < L <= L_max (linear from 0 to -factor); p = -factor for L > L_max.
    L_max = max_len, or the generation budget when max_len is 0."""
    max_len = o.max_len or budget
    if max_len <= 0:
        raise ValueError("max_len: 0 means the generation budget, and none was given")
    if o.cache_len > max_len:
        raise ValueError(f"cache_len: {o.cache_len} exceeds max_len {max_len}")
    free = max_len - o.cache_len
    lengths = lengths.to(rewards.dtype)
    return rewards + ((free - lengths) / o.cache_len).clamp(min=-1.0, max=0.0) * o.factor


def linear_penalty(rewards: Tensor, lengths: Tensor, o: LinearOptions, budget: int = 0) -> Tensor:
    """R' = R - coef·L  (or R - coef·L/max_len when max_len is given)."""
    lengths = lengths.to(rewards.dtype)
    return rewards - o.coef * (lengths / o.max_len if o.max_len is not None else lengths)


class PerResponse(LengthReward):
    """A penalty of each response's own (reward, length), no group context and no state."""
    penalty = None  # the function of (rewards, lengths, options, budget)

    def shape(self, groups: list[ScoredGroup], step: int) -> list[Tensor]:
        return [type(self).penalty(g.rewards, g.lengths, self.o, self.budget) for g in groups]


@register("dapo_overlong", "length_reward", "sequence",
          "Yu et al. 2025, DAPO (arXiv:2503.14476), soft overlong punishment", OverlongOptions)
class DapoOverlong(PerResponse):
    __doc__ = overlong_penalty.__doc__
    penalty = staticmethod(overlong_penalty)


@register("length_penalty", "length_reward", "sequence", "plain linear length penalty", LinearOptions)
class LinearLength(PerResponse):
    __doc__ = linear_penalty.__doc__
    penalty = staticmethod(linear_penalty)


def shape_rewards(name: str, rewards: Tensor, lengths: Tensor, budget: int = 0, **options) -> Tensor:
    """A per-response length reward `name` (dapo_overlong | length_penalty) of rewards given each response's
    length (same shape), outside the trainer."""
    entry = get("length_reward", name)
    if not issubclass(entry.fn, PerResponse):
        raise ValueError(f"name: {name!r} needs its group (use build_length_reward and ScoredGroups)")
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise ValueError("rewards: expected a floating torch.Tensor")
    if not isinstance(lengths, Tensor) or lengths.shape != rewards.shape:
        raise ValueError(f"lengths: expected a tensor of rewards' shape {tuple(rewards.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError("lengths: must be >= 0")
    return entry.fn.penalty(rewards, lengths, entry.make_options(options), budget)


# ----------------------------------------------------------------------------- option checks, difficulty


def _or_budget(name: str, value: int, budget: int) -> int:
    """An option where 0 means the generation budget (rollout.max_new_tokens)."""
    if value:
        return value
    if not (isinstance(budget, int) and budget > 0):
        raise ValueError(f"{name}: 0 means the generation budget, and none was given (budget={budget!r})")
    return budget


DIFFICULTIES = ("pass_rate", "task")


@dataclass
class DifficultyOptions:
    """How a difficulty-adaptive method rates a prompt (default: the model's own pass rate, as the papers do)."""
    difficulty: str = "pass_rate"  # pass_rate: the group's correct fraction; task: ScoredGroup.difficulty
    task_range: list | None = None  # with difficulty: task, [easiest, hardest] task label (addition_cot: [2, 6])

    def __post_init__(self):
        check_choice("difficulty", self.difficulty, DIFFICULTIES)
        if self.difficulty == "pass_rate":
            if self.task_range is not None:
                raise ValueError(f"task_range: only with difficulty: task, got {self.task_range!r}")
            return
        r = self.task_range
        if not (isinstance(r, (list, tuple)) and len(r) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in r) and r[0] < r[1]):
            raise ValueError(f"task_range: difficulty: task needs [easiest, hardest] task labels (ints, "
                             f"easiest < hardest), got {r!r}")


def pass_rate(g: ScoredGroup) -> float:
    """The group's correct fraction p̂."""
    return float(g.correct.to(torch.float64).mean())


def hardness(g: ScoredGroup, o: DifficultyOptions) -> Fraction:
    """The prompt's hardness h in [0, 1], exact: 1 − p̂ (pass_rate), or under difficulty: task its label's
    place in task_range, (d − easiest)/(hardest − easiest) clipped to [0, 1]. Its ease is 1 − h."""
    if o.difficulty == "pass_rate":
        return Fraction(int((~g.correct).sum()), g.size)
    if g.difficulty is None:
        raise ValueError(f"difficulty: task, but prompt {g.prompt_key} has no task difficulty")
    lo, hi = o.task_range
    return Fraction(min(max(g.difficulty, lo), hi) - lo, hi - lo)


def difficulty_bucket(h: Fraction, n: int) -> int:
    """Bucket 0 (easiest) .. n−1 (hardest) of n equal-width bins of hardness: min(n−1, ⌊h·n⌋)."""
    return min(n - 1, math.floor(h * n))


# ----------------------------------------------------------------------------- group-aware length rewards


@dataclass
class AlpOptions:
    beta: float = 0.05  # β, the cost of a full-budget response at solve rate 1
    norm: int = 0  # N (0: the generation budget)

    def __post_init__(self):
        check_number("beta", self.beta, low=0)
        check_number("norm", self.norm, low=0, integer=True)


@register("alp", "length_reward", "group",
          "Xiang et al. 2025, Just Enough Thinking: Efficient Reasoning with Adaptive Length Penalties "
          "Reinforcement Learning (arXiv:2506.05256), ALP", AlpOptions)
class Alp(LengthReward):
    """r_i = 1[correct_i] − (β/N)·max(p̂, 1/G)·L_i: p̂ the group's correct fraction (its online solve rate over
    its G rollouts), N = norm or the generation budget. Easy prompts pay per token, prompts nobody solves
    pay the floor 1/G. [A] the reward is replaced by the verifier's 0/1 verdict, as in the paper's
    correctness reward."""

    def __init__(self, o: AlpOptions, budget: int):
        super().__init__(o, budget)
        self.norm = _or_budget("norm", o.norm, budget)

    def shape(self, groups, step):
        return [g.correct.to(torch.float64)
                - self.o.beta / self.norm * max(pass_rate(g), 1.0 / g.size) * g.lengths.to(torch.float64)
                for g in groups]


@dataclass
class LaserOptions:
    target_len: int = 0  # L_T (required)
    alpha: float = 0.5  # α, the bonus of a correct response within L_T

    def __post_init__(self):
        check_number("target_len", self.target_len, above=0, integer=True)
        check_number("alpha", self.alpha, low=0)


def _step_bonus(g: ScoredGroup, target: float, alpha: float) -> Tensor:
    """R + α·1[correct]·1[L <= L_T]."""
    return g.rewards + alpha * (g.correct & (g.lengths <= target)).to(torch.float64)


@register("laser", "length_reward", "sequence",
          "Liu et al. 2025, Learn to Reason Efficiently with Adaptive Length-based Reward Shaping, "
          "LASER (Length-bAsed StEp Reward shaping)", LaserOptions)
class Laser(LengthReward):
    """R' = R + α·1[correct]·1[L <= L_T]: a step bonus for a correct response within the target length L_T."""

    def shape(self, groups, step):
        return [_step_bonus(g, self.o.target_len, self.o.alpha) for g in groups]


@dataclass
class LaserDOptions(DifficultyOptions):
    alpha: float = 0.5  # α, the bonus of a correct response within its bucket's L_T
    buckets: int = 3  # difficulty buckets (easy .. hard)
    update_every: int = 10  # N: targets re-set at steps N, 2N, ...
    coverage: float = 0.9  # c: a target covers this fraction of its bucket's recent correct lengths
    window: int = 256  # recent correct lengths kept per bucket
    init_len: int = 0  # every bucket's L_T before its first re-set (0: the generation budget)

    def __post_init__(self):
        super().__post_init__()
        check_number("alpha", self.alpha, low=0)
        check_number("buckets", self.buckets, above=0, integer=True)
        check_number("update_every", self.update_every, above=0, integer=True)
        check_number("coverage", self.coverage, above=0, high=1)
        check_number("window", self.window, above=0, integer=True)
        check_number("init_len", self.init_len, low=0, integer=True)


def _coverage_length(lengths: list[int], coverage: float) -> int:
    """The smallest length L with #{l <= L} >= c·n (exact in c's binary value)."""
    ranked = sorted(lengths)
    return ranked[math.ceil(Fraction(coverage) * len(ranked)) - 1]


@register("laser_d", "length_reward", "group",
          "Liu et al. 2025, Learn to Reason Efficiently with Adaptive Length-based Reward Shaping, "
          "LASER-D (Dynamic and Difficulty-aware LASER)", LaserDOptions)
class LaserD(LengthReward):
    """R' = R + α·1[correct]·1[L <= L_T(b)], b the prompt's difficulty bucket: hardness h = 1 − p̂ (difficulty:
    pass_rate, the default; or the task label, difficulty: task) in `buckets` equal bins, b = min(n−1, ⌊h·n⌋), 0 the
    easiest. Each bucket keeps its last `window` correct response lengths; at the first call of step t with t −
    t_last >= N (t_last the step of the last re-set, 0 at the start) every bucket with lengths is re-set to the
    smallest L covering a fraction c of them, before shaping; the call's correct lengths join the windows after
    shaping. Until its first re-set a bucket's L_T is init_len. [A] difficulty from the training groups' own pass
    rate (the paper uses a monitoring set); state: targets, windows, t_last."""

    def __init__(self, o: LaserDOptions, budget: int):
        super().__init__(o, budget)
        self.init_len = _or_budget("init_len", o.init_len, budget)
        self.targets: dict[str, int] = {}
        self.windows: dict[str, list[int]] = {}
        self.last_update = 0

    def shape(self, groups, step):
        if step - self.last_update >= self.o.update_every:
            self.targets.update({b: _coverage_length(w, self.o.coverage) for b, w in self.windows.items() if w})
            self.last_update = step
        keys = [str(difficulty_bucket(hardness(g, self.o), self.o.buckets)) for g in groups]
        shaped = [_step_bonus(g, self.targets.get(b, self.init_len), self.o.alpha) for g, b in zip(groups, keys)]
        for g, b in zip(groups, keys):
            window = self.windows.setdefault(b, [])
            window.extend(g.lengths[g.correct].tolist())
            del window[:-self.o.window]
        return shaped

    def state_dict(self):
        return {"targets": dict(self.targets), "windows": {b: list(w) for b, w in self.windows.items()},
                "last_update": self.last_update}

    def metrics(self) -> dict[str, float]:
        return {f"target_b{b}": t for b, t in sorted(self.targets.items())}

    def load_state_dict(self, state):
        _check_state_keys(state, ("targets", "windows", "last_update"), "laser_d")
        targets, windows = state["targets"], state["windows"]
        if not (isinstance(targets, dict) and all(_is_int(v) and v > 0 for v in targets.values())):
            raise ValueError(f"length state: laser_d targets must map buckets to positive ints, got {targets!r}")
        if not (isinstance(windows, dict) and all(isinstance(w, list) and all(_is_int(x) for x in w)
                                                  for w in windows.values())):
            raise ValueError(f"length state: laser_d windows must map buckets to lists of ints, got {windows!r}")
        if not _is_int(state["last_update"]):
            raise ValueError(f"length state: laser_d last_update must be an int, got {state['last_update']!r}")
        self.targets = {str(b): int(v) for b, v in targets.items()}
        self.windows = {str(b): [int(x) for x in w] for b, w in windows.items()}
        self.last_update = int(state["last_update"])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_state_keys(state: dict, keys: tuple[str, ...], name: str) -> None:
    if not isinstance(state, dict) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, dict) else state
        raise ValueError(f"length state: {name} expects keys {sorted(keys)}, got {got!r}")


@dataclass
class KimiOptions:
    weight: float = 1.0  # w, the length reward's scale

    def __post_init__(self):
        check_number("weight", self.weight, low=0)


@register("kimi", "length_reward", "group",
          "Kimi k1.5 length reward, in the unified view of length rewards of Liu et al. 2025, Learn to Reason "
          "Efficiently with Adaptive Length-based Reward Shaping", KimiOptions)
class Kimi(LengthReward):
    """λ_i = 0.5 − (L_i − L_min)/(L_max − L_min) over the group (λ_i = 0 when all lengths are equal);
    R' = R + w·λ_i for a correct response, R + w·min(0, λ_i) for an incorrect one."""

    def shape(self, groups, step):
        out = []
        for g in groups:
            lengths = g.lengths.to(torch.float64)
            spread = float(lengths.max() - lengths.min())
            lam = 0.5 - (lengths - lengths.min()) / spread if spread > 0 else torch.zeros_like(lengths)
            out.append(g.rewards + self.o.weight * torch.where(g.correct, lam, lam.clamp(max=0.0)))
        return out


@dataclass
class LaconicOptions:
    target: int = 0  # B, the token budget (0: the generation budget)
    dual_lr: float = 0.1  # η, the dual ascent step
    lambda_init: float = 0.0  # λ at the start

    def __post_init__(self):
        check_number("target", self.target, low=0, integer=True)
        check_number("dual_lr", self.dual_lr, low=0)
        check_number("lambda_init", self.lambda_init, low=0)


@register("laconic", "length_reward", "batch",
          "LACONIC: Length-Aware Constrained Reinforcement Learning for LLM (arXiv:2602.14468), "
          "target token budget by an adaptive cost", LaconicOptions)
class Laconic(LengthReward):
    """R' = R − λ·max(0, L − B)/B, then (dual ascent, once per call, over all its responses)
    λ ← max(0, λ + η·(mean L − B)/B). B = target or the generation budget. [A] the cost c(L) = max(0, L − B)/B
    and the projected dual step; state: λ."""

    def __init__(self, o: LaconicOptions, budget: int):
        super().__init__(o, budget)
        self.target = _or_budget("target", o.target, budget)
        self.lam = float(o.lambda_init)

    def shape(self, groups, step):
        if not groups:
            return []
        b = self.target
        shaped = [g.rewards - self.lam * (g.lengths.to(torch.float64) - b).clamp(min=0.0) / b for g in groups]
        lengths = torch.cat([g.lengths for g in groups]).to(torch.float64)
        if lengths.numel():
            self.lam = max(0.0, self.lam + self.o.dual_lr * (float(lengths.mean()) - b) / b)
        return shaped

    def state_dict(self):
        return {"lambda": self.lam}

    def metrics(self) -> dict[str, float]:
        return {"lambda": self.lam}

    def load_state_dict(self, state):
        _check_state_keys(state, ("lambda",), "laconic")
        if not (_is_number(state["lambda"]) and state["lambda"] >= 0):
            raise ValueError(f"length state: laconic lambda must be a finite number >= 0, got {state['lambda']!r}")
        self.lam = float(state["lambda"])


@dataclass
class AdlpOptions:
    lambda_init: float = 1e-3  # λ_1, the penalty per response token at the first step (the paper's script: 1e-3)
    lr: float = 1e-3  # η, the step of λ per unit of accuracy gap (the paper's script: 1e-3)
    acc_ref: float | None = None  # the reference accuracy in [0, 1]; None: the first step's accuracy

    def __post_init__(self):
        check_number("lambda_init", self.lambda_init, low=0)
        check_number("lr", self.lr, low=0)
        if self.acc_ref is not None:
            check_number("acc_ref", self.acc_ref, low=0, high=1)


@register("adlp", "length_reward", "batch",
          "Su, Cardie 2025, Thinking Fast and Right: Balancing Accuracy and Reasoning Length with Adaptive Rewards "
          "(arXiv:2505.18298), A-DLP (adaptive direct length penalty)", AdlpOptions)
class Adlp(LengthReward):
    """R' = R − λ_t·L for every response of trainer step t (L its tokens, end-of-sequence included; R the verifier's
    reward, correct or not), all of the step's sampling rounds with the same λ_t; after step t
    λ_{t+1} = max(0, λ_t + η·(acc_t − acc_ref)), acc_t the fraction of the step's responses the verifier calls
    correct (every round, before any group filter): accuracy above the reference raises the penalty, below it
    relaxes it. λ_1 = lambda_init, η = lr.
    Assumption: acc_ref unset is the first step's accuracy (the paper's is the initial model's training accuracy,
    0.62 in its script: set acc_ref to pin it). Assumption: the update is folded in when the next step's first
    round is shaped (so a step's rounds share λ_t); state: λ, acc_ref and the pending step's counts."""

    def __init__(self, o: AdlpOptions, budget: int):
        super().__init__(o, budget)
        self.lam = float(o.lambda_init)
        self.acc_ref = None if o.acc_ref is None else float(o.acc_ref)
        self.step = 0  # the step whose responses `correct` / `total` count (its update still pending)
        self.correct = 0
        self.total = 0

    def _close_step(self) -> None:
        if self.total:
            acc = self.correct / self.total
            if self.acc_ref is None:
                self.acc_ref = acc
            self.lam = max(0.0, self.lam + self.o.lr * (acc - self.acc_ref))
        self.correct = self.total = 0

    def shape(self, groups, step):
        if step != self.step:
            self._close_step()
            self.step = int(step)
        out = [g.rewards - self.lam * g.lengths.to(torch.float64) for g in groups]
        for g in groups:
            self.correct += int(g.correct.sum())
            self.total += g.size
        return out

    def metrics(self) -> dict[str, float]:
        return {"lambda": self.lam, **({"acc_ref": self.acc_ref} if self.acc_ref is not None else {})}

    def state_dict(self):
        return {"lambda": self.lam, "acc_ref": self.acc_ref, "step": self.step, "correct": self.correct,
                "total": self.total}

    def load_state_dict(self, state):
        _check_state_keys(state, ("lambda", "acc_ref", "step", "correct", "total"), "adlp")
        if not (_is_number(state["lambda"]) and state["lambda"] >= 0):
            raise ValueError(f"length state: adlp lambda must be a finite number >= 0, got {state['lambda']!r}")
        ref = state["acc_ref"]
        if ref is not None and not (_is_number(ref) and 0 <= ref <= 1):
            raise ValueError(f"length state: adlp acc_ref must be None or in [0, 1], got {ref!r}")
        counts = [state[k] for k in ("step", "correct", "total")]
        if not (all(_is_int(v) and v >= 0 for v in counts) and counts[1] <= counts[2]):
            raise ValueError(f"length state: adlp step, correct, total must be ints >= 0 with correct <= total, "
                             f"got {counts!r}")
        self.lam = float(state["lambda"])
        self.acc_ref = None if ref is None else float(ref)
        self.step, self.correct, self.total = (int(v) for v in counts)


GRPO_LAMBDA_INNER = ("kimi", "length_penalty", "laser")


@dataclass
class GrpoLambdaOptions:
    inner: str = "kimi"  # the length reward used in groups that solve often enough
    inner_options: dict = field(default_factory=dict)  # its options
    min_correct_ratio: float = 0.5  # τ

    def __post_init__(self):
        check_choice("inner", self.inner, GRPO_LAMBDA_INNER)
        if not isinstance(self.inner_options, dict):
            raise ValueError(f"inner_options: must be a mapping of {self.inner}'s options, got {self.inner_options!r}")
        try:
            get("length_reward", self.inner).make_options(dict(self.inner_options))
        except (TypeError, ValueError) as e:
            raise ValueError(f"inner_options: {e}") from None
        check_number("min_correct_ratio", self.min_correct_ratio, low=0, high=1)


@register("grpo_lambda", "length_reward", "group", "Dai, Liu, Si 2025, Stable Reinforcement Learning for Efficient "
          "Reasoning (arXiv:2505.18086), GRPO-λ", GrpoLambdaOptions)
class GrpoLambda(LengthReward):
    """Per group: R' = the inner length reward (kimi | length_penalty | laser, with inner_options) when the
    group's correct fraction p̂ >= τ, the plain reward R otherwise (the abstract: length-agnostic rewards
    while a prompt is rarely solved). Its companion stage clamp_correct (algorithm.stages) keeps correct
    responses' advantages >= 0."""

    def __init__(self, o: GrpoLambdaOptions, budget: int):
        super().__init__(o, budget)
        self.inner = build_length_reward(o.inner, o.inner_options, budget)

    def shape(self, groups, step):
        chosen = [i for i, g in enumerate(groups) if pass_rate(g) >= self.o.min_correct_ratio]
        shaped = [g.rewards.clone() for g in groups]
        for i, r in zip(chosen, self.inner.shape([groups[i] for i in chosen], step) if chosen else []):
            shaped[i] = r
        return shaped


@register(
    "clamp_correct", "advantage_stage", "sequence",
    "the correct-response clamp used with GRPO-λ's length rewards (Dai, Liu, Si 2025, Stable Reinforcement Learning "
    "for Efficient Reasoning, arXiv:2505.18086)",
)
def clamp_correct_advantages(adv: Tensor, correct: Tensor) -> Tensor:
    """A_i ← max(A_i, 0) for correct responses (under group-mean normalisation a length reward
    turns long correct answers' advantages negative once the pass rate exceeds 2/3); others unchanged."""
    if not isinstance(adv, Tensor) or not adv.is_floating_point():
        raise ValueError("adv: expected a floating torch.Tensor")
    if not isinstance(correct, Tensor) or correct.dtype != torch.bool or correct.shape != adv.shape:
        raise ValueError(f"correct: expected a bool tensor of adv's shape {tuple(adv.shape)}")
    return torch.where(correct, adv.clamp(min=0.0), adv)


@dataclass
class HapoOptions:
    weight: float = 1.0  # w, the length reward's scale

    def __post_init__(self):
        check_number("weight", self.weight, low=0)


@register("hapo", "length_reward", "group", "Huang et al. 2025, HAPO: Training Language Models to Reason "
          "Concisely via History-Aware Policy Optimization", HapoOptions)
class Hapo(LengthReward):
    """h_p = the shortest correct response prompt p has had at earlier calls (none at first);
    f(L) = cos(min(π/2·L/h_p, π)) (1 at L = 0, 0 at L = h_p, −1 from 2·h_p on); R' = R + w·f(L) for a correct
    response, R + w·min(f(L), 0) for an incorrect one (shorter incorrect ones are not penalised, so the search
    for shorter solutions is not punished), R while p has no history. After shaping a group, h_p ← min(h_p,
    its shortest correct length). [A] the cosine form and the incorrect branch's min(f, 0); state: h per
    prompt key."""

    def __init__(self, o: HapoOptions, budget: int):
        super().__init__(o, budget)
        self.history: dict[str, int] = {}

    def shape(self, groups, step):
        out = []
        for g in groups:
            h = self.history.get(g.prompt_key)
            if h is None:
                out.append(g.rewards.clone())
            else:
                f = torch.cos((math.pi / 2 * g.lengths.to(torch.float64) / h).clamp(max=math.pi))
                out.append(g.rewards + self.o.weight * torch.where(g.correct, f, f.clamp(max=0.0)))
            if bool(g.correct.any()):
                shortest = max(int(g.lengths[g.correct].min()), 1)
                self.history[g.prompt_key] = shortest if h is None else min(h, shortest)
        return out

    def state_dict(self):
        return {"history": dict(self.history)}

    def load_state_dict(self, state):
        _check_state_keys(state, ("history",), "hapo")
        history = state["history"]
        if not (isinstance(history, dict) and all(_is_int(v) and v > 0 for v in history.values())):
            raise ValueError(f"length state: hapo history must map prompt keys to positive ints, got {history!r}")
        self.history = {str(k): int(v) for k, v in history.items()}


@dataclass
class CurriculumOptions:
    start: int = 0  # the budget at step 1 (0: the generation budget)
    end: int = 0  # the budget from step 1 + steps on (required)
    steps: int = 0  # anneal length in trainer steps (required)
    over_reward: float = 0.0  # the reward of a response over the current budget

    def __post_init__(self):
        check_number("start", self.start, low=0, integer=True)
        check_number("end", self.end, above=0, integer=True)
        check_number("steps", self.steps, above=0, integer=True)
        check_number("over_reward", self.over_reward)


@register("curriculum", "length_reward", "sequence", "Hammoud et al. 2025, Train Long, Think Short: Curriculum "
          "Learning for Efficient Reasoning, a token budget tightened over training", CurriculumOptions)
class Curriculum(LengthReward):
    """B_t = start + (end − start)·min(1, (t − 1)/steps) at trainer step t (1-based; start = the generation
    budget when 0); R' = over_reward when L > B_t or the response was truncated (it is treated as cut at
    B_t), R otherwise. [A] the linear decay and the truncation form of the length term."""

    def __init__(self, o: CurriculumOptions, budget: int):
        super().__init__(o, budget)
        self.start = _or_budget("start", o.start, budget)

    def shape(self, groups, step):
        limit = _annealed(float(self.start), float(self.o.end), self.o.steps, step)
        return [_truncate(g, limit, self.o.over_reward) for g in groups]


def _truncate(g: ScoredGroup, limit: float, reward: float) -> Tensor:
    """R' = reward where L > limit or the response was truncated, R elsewhere."""
    cut = (g.lengths.to(torch.float64) > limit) | g.truncated
    return torch.where(cut, torch.full_like(g.rewards, reward), g.rewards)


@dataclass
class DlerOptions(DifficultyOptions):
    truncate_at: int = 0  # L_T (0: the generation budget)
    truncated_reward: float = 0.0  # the reward of a response longer than its budget
    easy_pass_rate: float | None = None  # τ: difficulty-aware when given
    easy_scale: float = 0.5  # γ: an easy prompt's budget is γ·L_T

    def __post_init__(self):
        super().__post_init__()
        check_number("truncate_at", self.truncate_at, low=0, integer=True)
        check_number("truncated_reward", self.truncated_reward)
        if self.easy_pass_rate is not None:
            check_number("easy_pass_rate", self.easy_pass_rate, low=0, high=1)
        check_number("easy_scale", self.easy_scale, above=0, high=1)


@register("dler", "length_reward", "group", "Liu et al. 2025, DLER: Doing Length pEnalty Right - Incentivizing "
          "More Intelligence per Token via Reinforcement Learning (arXiv:2510.15110)", DlerOptions)
class Dler(LengthReward):
    """R' = truncated_reward when L > L_g or the response was truncated, R otherwise; L_g = γ·L_T for an easy
    prompt (ease 1 − h >= τ: by default the group's pass rate p̂ >= τ; under difficulty: task the label's place),
    L_T otherwise, L_T = truncate_at or the generation budget; without easy_pass_rate every prompt has L_T.
    The rest of the recipe (batch-wise reward normalisation, higher clipping, dynamic sampling) lives in
    algorithm.advantage, ppo eps_high and data.dynamic_sampling."""

    def __init__(self, o: DlerOptions, budget: int):
        super().__init__(o, budget)
        self.limit = _or_budget("truncate_at", o.truncate_at, budget)

    def shape(self, groups, step):
        return [_truncate(g, self._limit(g), self.o.truncated_reward) for g in groups]

    def _limit(self, g: ScoredGroup) -> float:
        easy = self.o.easy_pass_rate is not None and 1 - hardness(g, self.o) >= Fraction(self.o.easy_pass_rate)
        return self.o.easy_scale * self.limit if easy else float(self.limit)


@dataclass
class DastOptions(DifficultyOptions):
    weight: float = 1.0  # w, the budget score's scale
    max_len: int = 0  # L_max, the budget of the hardest prompt (0: the generation budget)

    def __post_init__(self):
        super().__post_init__()
        check_number("weight", self.weight, low=0)
        check_number("max_len", self.max_len, low=0, integer=True)


@register("dast", "length_reward", "group", "Shen et al. 2025, DAST: Difficulty-Adaptive Slow-Thinking for "
          "Large Reasoning Models", DastOptions)
class Dast(LengthReward):
    """Token length budget B = e·L̄_c + (1 − e)·L_max: e the prompt's ease (its pass rate p̂ by default, or 1 − h under
    difficulty: task), L̄_c the group's mean correct length (L_max when none is correct), L_max = max_len or the
    generation budget, so easy prompts get small budgets. λ_i = (L_i − B)/B; s_i = max(0.5 − 0.5·λ_i, 0.1) for a
    correct response (shorter is better), min(0.9·λ_i − 0.1, −0.1) for an incorrect one (longer is better:
    sufficient reasoning on hard prompts); R' = R + w·s_i. [A] the budget and score forms; the paper turns the
    scores into preference pairs, here they shape the RL reward."""

    def __init__(self, o: DastOptions, budget: int):
        super().__init__(o, budget)
        self.max_len = _or_budget("max_len", o.max_len, budget)

    def shape(self, groups, step):
        out = []
        for g in groups:
            ease = float(1 - hardness(g, self.o))
            lengths = g.lengths.to(torch.float64)
            mean_correct = float(lengths[g.correct].mean()) if bool(g.correct.any()) else float(self.max_len)
            b = ease * mean_correct + (1 - ease) * self.max_len
            lam = (lengths - b) / b
            score = torch.where(g.correct, (0.5 - 0.5 * lam).clamp(min=0.1), (0.9 * lam - 0.1).clamp(max=-0.1))
            out.append(g.rewards + self.o.weight * score)
        return out


@dataclass
class DeepCompressOptions(DifficultyOptions):
    alpha: float = 0.5  # α, the length reward's scale
    threshold: float = 0.5  # τ: Simple when the prompt's ease >= τ
    momentum: float = 0.5  # m: running accuracy a ← (1 − m)·a + m·p̂

    def __post_init__(self):
        super().__post_init__()
        check_number("alpha", self.alpha, low=0)
        check_number("threshold", self.threshold, low=0, high=1)
        check_number("momentum", self.momentum, above=0, high=1)


@register("deepcompress", "length_reward", "group", "Liang et al. 2025, DeepCompress: A Dual Reward Strategy for "
          "Dynamically Exploring and Compressing Reasoning Chains (arXiv:2510.27419)", DeepCompressOptions)
class DeepCompress(LengthReward):
    """Running accuracy per prompt, this group included: a_p ← (1 − m)·a_p + m·p̂ (a_p = p̂ at its first group).
    Simple when a_p >= τ (the default; under difficulty: task, when the label's ease 1 − h >= τ), Hard otherwise.
    z_i = (L_i − mean L)/std L over the group (population std; 0 when it is 0), σ the logistic function;
    R' = R + α·1[correct]·σ(−z_i) on Simple (shorter correct chains earn more), R + α·1[correct]·σ(z_i) on
    Hard (longer ones do). [A] the moving average, the threshold and the logistic length score; state: a per
    prompt key."""

    def __init__(self, o: DeepCompressOptions, budget: int):
        super().__init__(o, budget)
        self.accuracy: dict[str, float] = {}

    def shape(self, groups, step):
        return [self._shape_group(g) for g in groups]

    def _shape_group(self, g: ScoredGroup) -> Tensor:
        p = pass_rate(g)
        a = self.accuracy.get(g.prompt_key)
        a = p if a is None else (1 - self.o.momentum) * a + self.o.momentum * p
        self.accuracy[g.prompt_key] = a
        ease = a if self.o.difficulty == "pass_rate" else float(1 - hardness(g, self.o))
        z = group_zscore(g.lengths.to(torch.float64))
        sign = -1.0 if ease >= self.o.threshold else 1.0
        return g.rewards + self.o.alpha * g.correct.to(torch.float64) * torch.sigmoid(sign * z)

    def state_dict(self):
        return {"accuracy": dict(self.accuracy)}

    def load_state_dict(self, state):
        _check_state_keys(state, ("accuracy",), "deepcompress")
        acc = state["accuracy"]
        if not (isinstance(acc, dict) and all(_is_number(v) and 0 <= v <= 1 for v in acc.values())):
            raise ValueError(f"length state: deepcompress accuracy must map prompt keys to numbers in [0, 1], "
                             f"got {acc!r}")
        self.accuracy = {str(k): float(v) for k, v in acc.items()}


# ----------------------------------------------------------------------------- group filters


GFPO_METRICS = ("length", "reward_per_token")


@dataclass
class GfpoOptions(DifficultyOptions):
    keep: int | None = None  # k, responses kept per group (or adaptive_keep)
    metric: str = "length"  # length: the k shortest; reward_per_token: the k with the highest R/L
    adaptive_keep: list | None = None  # [k_easy, ..., k_hard], one k per difficulty bucket

    def __post_init__(self):
        super().__post_init__()
        check_choice("metric", self.metric, GFPO_METRICS)
        if (self.keep is None) == (self.adaptive_keep is None):
            raise ValueError(f"keep: give keep or adaptive_keep (exactly one), got keep={self.keep!r}, "
                             f"adaptive_keep={self.adaptive_keep!r}")
        if self.keep is not None:
            check_number("keep", self.keep, above=0, integer=True)
        elif not (isinstance(self.adaptive_keep, (list, tuple)) and self.adaptive_keep
                  and all(_is_int(k) and k > 0 for k in self.adaptive_keep)):
            raise ValueError(f"adaptive_keep: must be a non-empty list of ints > 0 (easy .. hard), "
                             f"got {self.adaptive_keep!r}")


@register("gfpo", "group_filter", "group", "Shrivastava et al. 2025, Sample More to Think Less: Group "
          "Filtered Policy Optimization for Concise Reasoning, GFPO", GfpoOptions)
class Gfpo(GroupFilter):
    """Keep, of each group of G, the min(k, G) responses first by the metric, ties by index: `length` the shortest L_i,
    `reward_per_token` the highest R_i/L_i. k = keep, or adaptive_keep[b] with b the prompt's difficulty bucket
    (hardness h = 1 − p̂ by default, or the task label under difficulty: task, in n = len(adaptive_keep) equal bins,
    b = min(n−1, ⌊h·n⌋), 0 the easiest), so harder prompts can keep more. Advantages are computed over the kept
    ones. [A] fixed-width pass-rate buckets (the paper buckets by running quantiles)."""

    def select(self, groups, step):
        return [self._select_group(g) for g in groups]

    def check_group_size(self, n: int) -> None:
        k = max([self.o.keep] if self.o.keep is not None else self.o.adaptive_keep)
        if k >= n:
            raise ValueError(f"keep: GFPO samples more than it keeps; k={k} needs rollout.n_samples > {k}, got {n}")

    def _select_group(self, g: ScoredGroup) -> Tensor:
        if self.o.keep is not None:
            k = self.o.keep
        else:
            k = self.o.adaptive_keep[difficulty_bucket(hardness(g, self.o), len(self.o.adaptive_keep))]
        lengths = g.lengths.tolist()
        if self.o.metric == "length":
            order = sorted(range(g.size), key=lambda i: (lengths[i], i))
        else:
            rewards = g.rewards.tolist()
            order = sorted(range(g.size), key=lambda i: (-rewards[i] / max(lengths[i], 1), i))
        return torch.tensor(sorted(order[:k]), dtype=torch.int64)


# ----------------------------------------------------------------------------- building and checking


def build_length_reward(name: str, options: dict, budget: int) -> LengthReward | None:
    """The configured data.length_reward ("none": None); unknown names or options raise ValueError."""
    return None if name == "none" else _build("length_reward", name, options, budget)


def build_group_filter(name: str, options: dict, budget: int) -> GroupFilter | None:
    return None if name == "none" else _build("group_filter", name, options, budget)


def _build(kind: str, name: str, options: dict, budget: int):
    entry = get(kind, name, argument=f"data.{kind}")
    return entry.fn(entry.make_options(dict(options)), budget)


def check_shaped(groups: list[ScoredGroup], shaped: list[Tensor], name: str) -> list[Tensor]:
    """A length reward's output: one finite float tensor per group, of the group's size."""
    if len(shaped) != len(groups):
        raise ValueError(f"{name}: {len(shaped)} reward tensors for {len(groups)} groups")
    for g, r in zip(groups, shaped):
        if r.shape != g.rewards.shape or not bool(torch.isfinite(r).all()):
            raise ValueError(f"{name}: shaped rewards of prompt {g.prompt_key} are {r.tolist()}, expected "
                             f"{g.size} finite numbers")
    return [r.to(torch.float64) for r in shaped]


def check_kept(groups: list[ScoredGroup], kept: list[Tensor], name: str, drops: bool = False) -> list[Tensor]:
    """A group filter's output: per group, sorted distinct indices into it (at least one, or none where `drops`:
    GroupFilter.drops_groups)."""
    if len(kept) != len(groups):
        raise ValueError(f"{name}: {len(kept)} index tensors for {len(groups)} groups")
    for g, k in zip(groups, kept):
        idx = k.tolist()
        if drops and not idx:
            continue
        if not idx or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] >= g.size:
            raise ValueError(f"{name}: kept indices {idx} of prompt {g.prompt_key} are not sorted distinct "
                             f"indices in [0, {g.size})")
    return [k.to(torch.int64) for k in kept]


# ----------------------------------------------------------------------------- median and adaptive targets


@dataclass
class HmpoOptions:
    weight: float = 0.5  # w: the length factor's share of a correct response's reward, in [0, 1)
    max_len: int = 0  # L_max, where the cosine decay reaches 0 (0: the generation budget)

    def __post_init__(self):
        check_number("weight", self.weight, low=0)
        if not self.weight < 1:
            raise ValueError(f"weight: must be < 1 (a correct response must out-earn an incorrect one), "
                             f"got {self.weight!r}")
        check_number("max_len", self.max_len, low=0, integer=True)


def group_zscore(values: Tensor) -> Tensor:
    """(v − mean)/std over a group's values (population std); all 0 when the std is 0."""
    std = float(values.std(unbiased=False))
    return (values - values.mean()) / std if std > 0 else torch.zeros_like(values)


def median_length(lengths: Tensor) -> float:
    """The median of the lengths (the mean of the two middle ones for an even count)."""
    ranked = sorted(lengths.tolist())
    mid = len(ranked) // 2
    return float(ranked[mid]) if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2


def cosine_decay(lengths: Tensor, budget: float, max_len: float) -> Tensor:
    """f(L) = 1 for L <= B; ½·(1 + cos(π·min(1, (L − B)/(L_max − B)))) for L > B (0 from L_max on; 0 for any
    L > B when L_max <= B)."""
    lengths = lengths.to(torch.float64)
    if max_len <= budget:
        return (lengths <= budget).to(torch.float64)
    x = ((lengths - budget) / (max_len - budget)).clamp(min=0.0, max=1.0)
    return 0.5 * (1 + torch.cos(math.pi * x))


@register("hmpo", "length_reward", "group",
          "Hybrid Median-length Policy Optimization, HMPO (Mach-Mind-4-Flash technical report; the method's own "
          "paper: HMPO: Hybrid Median-length Policy Optimization for Chain-of-Thought Compression, arXiv:2606.01934)",
          HmpoOptions)
class Hmpo(LengthReward):
    """B = the median length of the group's correct responses; f(L) = 1 for L <= B, ½·(1 + cos(π·min(1,
    (L − B)/(L_max − B)))) above (a cosine decay from 1 at B to 0 at L_max = max_len or the generation
    budget); R' = R·(1 − w + w·f(L)) (multiplicative: an incorrect response's R = 0 stays 0 whatever its length,
    a correct one keeps at least (1 − w)·R, so correctness always comes first); R' = R in a group with no correct
    response.
    Assumption: the seed's abstract names HMPO only; the median budget from successful rollouts, the cosine decay
    and the multiplicative form come from the HMPO paper's abstract, and the decay's shape (flat to B, zero at
    L_max), the floor 1 − w and the per-group (stateless) median are this implementation's choices."""

    def __init__(self, o: HmpoOptions, budget: int):
        super().__init__(o, budget)
        self.max_len = _or_budget("max_len", o.max_len, budget)

    def shape(self, groups, step):
        return [self._shape_group(g) for g in groups]

    def _shape_group(self, g: ScoredGroup) -> Tensor:
        if not bool(g.correct.any()):
            return g.rewards.clone()
        f = cosine_decay(g.lengths, median_length(g.lengths[g.correct]), float(self.max_len))
        return g.rewards * (1 - self.o.weight + self.o.weight * f)


@dataclass
class LeadOptions:
    weight: float = 0.5  # w: the efficiency reward's weight once correctness has settled (PSI = 0)
    momentum: float = 0.5  # m: a prompt's target T ← (1 − m)·T + m·(its shortest correct length)

    def __post_init__(self):
        check_number("weight", self.weight, low=0)
        check_number("momentum", self.momentum, above=0, high=1)


def symmetric_efficiency(lengths: Tensor, target: float) -> Tensor:
    """e(L) = max(−1, 1 − |L − T|/T): 1 at the target T, falling alike for longer (overthinking) and shorter
    (over-compression) responses."""
    return (1 - (lengths.to(torch.float64) - target).abs() / target).clamp(min=-1.0)


def potential_scaled_instability(groups: list[ScoredGroup]) -> float:
    """PSI = I·P over one call's groups: instability I = mean_g 4·p̂_g·(1 − p̂_g) (how unsettled each prompt's
    correctness still is; 0 when every prompt is always or never solved), potential P = 1 − mean_g p̂_g (the
    accuracy still to gain). PSI is in [0, 1]."""
    rates = [pass_rate(g) for g in groups]
    instability = sum(4 * p * (1 - p) for p in rates) / len(rates)
    return instability * (1 - sum(rates) / len(rates))


@register("lead", "length_reward", "batch",
          "LEAD: Length-Efficient Adaptive and Dynamic Reasoning for Large Language Models (arXiv:2605.09806)",
          LeadOptions)
class Lead(LengthReward):
    """Per call: λ = w·(1 − PSI), PSI = I·P the Potential-Scaled Instability of the call's groups (I = mean_g
    4·p̂_g(1 − p̂_g), P = 1 − mean_g p̂_g): while correctness is still being learnt the efficiency term steps back.
    Per prompt p, target T_p ← s (first time) or (1 − m)·T_p + m·s, s its group's shortest correct length (not
    moved by a group with no correct response), before shaping. R' = R + λ·max(−1, 1 − |L − T_p|/T_p) for
    a correct response, R for an incorrect one or a prompt with no target yet.
    Assumption: the abstract names PSI, the online per-problem target from the model's own correct rollouts and a
    symmetric efficiency reward, not their forms: PSI as I·P above, the target as a moving average of the shortest
    correct length, e(L) = max(−1, 1 − |L − T|/T), and the additive combination are this implementation's;
    state: T per prompt key."""

    def __init__(self, o: LeadOptions, budget: int):
        super().__init__(o, budget)
        self.targets: dict[str, float] = {}
        self.efficiency_weight = float(o.weight)

    def shape(self, groups, step):
        if not groups:
            return []
        self.efficiency_weight = self.o.weight * (1 - potential_scaled_instability(groups))
        return [self._shape_group(g) for g in groups]

    def _shape_group(self, g: ScoredGroup) -> Tensor:
        if bool(g.correct.any()):
            shortest = float(g.lengths[g.correct].min().clamp(min=1))
            t = self.targets.get(g.prompt_key)
            m = self.o.momentum
            self.targets[g.prompt_key] = shortest if t is None else (1 - m) * t + m * shortest
        target = self.targets.get(g.prompt_key)
        if target is None:
            return g.rewards.clone()
        bonus = torch.where(g.correct, symmetric_efficiency(g.lengths, target), torch.zeros_like(g.rewards))
        return g.rewards + self.efficiency_weight * bonus

    def metrics(self) -> dict[str, float]:
        return {"efficiency_weight": self.efficiency_weight}

    def state_dict(self):
        return {"targets": dict(self.targets)}

    def load_state_dict(self, state):
        _check_state_keys(state, ("targets",), "lead")
        targets = state["targets"]
        if not (isinstance(targets, dict) and all(_is_number(v) and v > 0 for v in targets.values())):
            raise ValueError(f"length state: lead targets must map prompt keys to numbers > 0, got {targets!r}")
        self.targets = {str(k): float(v) for k, v in targets.items()}

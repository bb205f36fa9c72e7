"""Length rewards that read each response's steps (data.length_reward): Step Pruner, the post-answer penalty, GRSP.

A response's steps are cut where its decoded text completes the method's `step_delimiter` (the same segmentation as
the dense process rewards, megapo.algorithms.process_rewards.step_ends; the last step ends at the last token). The
trainer's length stage (megapo/trainer/length_stage.py) splits every response of a round with the run's tokenizer
and hands each group's step lengths in ScoredGroup.step_lengths; the post-answer penalty also reads
ScoredGroup.first_correct, the token count through the first step whose prefix the task's own answer checker
(data.reward, the task's when auto) scores >= data.correct_threshold.

Every method here shapes each group from its own responses only (a group's statistics, never the call's), so the
shaped rewards do not depend on how a step's groups are split into sampling rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from megapo.algorithms.length import LengthReward, ScoredGroup, _check_state_keys, group_zscore
from megapo.algorithms.options import check_number
from megapo.algorithms.registry import register


def check_delimiter(value) -> None:
    if not (isinstance(value, str) and value):
        raise ValueError(f"step_delimiter: must be a non-empty string, got {value!r}")


def group_steps(g: ScoredGroup, method: str) -> list[list[int]]:
    """Each response's step token counts; ValueError naming step_lengths when the stage did not split them."""
    if g.step_lengths is None or len(g.step_lengths) != g.size:
        raise ValueError(f"step_lengths: {method} reads each response's steps, and prompt {g.prompt_key} has none "
                         "(the length stage splits them with the run's tokenizer)")
    return [[int(n) for n in torch.as_tensor(s).tolist()] for s in g.step_lengths]


def one_step_each(g: ScoredGroup) -> ScoredGroup:
    """The group with every response one step long and its first correct answer at its end when correct (what a
    response without any delimiter is): the config's dry run, which has no text."""
    first = torch.where(g.correct, g.lengths, torch.full_like(g.lengths, -1))
    return replace(g, step_lengths=tuple(torch.tensor([int(n)]) for n in g.lengths.tolist()), first_correct=first)


# ----------------------------------------------------------------------------- Step Pruner


@dataclass
class StepPrunerOptions:
    step_delimiter: str = "\n\n"  # a step is a paragraph (the paper's segmentation proxy)
    penalty: float = 0.1  # β, the reward lost per redundant step
    min_reward: float = 0.1  # m > 0, the least a correct response earns (an incorrect one earns 0)
    max_step_len: int = 0  # the dynamic stop: a step longer than this many tokens halts updates (0: off)

    def __post_init__(self):
        check_delimiter(self.step_delimiter)
        check_number("penalty", self.penalty, low=0)
        check_number("min_reward", self.min_reward, above=0)
        check_number("max_step_len", self.max_step_len, low=0, integer=True)


@register("step_pruner", "length_reward", "group",
          "Wu et al. 2025, Beyond Token Length: Step Pruner for Efficient and Accurate Reasoning in Large Language "
          "Models (arXiv:2510.03805), Step Pruner (SP)", StepPrunerOptions)
class StepPruner(LengthReward):
    """K_i = the steps of response i (cut at step_delimiter, paragraphs by default), K* = the fewest steps of the
    group's correct responses. R'_i = max(R_i − β·(K_i − K*), m) for a correct response, 0 for an incorrect one
    (no reward, not even partial credit). Dynamic stop (max_step_len > 0): a group with a step longer than
    max_step_len tokens gets R' = 0 for every response (all-equal rewards: zero advantages, no policy-gradient update
    from it), and every group of every later step too (the run's updates halt; a KL or entropy term still acts).
    Assumption: the abstract names a step-aware reward (correctness first, a penalty for redundant steps, none for
    incorrect responses) and the stop rule; redundancy as the steps beyond the group's fewest correct, the linear
    penalty with floor m, and the halt as zero rewards from the step after the trigger (the trigger step's other
    groups shaped as usual, so a step's groups may be split into rounds freely) are this implementation's;
    state: the step updates halt from."""

    def __init__(self, o: StepPrunerOptions, budget: int):
        super().__init__(o, budget)
        self.halted_from: int | None = None

    def step_delimiter(self):
        return self.o.step_delimiter

    def shape(self, groups, step):
        if self.halted_from is not None and step >= self.halted_from:
            return [torch.zeros_like(g.rewards) for g in groups]
        return [self._shape_group(g, step) for g in groups]

    def _shape_group(self, g: ScoredGroup, step: int) -> Tensor:
        steps = group_steps(g, "step_pruner")
        if self.o.max_step_len and any(n > self.o.max_step_len for s in steps for n in s):
            self.halted_from = step + 1 if self.halted_from is None else min(self.halted_from, step + 1)
            return torch.zeros_like(g.rewards)
        counts = torch.tensor([len(s) for s in steps], dtype=torch.float64)
        if not bool(g.correct.any()):
            return torch.zeros_like(g.rewards)
        fewest = float(counts[g.correct].min())
        shaped = (g.rewards - self.o.penalty * (counts - fewest)).clamp(min=self.o.min_reward)
        return torch.where(g.correct, shaped, torch.zeros_like(shaped))

    def metrics(self) -> dict[str, float]:
        return {"halted": float(self.halted_from is not None)}

    def state_dict(self):
        return {"halted_from": self.halted_from}

    def load_state_dict(self, state):
        _check_state_keys(state, ("halted_from",), "step_pruner")
        at = state["halted_from"]
        if at is not None and (isinstance(at, bool) or not isinstance(at, int)):
            raise ValueError(f"length state: step_pruner halted_from must be a step number or null, got {at!r}")
        self.halted_from = at


# ----------------------------------------------------------------------------- post-answer penalty


@dataclass
class PostAnswerOptions:
    step_delimiter: str = "\n"  # where a prefix is checked for the answer
    alpha: float = 0.5  # α in [0, 1], the reward lost by a correct response made only of post-answer tokens

    def __post_init__(self):
        check_delimiter(self.step_delimiter)
        check_number("alpha", self.alpha, low=0, high=1)


@register("post_answer", "length_reward", "sequence",
          "Rakotonirina et al. 2026, Correct, Concise and Complete: Multi-stage Training For Adaptive Reasoning "
          "(arXiv:2601.02972), the length penalty on tokens after the first correct answer", PostAnswerOptions)
class PostAnswer(LengthReward):
    """a_i = the tokens through the first step whose prefix (less the step_delimiter it ends with) the task's answer
    checker scores >= data.correct_threshold (ScoredGroup.first_correct), L_i the response's tokens.
    R'_i = R_i − α·(L_i − a_i)/L_i for a correct response with a_i >= 0, R_i otherwise. Checking after a correct
    answer is paid for; a response whose first answer was wrong and whose self-verification found the right one has
    its first correct answer at the end and pays nothing, and one whose checking turned a right answer wrong already
    loses its reward.
    Assumption: the abstract gives the idea only; the penalty as the share of post-answer tokens, scaled by α
    (α <= 1 keeps every correct response above an incorrect one's 0), the check at step ends (step_delimiter) and
    the verdict reward >= data.correct_threshold are this implementation's."""

    needs_first_correct = True

    def step_delimiter(self):
        return self.o.step_delimiter

    def shape(self, groups, step):
        return [self._shape_group(g) for g in groups]

    def _shape_group(self, g: ScoredGroup) -> Tensor:
        if g.first_correct is None or g.first_correct.shape != g.rewards.shape:
            raise ValueError(f"first_correct: post_answer reads where each response first gives the correct answer, "
                             f"and prompt {g.prompt_key} has none (the length stage checks each step's prefix)")
        lengths = g.lengths.to(torch.float64).clamp(min=1)
        first = g.first_correct.to(torch.float64)
        after = ((lengths - first) / lengths).clamp(min=0)
        return torch.where(g.correct & (g.first_correct >= 0), g.rewards - self.o.alpha * after, g.rewards)


# ----------------------------------------------------------------------------- GRSP


@dataclass
class GrspOptions:
    step_delimiter: str = "\n\n"  # segments (keyword matching: the text a new segment starts after)
    coef: float = 0.1  # λ, the penalty per group standard deviation of weighted segments
    bins: list = field(default_factory=lambda: [16, 64])  # segment-length edges (tokens) between clusters
    weights: list = field(default_factory=lambda: [1.0, 0.5, 0.25])  # w_c per cluster, shortest first

    def __post_init__(self):
        check_delimiter(self.step_delimiter)
        check_number("coef", self.coef, low=0)
        b = self.bins
        if not (isinstance(b, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                      for x in b) and list(b) == sorted(set(b))):
            raise ValueError(f"bins: must be a list of increasing ints > 0 (segment-length edges), got {b!r}")
        w = self.weights
        if not (isinstance(w, (list, tuple)) and len(w) == len(b) + 1):
            raise ValueError(f"weights: must be a list of len(bins) + 1 = {len(b) + 1} numbers, got {w!r}")
        for i, x in enumerate(w):
            check_number(f"weights[{i}]", x, low=0)


def segment_cluster(length: int, bins: list) -> int:
    """c(ℓ) = #{b in bins: ℓ > b}: cluster 0 the shortest segments (ℓ <= b_1), len(bins) the longest."""
    return sum(length > b for b in bins)


@register("grsp", "length_reward", "group",
          "Song et al. 2025, Mitigating Overthinking through Reasoning Shaping (arXiv:2510.09535), Group Relative "
          "Segment Penalization (GRSP)", GrspOptions)
class Grsp(LengthReward):
    """Segments of response i (cut at step_delimiter) of ℓ_{i,k} tokens, each in a length cluster
    c(ℓ) = #{b in bins: ℓ > b}; S_i = Σ_k w_{c(ℓ_{i,k})} its weighted segment count (descending w by default: a
    short segment costs more than a long one); z_i = (S_i − mean_g S)/std_g S over the group (population std; z = 0
    when it is 0). R'_i = R_i − λ·z_i for a correct response, R_i for an incorrect one.
    Assumption: the abstract names a segment-level, group-relative penalty with length-aware weights across segment
    clusters (summaries of the paper report descending weights, shorter segments weighed more, as its best);
    fixed length bins as the clusters, the weighted count, the group z-score and the penalty on correct responses
    only are this implementation's; segments by keyword (the delimiter), not the paper's confidence-based cut."""

    def step_delimiter(self):
        return self.o.step_delimiter

    def shape(self, groups, step):
        return [self._shape_group(g) for g in groups]

    def _shape_group(self, g: ScoredGroup) -> Tensor:
        w = [float(x) for x in self.o.weights]
        weighted = torch.tensor([sum(w[segment_cluster(n, self.o.bins)] for n in s) for s in group_steps(g, "grsp")],
                                dtype=torch.float64)
        return torch.where(g.correct, g.rewards - self.o.coef * group_zscore(weighted), g.rewards)

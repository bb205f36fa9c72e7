"""Length control: group-aware length rewards and group filters, applied after the verifier, before advantages.

A step's responses reach this stage as ScoredGroups (one per prompt: the verifier's rewards, correctness,
response lengths, truncation flags, the prompt's key and difficulty). Two kinds of method, each registered
by name with its paper and formula (`megapo objectives --kind length_reward --formulas`):

    data.length_reward   LengthReward.shape(groups, step) -> the shaped reward of every response
    data.group_filter    GroupFilter.select(groups, step) -> the responses of each group kept for training

A method that carries state across steps (a target per difficulty bucket, a dual variable, a per-prompt
history) keeps it in `state_dict()` (JSON); the trainer saves it in the checkpoint and restores it on
--resume, so a resumed run shapes as the unstopped one. `budget` is rollout.max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megapo.algorithms.registry import get, register


@dataclass(frozen=True)
class ScoredGroup:
    """One prompt's responses as the verifier scored them (all tensors [G], G the group's size)."""
    prompt_key: str  # stable across steps and resumes (stages.prompt_key of the prompt text)
    difficulty: int | None  # the task's difficulty of the prompt (addition_cot: digits), None when it has none
    rewards: Tensor  # float64: the reward function's scores (a truncated response's is data.truncated_reward)
    correct: Tensor  # bool: the verifier's verdict, reward >= data.correct_threshold, whatever the shaping
    lengths: Tensor  # int64: response tokens, end-of-sequence included
    truncated: Tensor  # bool: cut at rollout.max_new_tokens

    @property
    def size(self) -> int:
        return int(self.rewards.numel())


class LengthMethod:
    """What every length method shares: its options, the generation budget and the state kept across steps."""

    def __init__(self, options, budget: int):
        self.o = options
        self.budget = budget

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
    kept for training (the others leave the batch; advantages are computed over the kept ones)."""

    def select(self, groups: list[ScoredGroup], step: int) -> list[Tensor]:
        raise NotImplementedError


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


def check_kept(groups: list[ScoredGroup], kept: list[Tensor], name: str) -> list[Tensor]:
    """A group filter's output: per group, sorted distinct indices into it (at least one)."""
    if len(kept) != len(groups):
        raise ValueError(f"{name}: {len(kept)} index tensors for {len(groups)} groups")
    for g, k in zip(groups, kept):
        idx = k.tolist()
        if not idx or idx != sorted(set(idx)) or idx[0] < 0 or idx[-1] >= g.size:
            raise ValueError(f"{name}: kept indices {idx} of prompt {g.prompt_key} are not sorted distinct "
                             f"indices in [0, {g.size})")
    return [k.to(torch.int64) for k in kept]

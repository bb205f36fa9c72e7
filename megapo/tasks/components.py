"""A task's verifier split into several named rewards, each with the information it checks (multi-reward RL).

    verifier = ComponentVerifier(("correct", "format"), score)     # score(example, response) -> RewardComponents
    parts = verifier(example, "0579")      # (RewardComponent("correct", 1.0, "0579"), RewardComponent("format", ...))

A task with one (Task.components None) gives the trainer one scalar reward per response, as before. One with a
ComponentVerifier still gives its scalar reward (Task.reward: the held-out accuracy, dynamic sampling, the metrics);
the stages that read the input reward_components (gdpo, mrtpo: megapo/algorithms/multi_reward.py) take the
components from it, per sample, at the update (megapo/trainer/multi_reward.py). A component's `information` is the
text its verifier checks against (the reference answer, a format rule, a constraint): MRTPO replays each response
with it in the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RewardComponent:
    """One named reward of a response: its value and the verifier information it was checked against."""

    name: str
    value: float
    information: str


@dataclass(frozen=True)
class ComponentVerifier:
    """`score(example, response text) -> the components`, always `names` in that order (checked at every call)."""

    names: tuple[str, ...]
    score: Callable[..., tuple[RewardComponent, ...]]

    def __post_init__(self):
        if not self.names or len(set(self.names)) != len(self.names) or not all(
                isinstance(n, str) and n for n in self.names):
            raise ValueError(f"names: one or more distinct non-empty names, got {self.names!r}")

    def __call__(self, example, response: str) -> tuple[RewardComponent, ...]:
        parts = tuple(self.score(example, response))
        if tuple(p.name for p in parts) != self.names:
            raise ValueError(f"components: the verifier returned {[p.name for p in parts]}, declared "
                             f"{list(self.names)}")
        for p in parts:
            if isinstance(p.value, bool) or not isinstance(p.value, (int, float)) or not math.isfinite(p.value):
                raise ValueError(f"components: {p.name} must be a finite number, got {p.value!r}")
            if not isinstance(p.information, str):
                raise ValueError(f"components: {p.name}'s information must be text, got {p.information!r}")
        return parts

"""What every task hands the trainer: prompts with reference answers, in fixed splits.

A `Task` (what `data.task` resolves to, megapo.tasks.registry) gives the i-th example of each split
on demand, the SFT demonstrations of the warm start, and its default reward (also the verifier of
the held-out accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from megapo.tasks.components import ComponentVerifier

SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Example:
    """One prompt and the reference the reward compares against (text, before tokenization);
    `difficulty` is the task's bucket of it (e.g. the number of digits), None when it has none."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    difficulty: int | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Task:
    """A task's splits, warm start and reward.

    `sizes[split]` examples per split; `example(split, i)` the i-th of a split in its fixed order (the
    splits must be disjoint); `demonstrations(examples, seed)` the SFT target text of each training
    example (None: its answer); `reward` a data.reward spec, used when data.reward is auto and as the
    verifier of the held-out accuracy."""

    name: str
    sizes: dict[str, int]
    example: Callable[[str, int], Example]
    reward: str = "exact_match"
    demonstrations: Callable[[Sequence[Example], int], list[str]] | None = None
    # the kind of a response (addition_cot: terse | scratchpad | checked): held-out eval logs each kind's share
    response_kind: Callable[[str], str] | None = None
    # a multi-turn task's environment, a new one per trajectory (megapo.envs.base.Environment; env.name=auto
    # uses it); its demonstrations are then lists of policy turns, the environment answering between them
    environment: Callable[[], Any] | None = None
    # the text that ends a (truncated) thinking and asks for the answer: stage anytime appends it to each response cut
    # at a budget and samples a summary after it (megapo/trainer/anytime.py); None: the task has none
    summary_trigger: str | None = None
    # its verifier as several named rewards, each with the information it checks (megapo.tasks.components
    # .ComponentVerifier; None: one reward). The multi-reward stages read them (gdpo, mrtpo)
    components: ComponentVerifier | None = None

    def size(self, split: str) -> int:
        if split not in self.sizes:
            raise ValueError(f"split must be one of {', '.join(self.sizes)}, got {split!r}")
        return self.sizes[split]

    def examples(self, split: str, n: int | None = None, seed: int | None = None) -> list[Example]:
        """`n` examples of `split` (all when n is None). With a seed, a seeded random subset of the split;
        without, the first n in the split's fixed order."""
        size = self.size(split)
        if n is None:
            return [self.example(split, i) for i in range(size)]
        if n > size:
            raise ValueError(f"n={n} exceeds the {split} split ({size} problems)")
        ids = np.random.default_rng(seed).choice(size, size=n, replace=False) if seed is not None else range(n)
        return [self.example(split, int(i)) for i in ids]

    def sft_pairs(self, n: int, seed: int) -> list[tuple[Example, str]]:
        """`n` training examples (seeded) with the response the warm start teaches for each."""
        examples = self.examples("train", n, seed)
        targets = (self.demonstrations(examples, seed) if self.demonstrations is not None
                   else [ex.answer for ex in examples])
        return list(zip(examples, targets))

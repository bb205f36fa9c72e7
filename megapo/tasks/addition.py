"""The built-in synthetic task: 3-digit addition, "123+456=" -> "0579" then end-of-sequence.

Every ordered pair (a, b) with 0 <= a, b <= 999 is one problem (10^6 in all). A fixed permutation
(seeded by SPLIT_SEED, independent of any training seed) puts the first 1000 problems in the
held-out test split and the next 500 in validation; training only ever draws from the rest, so
the three splits are disjoint whatever seeds a run uses.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from megapo.tasks.base import Example, Task

NUM_PROBLEMS = 1000 * 1000
SPLIT_SEED = 20240917
TEST_SIZE = 1000
VALIDATION_SIZE = 500
SPLITS = ("train", "validation", "test")


@lru_cache(maxsize=1)
def _permutation() -> np.ndarray:
    return np.random.default_rng(SPLIT_SEED).permutation(NUM_PROBLEMS)


def split_ids(split: str) -> np.ndarray:
    """Problem ids (a * 1000 + b) of one split, in a fixed order."""
    perm = _permutation()
    if split == "test":
        return perm[:TEST_SIZE]
    if split == "validation":
        return perm[TEST_SIZE:TEST_SIZE + VALIDATION_SIZE]
    if split == "train":
        return perm[TEST_SIZE + VALIDATION_SIZE:]
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def prompt_text(a: int, b: int) -> str:
    return f"{a:03d}+{b:03d}="


def answer_text(a: int, b: int) -> str:
    return f"{a + b:04d}"


def example(problem_id: int) -> Example:
    a, b = divmod(int(problem_id), 1000)
    return Example(prompt_text(a, b), answer_text(a, b), {"a": a, "b": b, "id": int(problem_id)}, difficulty=3)


def task(train_size: int = 0) -> Task:
    """data.task=addition (megapo.tasks.registry): the answer is the whole response, scored by exact match.
    `train_size` (data.task_options) > 0: only the first train_size problems of the train split, a small pool the
    prompt order cycles through (each prompt seen again every epoch: what SOUP's prefix buffer needs)."""
    full = NUM_PROBLEMS - TEST_SIZE - VALIDATION_SIZE
    if isinstance(train_size, bool) or not isinstance(train_size, int) or not 0 <= train_size <= full:
        raise ValueError(f"train_size: must be an int in [0, {full}] (0: the whole train split), got {train_size!r}")
    sizes = {"train": train_size or full, "validation": VALIDATION_SIZE, "test": TEST_SIZE}
    return Task("addition", sizes, lambda split, i: example(split_ids(split)[i]), reward="exact_match")


def examples(split: str, n: int | None = None, seed: int | None = None) -> list[Example]:
    """`n` examples of `split` (all when n is None). With a seed, a seeded random subset of the split;
    without, the first n in the split's fixed order."""
    return task().examples(split, n, seed)


def verify(example: Example, response: str) -> float:
    """1.0 when the response is exactly the 4-digit sum (surrounding whitespace ignored), else 0.0.

    `response` is the decoded completion without special tokens; the caller checks that the
    sequence ended with end-of-sequence (a completion cut by the length limit is not an answer).
    """
    return 1.0 if response.strip() == example.answer else 0.0

"""Fixed, disjoint splits of two-operand problems (a op b, both with d digits): what addition_cot and calculator
share. A pair's split is a hash of its text "a{op}b" (5 % test, 5 % validation, the rest train), so the splits
are disjoint whatever seeds a run uses; held-out problems come in a fixed order per digit count, and the i-th
training problem of a digit count is a seeded draw from i.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import numpy as np

_SPLIT_CODE = {"train": 0, "validation": 1, "test": 2}


@dataclass(frozen=True)
class OperandPairs:
    seed: int  # the draws' seed (each task its own)
    op: str  # the operator in the hashed text ("+", "*")

    def split_of(self, a: int, b: int) -> str:
        h = int.from_bytes(hashlib.sha256(f"{a}{self.op}{b}".encode()).digest()[:8], "big") % 100
        return "test" if h < 5 else "validation" if h < 10 else "train"

    def held_out(self, split: str, digits: int, count: int) -> tuple[tuple[int, int], ...]:
        """`count` distinct problems of `digits` digits in the test or validation split, in a fixed order."""
        return _held_out(self, split, digits, count)

    def getter(self, min_digits: int, max_digits: int, per_digits: dict[str, int], make: Callable[[int, int], Any]):
        """example(split, i) of a task: digit counts min_digits..max_digits interleaved, `per_digits[split]`
        held-out problems of each, `make(a, b)` the Example."""
        counts = max_digits - min_digits + 1

        def get(split: str, i: int):
            digits = min_digits + i % counts
            if split == "train":
                return make(*self.train_problem(digits, i // counts))
            return make(*self.held_out(split, digits, per_digits[split])[i // counts])

        return get

    def train_problem(self, digits: int, i: int) -> tuple[int, int]:
        rng = np.random.default_rng([self.seed, _SPLIT_CODE["train"], digits, i])
        while True:
            pair = _draw(rng, digits)
            if self.split_of(*pair) == "train":
                return pair


def _draw(rng: np.random.Generator, digits: int) -> tuple[int, int]:
    lo, hi = 10 ** (digits - 1), 10 ** digits
    return int(rng.integers(lo, hi)), int(rng.integers(lo, hi))


@lru_cache(maxsize=64)
def _held_out(pairs: OperandPairs, split: str, digits: int, count: int) -> tuple[tuple[int, int], ...]:
    rng = np.random.default_rng([pairs.seed, _SPLIT_CODE[split], digits])
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < count:
        pair = _draw(rng, digits)
        if pairs.split_of(*pair) == split:
            seen.setdefault(pair, None)
    return tuple(seen)


def check_digit_range(min_digits, max_digits, most: int) -> None:
    """A task's min_digits / max_digits options: integers in [1, most], min <= max (ValueError naming them)."""
    for name, value in (("min_digits", min_digits), ("max_digits", max_digits)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ValueError(f"{name} must be an integer in [1, {most}], got {value!r}")
    if min_digits > max_digits:
        raise ValueError(f"min_digits={min_digits} exceeds max_digits={max_digits}")

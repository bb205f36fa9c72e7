"""Checks of the numeric and named options the algorithms' options dataclasses share: each raises ValueError
starting with the option's name, which config validation turns into a ConfigError naming the dotted field."""

from __future__ import annotations

import math


def check_number(name: str, value, *, low=None, above=None, high=None, below=None, integer: bool = False) -> None:
    """One numeric option: finite (an int when `integer`), >= low, > above, <= high, < below where given."""
    kinds = (int,) if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)
    bounds = []
    for sign, bound, holds in ((">=", low, lambda v, b: v >= b), (">", above, lambda v, b: v > b),
                               ("<=", high, lambda v, b: v <= b), ("<", below, lambda v, b: v < b)):
        if bound is not None:
            bounds.append(f"{sign} {bound}")
            ok = ok and holds(value, bound)
    if not ok:
        what = "an int" if integer else "a finite number"
        raise ValueError(f"{name}: must be {what} {' and '.join(bounds)}".rstrip() + f", got {value!r}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(choices)}, got {value!r}")


def check_token_ids(name: str, ids) -> None:
    """A list (or tuple) of token ids, each an int >= 0."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or \
            any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{name}: must be a list of token ids (integers >= 0), got {ids!r}")

"""What a family's converter accepts in config.json beyond the keys every family reads: each key with the
values its Megatron model reproduces exactly (a family lists its own in its mapping's CONFIG_KEYS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Allowed:
    check: Callable[[object], bool]
    why: str  # shown when the check fails: what the converter would have to implement


def any_value(value) -> bool:
    return True


def false_value(value) -> bool:
    return value in (False, None)


def empty_value(value) -> bool:
    return value in (None, [], ())


def full_attention(value) -> bool:
    return value is None or all(t == "full_attention" for t in value)


def one_or_unset(value) -> bool:
    return value in (None, 1)


def zero_or_unset(value) -> bool:
    return value in (None, 0)


def read(*keys: str) -> dict[str, Allowed]:
    """Keys the family's spec reads (and checks itself): any value passes here."""
    return {key: Allowed(any_value, "") for key in keys}

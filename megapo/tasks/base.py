"""What every task hands the trainer: prompts with reference answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Example:
    """One prompt and the reference the reward compares against (text, before tokenization)."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

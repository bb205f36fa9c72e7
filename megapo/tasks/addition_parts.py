"""data.task=addition_parts: the built-in addition task (the same prompts, splits and held-out exact match) with its
verifier split into two rewards, for the multi-reward stages (gdpo, mrtpo: megapo/algorithms/multi_reward.py):

    correct  1.0 when the response reads as the sum (digits only; leading zeros may be missing)   information: the
             reference answer ("0579")
    format   1.0 when the response is exactly four digits                                          information: the
             format rule (FORMAT_RULE)

A response earns both exactly when the scalar reward (exact_match, the task's reward) is 1: "579" is correct but
not formatted, "0578" formatted but wrong.
"""

from __future__ import annotations

from megapo.tasks import addition
from megapo.tasks.base import Example, Task
from megapo.tasks.components import ComponentVerifier, RewardComponent

FORMAT_RULE = "the answer is exactly four digits"


def components(example: Example, response: str) -> tuple[RewardComponent, ...]:
    """(correct, format) of a decoded response (surrounding whitespace ignored)."""
    text = response.strip()
    correct = text.isdigit() and text.isascii() and int(text) == int(example.answer)
    formatted = len(text) == 4 and text.isdigit() and text.isascii()
    return (RewardComponent("correct", float(correct), str(example.answer)),
            RewardComponent("format", float(formatted), FORMAT_RULE))


VERIFIER = ComponentVerifier(("correct", "format"), components)


def task() -> Task:
    """data.task=addition_parts (megapo.tasks.registry): addition's problems, scalar reward exact_match, components
    correct and format."""
    base = addition.task()
    return Task("addition_parts", base.sizes, base.example, reward="exact_match", components=VERIFIER)

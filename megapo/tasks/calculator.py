"""calculator: multiplication with a calculator tool, a multi-turn task the tiny model can learn.

    prompt     "47*85="
    answer     "3995"
    with tool  turn 1 "<tool>calc(47*85)</tool>"   observation "<result>3995</result>"   turn 2 "3995"
               (chat call format: <tool_call>{"name": "calc", "arguments": {"expression": "47*85"}}</tool_call>)
    direct     turn 1 "3995"                          the product written at once

Both operands have d digits (no leading zero), d in [min_digits, max_digits]; the difficulty is d. A tiny
model cannot multiply in its head, but it can copy the operands into a call and the result out of the
observation: the SFT warm start shows the tool in `tool_frac` of its demonstrations (the others answer
directly), so RL can raise the accuracy by calling the tool more often and more cleanly. The reward reads the
last turn only: 1.0 when it is the product.

Splits: a problem (a, b) is in test, validation or train by a hash of "a*b", so they are disjoint whatever
seeds a run uses; test and validation hold fixed problems, the same number per digit count, interleaved.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from megapo.envs.tools import CALL_FORMATS, CalculatorEnvironment
from megapo.tasks.base import Example, Task
from megapo.tasks.operand_pairs import OperandPairs, check_digit_range

MIN_DIGITS, MAX_DIGITS = 2, 3
SPLIT_SEED = 20261203
TEST_PER_DIGITS = 200
VALIDATION_PER_DIGITS = 100
TRAIN_SIZE = 1_000_000  # nominal: the i-th training example is drawn from i
PAIRS = OperandPairs(SPLIT_SEED, "*")


def split_of(a: int, b: int) -> str:
    return PAIRS.split_of(a, b)


def tool_call(expression: str, call_format: str) -> str:
    """The text of one calc call in `call_format` (megapo.envs.tools)."""
    if call_format == "plain":
        return f"<tool>calc({expression})</tool>"
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "</tool_call>"


def reward(response: str, answer: str) -> float:
    """1.0 when the last turn is the product (surrounding spaces aside), else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def example(a: int, b: int) -> Example:
    return Example(f"{a}*{b}=", str(a * b), {"a": a, "b": b}, difficulty=len(str(a)))


def task(min_digits: int = MIN_DIGITS, max_digits: int = MAX_DIGITS, tool_frac: float = 0.5,
         call_format: str = "plain") -> Task:
    """data.task=calculator; data.task_options: min_digits, max_digits (in [1, 6]), tool_frac (the share of SFT
    demonstrations that call the tool, in [0, 1]), call_format (plain | chat, megapo.envs.tools)."""
    check_digit_range(min_digits, max_digits, 6)
    if isinstance(tool_frac, bool) or not isinstance(tool_frac, (int, float)) or not 0 <= tool_frac <= 1:
        raise ValueError(f"tool_frac must be in [0, 1], got {tool_frac!r}")
    if call_format not in CALL_FORMATS:
        raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}")
    counts = max_digits - min_digits + 1
    get = PAIRS.getter(min_digits, max_digits, {"validation": VALIDATION_PER_DIGITS, "test": TEST_PER_DIGITS}, example)

    def demonstrations(examples: Sequence[Example], seed: int) -> list[list[str]]:
        """The policy turns of each demonstration (the observations between them come from the environment)."""
        use_tool = np.random.default_rng([seed, 3]).random(len(examples)) < tool_frac
        return [[tool_call(f"{ex.meta['a']}*{ex.meta['b']}", call_format), ex.answer] if tool else [ex.answer]
                for ex, tool in zip(examples, use_tool)]

    sizes = {"train": TRAIN_SIZE, "validation": VALIDATION_PER_DIGITS * counts, "test": TEST_PER_DIGITS * counts}
    return Task("calculator", sizes, get, reward="megapo.tasks.calculator:reward", demonstrations=demonstrations,
                environment=lambda: CalculatorEnvironment(call_format))

"""addition_cot: 2- to 6-digit addition whose response may show its work; the difficulty is the digit count.

    prompt    "47+85="
    answer    "132"                               (the reference: the sum, no leading zeros)
    terse     "132"
    scratchpad "7+5+0=12;4+8+1=13;132"           one column per digit, least significant first:
                                                  digit + digit + carry in = carry out and digit
    checked   "7+5+0=12;4+8+1=13;132;7+5+0=12;4+8+1=13;132"   the scratchpad done twice: a check that adds
                                                  no information (the answer is already written), the
                                                  redundant re-verification length control should cut

Both operands have d digits (no leading zero), d in [min_digits, max_digits]. The reward reads the final
answer only (the text after the last ";", or the whole response), so a policy may drop the scratchpad:
the SFT warm start teaches the formats (scratchpad_frac of the demonstrations show the columns, check_frac
of those do them twice), and RL can trade tokens (9 per digit and pass) for accuracy, more digits needing
the columns more, while the second pass is pure cost.

The summary trigger (stage anytime) is the separator: a response cut anywhere and followed by ";" asks for the sum,
which the reward reads as the text after the last ";" (graded last) or the first part without "=" (graded first).

`graded` says which written sum is graded: `last` (the default, above) or `first` (the first part without
"=", the whole response when there is none). Graded at the last sum, a slip in the check's second pass
changes the answer, so accuracy alone pushes RL to drop the check; graded at the first, the check comes after
the graded answer and cannot change it: redundant verification after the answer is found, which only a
length term has a reason to remove.

Splits: a problem (a, b) is in test, validation or train by a hash of "a+b", so they are disjoint whatever
seeds a run uses. Test and validation hold fixed distinct problems, the same number per digit count,
interleaved by digit count (so the first n of a split are balanced); the train split's i-th example is
a seeded draw of digit count min_digits + i mod (number of counts).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megapo.tasks.base import Example, Task
from megapo.tasks.operand_pairs import OperandPairs, check_digit_range

MIN_DIGITS, MAX_DIGITS = 2, 6
SPLIT_SEED = 20260415
TEST_PER_DIGITS = 200
VALIDATION_PER_DIGITS = 100
TRAIN_SIZE = 1_000_000  # nominal: the i-th training example is drawn from i, so any size would do
SEPARATOR = ";"
PAIRS = OperandPairs(SPLIT_SEED, "+")


def split_of(a: int, b: int) -> str:
    return PAIRS.split_of(a, b)


def scratchpad(a: int, b: int) -> str:
    """The column-by-column response of a + b (equal digit counts), ending with the sum."""
    carry, columns = 0, []
    for x, y in zip(str(a)[::-1], str(b)[::-1]):
        total = int(x) + int(y) + carry
        columns.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return SEPARATOR.join(columns + [str(a + b)])


def checked(a: int, b: int) -> str:
    """The scratchpad, then the same columns and sum again (the check)."""
    return SEPARATOR.join([scratchpad(a, b)] * 2)


def response_format(response: str) -> str:
    """terse (no columns), scratchpad (one pass) or checked (two or more passes: the sum written more than once)."""
    parts = response.strip().split(SEPARATOR)
    passes = sum("=" not in part for part in parts)  # a column holds "=", a written sum does not
    return "terse" if len(parts) == 1 else "scratchpad" if passes <= 1 else "checked"


def final_answer(response: str) -> str:
    """The answer a response gives: the text after its last separator (the whole text when there is none)."""
    return response.strip().rsplit(SEPARATOR, 1)[-1].strip()


def first_answer(response: str) -> str:
    """The first sum a response writes: its first part without "=" (the last part when every part has one)."""
    parts = [part.strip() for part in response.strip().split(SEPARATOR)]
    return next((part for part in parts if "=" not in part), parts[-1])


def reward(response: str, answer: str) -> float:
    """1.0 when the final answer equals the reference sum, whatever comes before it; else 0.0."""
    return 1.0 if final_answer(response) == answer.strip() else 0.0


def reward_first(response: str, answer: str) -> float:
    """1.0 when the first written sum equals the reference, whatever follows it (graded: first); else 0.0."""
    return 1.0 if first_answer(response) == answer.strip() else 0.0


REWARDS = {"last": "megapo.tasks.addition_cot:reward", "first": "megapo.tasks.addition_cot:reward_first"}


def uses_scratchpad(response: str) -> bool:
    return SEPARATOR in response


def example(a: int, b: int) -> Example:
    return Example(f"{a}+{b}=", str(a + b), {"a": a, "b": b}, difficulty=len(str(a)))


def task(min_digits: int = MIN_DIGITS, max_digits: int = MAX_DIGITS, scratchpad_frac: float = 0.5,
         check_frac: float = 0.0, graded: str = "last") -> Task:
    """data.task=addition_cot; data.task_options: min_digits, max_digits (in [1, 9]), scratchpad_frac (the
    share of SFT demonstrations that show the columns, in [0, 1]), check_frac (the share of those that do
    the columns twice, in [0, 1]), graded (last | first: which written sum the reward reads)."""
    check_digit_range(min_digits, max_digits, 9)
    if graded not in REWARDS:
        raise ValueError(f"graded must be one of {', '.join(REWARDS)}, got {graded!r}")
    for name, value in (("scratchpad_frac", scratchpad_frac), ("check_frac", check_frac)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    counts = max_digits - min_digits + 1
    get = PAIRS.getter(min_digits, max_digits, {"validation": VALIDATION_PER_DIGITS, "test": TEST_PER_DIGITS}, example)

    def demonstrations(examples: Sequence[Example], seed: int) -> list[str]:
        verbose = np.random.default_rng([seed, 1]).random(len(examples)) < scratchpad_frac
        twice = np.random.default_rng([seed, 2]).random(len(examples)) < check_frac
        write = {(True, False): scratchpad, (True, True): checked}
        return [write[(bool(v), bool(c))](ex.meta["a"], ex.meta["b"]) if v else ex.answer
                for ex, v, c in zip(examples, verbose, twice)]

    sizes = {"train": TRAIN_SIZE, "validation": VALIDATION_PER_DIGITS * counts, "test": TEST_PER_DIGITS * counts}
    return Task("addition_cot", sizes, get, reward=REWARDS[graded], demonstrations=demonstrations,
                response_kind=response_format, summary_trigger=SEPARATOR)

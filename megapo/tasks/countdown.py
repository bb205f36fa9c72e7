"""Countdown: reach a target from given numbers with + - * / (each number used at most once).

    prompt  "numbers 3 5 7 target 22:"        answer (reference) '{"numbers": [3, 5, 7], "target": 22}'
    a correct response: "3*5+7"

Problems are made by a seeded generator that builds a random expression over the drawn numbers,
so every problem is solvable. A problem belongs to the test, validation or train split by a hash of
(numbers, target), so the splits are disjoint whatever seeds draw them.
Reward: `megapo.tasks.countdown:reward` (usable as data.reward).
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from collections import Counter
from fractions import Fraction

from megapo.tasks.base import Example

SPLITS = ("train", "validation", "test")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def split_of(numbers: list[int], target: int) -> str:
    h = int(hashlib.sha256(f"{sorted(numbers)}:{target}".encode()).hexdigest(), 16) % 100
    return "test" if h < 5 else "validation" if h < 10 else "train"


def _make(rng: random.Random, count: int, max_number: int) -> tuple[list[int], int]:
    while True:
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        value = Fraction(numbers[0])
        for n in numbers[1:]:
            op = rng.choice("+-*")
            value = value + n if op == "+" else value - n if op == "-" else value * n
        if value.denominator == 1 and 0 < value <= 1000:
            shuffled = numbers[:]
            rng.shuffle(shuffled)
            return shuffled, int(value)


def example(numbers: list[int], target: int) -> Example:
    prompt = f"numbers {' '.join(map(str, numbers))} target {target}:"
    return Example(prompt, json.dumps({"numbers": numbers, "target": target}), {"numbers": numbers, "target": target})


def examples(split: str, n: int, seed: int = 0, count: int = 3, max_number: int = 20) -> list[Example]:
    """`n` distinct problems of `split`, drawn by a generator seeded with (seed, split)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{seed}:{split}")
    out, seen = [], set()
    while len(out) < n:
        numbers, target = _make(rng, count, max_number)
        key = (tuple(sorted(numbers)), target)
        if key in seen or split_of(numbers, target) != split:
            continue
        seen.add(key)
        out.append(example(numbers, target))
    return out


def evaluate_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """Exact value of an arithmetic expression and the integer literals it uses; None if it is not one
    (anything but integers, + - * /, unary minus and parentheses is refused; division by zero too)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None
    used: list[int] = []

    def walk(node) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ZeroDivisionError
                return left / right
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("not allowed")

    try:
        return walk(tree.body), used
    except (ValueError, ZeroDivisionError):
        return None


def reward(response: str, answer: str) -> float:
    """1.0 when the response (up to the first newline) is an expression equal to the target that uses
    only the given numbers, each at most as often as given; else 0.0."""
    ref = json.loads(answer)
    result = evaluate_expression(response.split("\n", 1)[0].split("=", 1)[0])
    if result is None:
        return 0.0
    value, used = result
    if Counter(used) - Counter(ref["numbers"]):
        return 0.0
    return 1.0 if value == ref["target"] else 0.0


def write_jsonl(path, split: str, n: int, seed: int = 0, **kwargs) -> int:
    """Write `n` problems as {"prompt", "answer"} rows, for a run config with
    data.train_files=[path] and data.reward="megapo.tasks.countdown:reward"."""
    with open(path, "w", encoding="utf-8") as fh:
        for ex in examples(split, n, seed, **kwargs):
            fh.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")
    return n

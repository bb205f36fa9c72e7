"""Reward functions: response text + reference answer -> float.

    reward_fn = get_reward("exact_match")          # or "math", or "my_pkg.my_mod:score"
    r = reward_fn(response_text, answer_text)

A user function is called as `fn(response: str, answer: str) -> float`.
Length shaping (DAPO's overlong penalty) is added on top by `shape_overlong`.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from fractions import Fraction
from typing import Callable

from megapo.config import ConfigError

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
BUILTIN = ("exact_match", "math")


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


# ----------------------------------------------------------------------------- math answers

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _to_number(text: str) -> Fraction | None:
    text = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    frac = re.fullmatch(r"\\[dt]?frac\{([-+]?\d+)\}\{(\d+)\}", text)
    if frac:
        text = f"{frac.group(1)}/{frac.group(2)}"
    text = text.rstrip(".").removesuffix("\\%").removesuffix("%")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return Fraction(int(num), int(den)) if int(den) != 0 else None
        value = float(text)
        return Fraction(value).limit_denominator(10**9) if math.isfinite(value) else None
    except ValueError:
        return None


def extract_answer(response: str) -> str | None:
    """The final answer of a solution: the last \\boxed{} if any, else the last number in the text."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def math_fallback(response: str, answer: str) -> float:
    """Normalised-number comparison: the response's final answer (last \\boxed{} or last number) and
    the reference, both read as exact fractions ("1,000" = "1000.0", "\\frac{1}{2}" = "0.5" = "1/2");
    non-numeric answers must match as whitespace-free strings."""
    got = extract_answer(response)
    if got is None:
        return 0.0
    ref = _last_boxed(answer) or answer
    a, b = _to_number(got), _to_number(ref)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if got.replace(" ", "") == ref.replace(" ", "") else 0.0


def _math_verify_fn() -> RewardFn | None:
    try:
        from math_verify import parse, verify  # type: ignore
    except ImportError:
        return None

    def math_verify_reward(response: str, answer: str) -> float:
        gold = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}")
        return 1.0 if verify(gold, parse(response)) else 0.0

    return math_verify_reward


# ----------------------------------------------------------------------------- lookup


def get_reward(spec: str, field: str = "data.reward") -> RewardFn:
    """Resolve a reward name or "module:function"; raise ConfigError naming `field` if it cannot."""
    if spec == "exact_match":
        return exact_match
    if spec == "math":
        fn = _math_verify_fn()
        if fn is not None:
            log.info("reward 'math': using math-verify")
            return fn
        log.warning("reward 'math': math-verify is not installed; using the normalised-number fallback "
                    "(pip install math-verify for symbolic equivalence)")
        return math_fallback
    if ":" not in spec:
        raise ConfigError(field, f"unknown reward {spec!r}; use one of {', '.join(BUILTIN)} or 'module:function'")
    module_name, func_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, f"cannot import reward module {module_name!r}: {exc}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(field, f"module {module_name!r} has no function {func_name!r}")
    return fn


def math_backend() -> str:
    """Which checker reward 'math' uses here: 'math-verify' or 'fallback'."""
    return "math-verify" if _math_verify_fn() is not None else "fallback"


# ----------------------------------------------------------------------------- length shaping


def shape_overlong(rewards: list[float], response_lens: list[int], max_len: int, buffer: int,
                   penalty: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (megapo.algorithms.shaping "dapo_overlong"): no change up to
    max_len - buffer tokens, then a penalty rising linearly to `penalty` at max_len (and beyond)."""
    import torch

    from megapo.algorithms.shaping import shape_rewards

    shaped = shape_rewards("dapo_overlong", torch.tensor(rewards, dtype=torch.float64),
                           torch.tensor(response_lens, dtype=torch.float64), max_len=max_len, cache_len=buffer,
                           factor=penalty)
    return shaped.tolist()

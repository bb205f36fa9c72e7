"""Reward functions: response text + reference answer -> float.

    reward_fn = get_reward("exact_match")          # or "math", or "my_pkg.my_mod:score"
    r = reward_fn(response_text, answer_text)

A user function is called as `fn(response: str, answer: str) -> float`; its signature is checked when
it is resolved. The trainer calls it through `GuardedReward`: the result must be a finite real number
(a bool counts as 0/1), it must come within data.reward_timeout_s, and a failure stops the run naming
the reward and the sample (data.reward_errors=fail) or scores 0 and is counted (zero). A response cut at
the length limit is not scored: it gets data.truncated_reward, whatever the reward function would say of
its unfinished text (GuardedReward.score_all's `truncated`). `check_reward` calls it once at start-up.
Length shaping (DAPO's overlong penalty and the other length rewards) comes after, in
megapo/trainer/length_stage.py.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import math
import numbers
import queue
import re
import threading
import weakref
from fractions import Fraction
from typing import Any, Callable, Sequence

from megapo.config import ConfigError, import_function

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
BUILTIN = ("exact_match", "math")
REWARD_ERRORS = ("fail", "zero")  # data.reward_errors
WARN_FIRST = 3  # with reward_errors=zero, failures logged one by one before only the count is kept


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

    # math-verify's own timeouts use SIGALRM, which works only in the main thread; elsewhere (GuardedReward's
    # worker thread, which times the call itself) they are turned off where this version allows it
    no_alarm = ({"parsing_timeout": None} if "parsing_timeout" in inspect.signature(parse).parameters else {},
                {"timeout_seconds": None} if "timeout_seconds" in inspect.signature(verify).parameters else {})

    def math_verify_reward(response: str, answer: str) -> float:
        parse_kw, verify_kw = ({}, {}) if threading.current_thread() is threading.main_thread() else no_alarm
        gold = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", **parse_kw)
        return 1.0 if verify(gold, parse(response, **parse_kw), **verify_kw) else 0.0

    return math_verify_reward


# ----------------------------------------------------------------------------- lookup


def get_reward(spec: str, field: str = "data.reward") -> RewardFn:
    """Resolve a reward name or "module:function"; raise ConfigError naming `field` if it cannot, or if
    the function cannot be called as fn(response, answer)."""
    fn = _resolve(spec, field)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: they fail at the start-up call instead
        return fn
    try:
        signature.bind("response", "answer")
    except TypeError:
        raise ConfigError(field, f"reward {spec!r} must take (response, answer); its signature is "
                          f"{fn.__name__}{signature}") from None
    return fn


def answer_checker(data) -> RewardFn:
    """The run's answer checker (data.reward, or the task's own when auto) that a response's first correct answer is
    found with: the length stage's step methods and filters, the stage decs."""
    from megapo.tasks.registry import reward_spec

    return get_reward(reward_spec(data), "data.reward")


def _resolve(spec: str, field: str) -> RewardFn:
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
    return import_function(spec, field, "reward")


class RewardError(RuntimeError):
    """A reward function failed on a sample: it raised, returned something other than a finite number,
    or did not return within data.reward_timeout_s. The message names the reward and the sample."""


class RewardTimeout(BaseException):
    """Raised into a reward's worker thread that ran past its timeout (stops a pure-Python loop; a
    BaseException so that the reward's own `except Exception` does not swallow it)."""


class GuardedReward:
    """`guarded(response, answer) -> float` around the reward `spec` (see the module docstring).

    With timeout_s > 0 the calls run on one persistent worker thread (`_RewardThread`), so a hung call
    can be abandoned; 0 calls the function in the caller's thread without a limit. One caller at a time.
    `pop_errors()`: failures scored 0 (errors="zero") since the last pop, for the metric reward/errors;
    `pop_truncated()`: (responses given truncated_reward, responses scored) since the last pop.
    `truncated_reward`: what a response flagged truncated gets (None: its text is scored like any other)."""

    def __init__(self, spec: str, timeout_s: float = 60.0, errors: str = "fail", field: str = "data.reward",
                 truncated_reward: float | None = 0.0):
        if errors not in REWARD_ERRORS:
            raise ConfigError("data.reward_errors", f"must be one of {', '.join(REWARD_ERRORS)}, got {errors!r}")
        self.spec = spec
        self.fn = get_reward(spec, field)
        self.timeout_s = float(timeout_s)
        self.errors = errors
        self._thread = _RewardThread() if self.timeout_s > 0 else None
        self._failures = 0  # since the last pop_errors()
        self._failures_total = 0
        self.truncated_reward = None if truncated_reward is None else float(truncated_reward)
        self._truncated = self._scored = 0  # since the last pop_truncated()

    def __call__(self, response: str, answer: str) -> float:
        return self.score_all([(response, answer)])[0]

    def score_all(self, pairs: list[tuple[str, str]], truncated: Sequence[bool] | None = None) -> list[float]:
        """The reward of every (response, answer), in order; a response whose `truncated` flag is set (cut
        at the length limit, no end-of-sequence) gets truncated_reward and is not passed to the function."""
        if truncated is None or self.truncated_reward is None:
            truncated = [False] * len(pairs)
        if len(truncated) != len(pairs):
            raise ValueError(f"{len(truncated)} truncated flags for {len(pairs)} responses")
        scores = iter(self._score([pair for pair, cut in zip(pairs, truncated) if not cut]))
        self._truncated += sum(map(bool, truncated))
        self._scored += len(pairs)
        return [self.truncated_reward if cut else next(scores) for cut in truncated]

    def _score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The function's reward of every pair. The list goes to the worker thread in one hand-off (one per
        call would cost more than the reward itself), each call still bounded by timeout_s; after a timeout
        the rest of the list runs on a fresh thread."""
        out: list[float] = []
        while len(out) < len(pairs):
            rest = pairs[len(out):]
            outcomes = (self._thread.call_many(self.fn, rest, self.timeout_s) if self._thread is not None
                        else [_outcome(self.fn, response, answer) for response, answer in rest])
            out.extend(self._settle(response, answer, *outcome) for (response, answer), outcome in zip(rest, outcomes))
        return out

    def _settle(self, response: str, answer: str, value: Any, error: BaseException | None) -> float:
        """One call's outcome as a reward: the number, or per data.reward_errors a RewardError or 0."""
        try:
            return self._checked(response, answer, value, error)
        except RewardError as err:
            if self.errors == "fail":
                raise
            self._failures += 1
            self._failures_total += 1
            if self._failures_total <= WARN_FIRST:
                log.warning("%s; scored 0 (data.reward_errors=zero)%s", err, "; further failures are only counted "
                            "in the metric reward/errors" if self._failures_total == WARN_FIRST else "")
            return 0.0

    def _checked(self, response: str, answer: str, value: Any, error: BaseException | None) -> float:
        if isinstance(error, RewardTimeout):
            raise RewardError(self._about(f"did not return within data.reward_timeout_s={self.timeout_s:g} s",
                                          response, answer)) from None
        if error is not None:
            raise RewardError(self._about(f"raised {type(error).__name__}: {error}", response, answer)) from error
        if type(value) is float and math.isfinite(value):  # the common case, without the ABC check below
            return value
        if isinstance(value, numbers.Real) and _finite(value):
            return float(value)
        raise RewardError(self._about(f"returned {_clip(value)} (a {type(value).__name__}); a reward must be a "
                                      "finite number", response, answer))

    def _about(self, problem: str, response: str, answer: str) -> str:
        return f"reward {self.spec!r} {problem}, on response {_clip(response)} with answer {_clip(answer)}"

    def pop_errors(self) -> int:
        count, self._failures = self._failures, 0
        return count

    def pop_truncated(self) -> tuple[int, int]:
        counts = (self._truncated, self._scored)
        self._truncated = self._scored = 0
        return counts

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more characters)"


def _outcome(fn: Callable, response: str, answer: str, catch: type[BaseException] = Exception):
    """(value, None) or (None, the exception) of one reward call; RewardTimeout always propagates."""
    try:
        return fn(response, answer), None
    except RewardTimeout:
        raise
    except catch as exc:
        return None, exc


class _Batch:
    """Reward calls run one after another on the worker thread; `outcomes` grows under `progress`."""

    def __init__(self, fn: Callable, pairs: list[tuple[str, str]]):
        self.fn, self.pairs = fn, pairs
        self.outcomes: list[tuple[Any, BaseException | None]] = []
        self.progress = threading.Condition()

    def run(self) -> None:
        for response, answer in self.pairs:
            outcome = _outcome(self.fn, response, answer, BaseException)  # any failure is the caller's to judge
            with self.progress:
                self.outcomes.append(outcome)
                self.progress.notify()


def _serve(jobs: queue.SimpleQueue) -> None:
    try:
        while (job := jobs.get()) is not None:
            job.run()
    except RewardTimeout:  # the interrupt of an abandoned thread landed in or between jobs
        pass


class _RewardThread:
    """One daemon thread that runs reward calls (a list per hand-off), so that the caller can stop waiting after a timeout
    without a thread per call. A call past its timeout is abandoned: its thread is sent RewardTimeout
    (which ends a pure-Python loop; a call blocked in C finishes on its own) and told to exit, and the
    next call starts a fresh thread. The thread also exits when this object is collected."""

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._finalizer = None

    def _start(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name="megapo-reward", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def call_many(self, fn: Callable, pairs: list[tuple[str, str]], timeout_s: float) -> list:
        """Outcomes (value, error) of fn on each pair, in order. When one call runs past timeout_s the
        thread is abandoned and the list ends early with that call's (None, RewardTimeout())."""
        if self._thread is None:
            self._start()
        job = _Batch(fn, pairs)
        self._jobs.put(job)
        with job.progress:
            while len(job.outcomes) < len(pairs):
                seen = len(job.outcomes)
                if not job.progress.wait_for(lambda: len(job.outcomes) > seen, timeout_s):
                    done = list(job.outcomes)
                    break
            else:
                return list(job.outcomes)
        self._abandon()
        return done + [(None, RewardTimeout())]

    def _abandon(self) -> None:
        thread = self._thread
        self.close()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(RewardTimeout))

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # tells the thread to exit after its current job
        self._jobs = self._thread = self._finalizer = None


def check_reward(spec: str, example, timeout_s: float, field: str = "data.reward") -> None:
    """Call the reward once before anything starts, on `example` (megapo.tasks.base.Example) with its
    reference answer as the response; ConfigError naming `field` when the call fails (whatever
    data.reward_errors says: a reward that fails on the reference itself is broken)."""
    guarded = GuardedReward(spec, timeout_s, "fail", field)
    try:
        guarded(example.answer, example.answer)
    except RewardError as err:
        raise ConfigError(field, f"start-up check: {err}") from None
    finally:
        guarded.close()


def math_backend() -> str:
    """Which checker reward 'math' uses here: 'math-verify' or 'fallback'."""
    return "math-verify" if _math_verify_fn() is not None else "fallback"

"""Tool calls in a policy turn, and an environment that runs them.

Two call formats:
    plain   <tool>calc(47*85)</tool>                    for raw prompts; the text in parentheses is the one argument
    chat    <tool_call>{"name": "calc", "arguments": {"expression": "47*85"}}</tool_call>
            the Hermes / Qwen chat templates' format; the arguments are keyword arguments
A turn without a call is the final answer. A turn that opens a call it does not close, or whose call does
not parse (no name(…) / no JSON object with a name), is a malformed call: the trajectory ends (parse_error).
A tool that raises ends it too (tool_error); the run goes on either way.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from megapo.envs.base import StepResult

CALL_FORMATS = ("plain", "chat")
_PLAIN = re.compile(r"<tool>\s*([A-Za-z_]\w*)\((.*?)\)\s*</tool>", re.S)
_CHAT = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_OPENERS = {"plain": "<tool>", "chat": "<tool_call>"}


class MalformedCall(ValueError):
    pass


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


def parse_tool_calls(text: str, call_format: str = "plain") -> list[ToolCall]:
    """The calls of one turn, in order ([] for a turn without one); MalformedCall for a broken one."""
    if call_format not in CALL_FORMATS:
        raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}")
    pattern = _PLAIN if call_format == "plain" else _CHAT
    matches = list(pattern.finditer(text))
    if text.count(_OPENERS[call_format]) != len(matches):
        raise MalformedCall(f"a {_OPENERS[call_format]} call is not closed or does not parse")
    if call_format == "plain":
        return [ToolCall(m.group(1), (m.group(2),)) for m in matches]
    return [_chat_call(m.group(1)) for m in matches]


def _chat_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        raise MalformedCall(f"tool call is not JSON: {err.msg}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise MalformedCall("tool call must be a JSON object with a string 'name'")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise MalformedCall("tool call 'arguments' must be a JSON object")
    return ToolCall(call["name"], (), tuple(sorted(arguments.items())))


# ----------------------------------------------------------------------------- the calculator tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10 ** 18


def calculate(expression: str) -> str:
    """An integer expression of + - * // % and parentheses, evaluated exactly; ValueError for anything else
    (names, powers, floats, division by zero, results beyond 1e18)."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return str(_value(tree.body))


def _value(node) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise ValueError(f"unsupported expression element {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("result out of range")
    return value


# ----------------------------------------------------------------------------- the environment


class ToolEnvironment:
    """Runs the tool calls of each policy turn and answers with their results (joined by newlines); a turn
    without a call ends the trajectory (its text is the final answer the verifier reads)."""

    def __init__(self, tools: dict[str, Callable[..., Any]], call_format: str = "plain"):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {', '.join(CALL_FORMATS)}, got {call_format!r}")
        self.tools = dict(tools)
        self.call_format = call_format

    def reset(self, example) -> None:
        return None

    def step(self, response: str) -> StepResult:
        try:
            calls = parse_tool_calls(response, self.call_format)
        except MalformedCall:
            return StepResult(done=True, finish="parse_error")
        if not calls:
            return StepResult(done=True, finish="answer")
        results = []
        for call in calls:
            tool = self.tools.get(call.name)
            if tool is None:
                return StepResult(done=True, finish="tool_error", tool_calls=len(calls))
            try:
                results.append(str(tool(*call.args, **dict(call.kwargs))))
            except Exception:  # noqa: BLE001 - a failing tool ends this trajectory, not the run
                return StepResult(done=True, finish="tool_error", tool_calls=len(calls))
        return StepResult(observation="\n".join(results), tool_calls=len(calls))


class CalculatorEnvironment(ToolEnvironment):
    """env.name=calculator: one tool, calc(expression) (`calculate`)."""

    def __init__(self, call_format: str = "plain"):
        super().__init__({"calc": calculate}, call_format)

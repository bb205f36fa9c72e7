"""`data.task` -> Task: a built-in name, or a user's "module:function" like data.reward.

    task = get_task("addition_cot", {"max_digits": 4})     # or "my_pkg.my_mod:make_task"

A task function is called with data.task_options as keyword arguments and returns a
megapo.tasks.base.Task. Every failure is a ConfigError naming data.task (or data.task_options).
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from typing import Any

from megapo.config import ConfigError, import_function
from megapo.tasks.base import Task

BUILTIN = {
    "addition": "megapo.tasks.addition:task",
    "addition_cot": "megapo.tasks.addition_cot:task",
    "addition_parts": "megapo.tasks.addition_parts:task",
    "calculator": "megapo.tasks.calculator:task",
}


def get_task(spec: str | Task, options: dict[str, Any] | None = None, field: str = "data.task") -> Task:
    """The Task of a name or "module:function" (a Task is returned as is)."""
    if isinstance(spec, Task):
        return spec
    return _cached(spec, json.dumps(options or {}, sort_keys=True), field)


@lru_cache(maxsize=16)
def _cached(spec: str, options_json: str, field: str) -> Task:
    make = _resolve(spec, field)
    options = json.loads(options_json)
    options_field = "data.task_options" if field == "data.task" else f"{field} options"
    try:
        inspect.signature(make).bind(**options)
    except TypeError as err:
        raise ConfigError(options_field, f"task {spec!r} takes {_parameters(make)}; {err}") from None
    except ValueError:  # no signature to check: the call below reports
        pass
    try:
        task = make(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(options_field, f"task {spec!r}: {err}") from None
    if not isinstance(task, Task):
        raise ConfigError(field, f"task {spec!r} returned a {type(task).__name__}, not a megapo.tasks.base.Task")
    return task


def _resolve(spec: str, field: str):
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise ConfigError(field, f"unknown task {spec!r}; built-in: {', '.join(BUILTIN)}, or 'module:function'")
    return import_function(target, field, "task")


def _parameters(fn) -> str:
    names = [p for p in inspect.signature(fn).parameters]
    return f"options {', '.join(names)}" if names else "no options"


def reward_spec(data_cfg) -> str:
    """data.reward with auto resolved: the task's own reward, else exact_match (files)."""
    if data_cfg.reward != "auto":
        return data_cfg.reward
    return get_task(data_cfg.task, data_cfg.task_options).reward if data_cfg.task else "exact_match"

"""env.name -> a factory of environments, one per trajectory (None: single-turn rollouts).

    make_env = env_factory("calculator", {"call_format": "plain"}, task)   # or "my_pkg.envs:MyEnv"
    env = make_env(example)

auto (the default): the task's own environment when it has one (Task.environment), else none. A built-in
name or a user's "module:Class" is called with env.options as keyword arguments for every trajectory.
Every failure is a ConfigError naming env.name or env.options, raised when the config is checked.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from megapo.config import ConfigError, import_function
from megapo.envs.base import Environment

BUILTIN = {"calculator": "megapo.envs.tools:CalculatorEnvironment"}


def env_factory(name: str, options: dict[str, Any] | None, task=None) -> Callable[[Any], Environment] | None:
    """The factory of env.name (None: no environment); one environment is built here to check the options."""
    options = dict(options or {})
    if name == "none" or (name == "auto" and getattr(task, "environment", None) is None):
        if options:
            raise ConfigError("env.options", f"given, but env.name={name!r} uses no environment")
        return None
    if name == "auto":
        if options:
            raise ConfigError("env.options", f"the task {task.name!r} builds its own environment; set env.name "
                                             "to pass options")
        make = task.environment
    else:
        target = BUILTIN.get(name, name)
        if ":" not in target:
            raise ConfigError("env.name", f"unknown environment {name!r}; built-in: {', '.join(BUILTIN)}, "
                                          "auto, none, or 'module:Class'")
        cls = import_function(target, "env.name", "environment")
        _check_options(cls, options, name)

        def make():
            return cls(**options)
    try:
        env = make()
    except (TypeError, ValueError) as err:
        raise ConfigError("env.options", f"environment {name!r}: {err}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError("env.name", f"environment {name!r} has no {' or '.join(missing)} method "
                                      "(megapo.envs.base.Environment)")
    return lambda example: make()


def _check_options(cls, options: dict, name: str) -> None:
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as err:
        takes = ", ".join(inspect.signature(cls).parameters) or "no options"
        raise ConfigError("env.options", f"environment {name!r} takes {takes}; {err}") from None
    except ValueError:  # no signature to check: building it reports
        pass

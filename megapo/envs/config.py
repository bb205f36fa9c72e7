"""The `env` section of the run config (EnvConfig): multi-turn rollouts with an environment, and the rules inside
it. Which environment env.name resolves to needs data.task: RunConfig.env_factory (megapo/trainer/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megapo.config import ConfigError, bounded


@dataclass
class EnvConfig:
    """Multi-turn rollouts with an environment (megapo/envs/): tool calls answered between policy turns."""

    # auto: the task's own environment when it has one (data.task=calculator), else single-turn | none |
    # a built-in (calculator) | "module:Class" of a user's environment (megapo.envs.base.Environment)
    name: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's class
    max_turns: int = bounded(4, ">= 1")  # policy turns per trajectory; one more ends it (finish max_turns)
    # tokens after the prompt per trajectory, policy turns and observations together (0: rollout.max_new_tokens
    # times max_turns); each turn is also cut at rollout.max_new_tokens
    max_total_tokens: int = bounded(0, ">= 0", "0: max_new_tokens x max_turns")

    def validate(self) -> None:
        """The rules of a multi-turn run (RunConfig calls it when env.name resolves to an environment)."""
        if self.max_total_tokens and self.max_total_tokens < 2:
            raise ConfigError("env.max_total_tokens", "must leave room for a turn and its stop token (>= 2)")

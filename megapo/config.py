"""Typed configuration: dataclasses loaded from YAML, with dotted command-line overrides.

    cfg = load_config(RunConfig, "run.yaml", ["algorithm.objective=ppo", "parallel.tp=2"])

Loading checks types and unknown fields (naming the dotted field and suggesting the closest
name); cross-field rules live in one `validate()` per config, so every bad input is refused with
a `ConfigError` naming the field before any process or allocation starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message starts with the dotted field name."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}" if field_name else message)


# ----------------------------------------------------------------------------- sections shared by
# the learner, the trainer and the launchers. The trainer's full run config is in trainer/config.py.


@dataclass
class ParallelConfig:
    """How the learner is split over processes. World size = tp * pp * dp; ep divides tp * dp."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    dispatcher: str = "alltoall"  # MoE token dispatcher: "alltoall" | "allgather"
    distributed_optimizer: bool = False
    recompute: bool = False  # full activation recompute
    fp8: bool = False  # Transformer Engine FP8 (GPU with TE only)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self, prefix: str = "parallel") -> None:
        for name in ("tp", "pp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{prefix}.{name}", f"must be an integer >= 1, got {value!r}")
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ConfigError(f"{prefix}.dispatcher", f"must be 'alltoall' or 'allgather', got {self.dispatcher!r}")
        if (self.tp * self.dp) % self.ep:
            raise ConfigError(
                f"{prefix}.ep",
                f"expert parallel size {self.ep} must divide tp*dp = {self.tp}*{self.dp} = {self.tp * self.dp}",
            )


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # "constant" | "cosine" | "linear"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0

    def validate(self, prefix: str = "optim") -> None:
        if not self.lr > 0:
            raise ConfigError(f"{prefix}.lr", f"must be > 0, got {self.lr}")
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"{prefix}.lr_schedule", f"must be constant, cosine or linear, got {self.lr_schedule!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"{prefix}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.grad_clip < 0:
            raise ConfigError(f"{prefix}.grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")


# ----------------------------------------------------------------------------- loading


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from a YAML file plus `a.b=value` overrides (values parsed as YAML), then validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError("", f"{path} must hold a mapping at the top level")
        data = loaded
    for item in overrides or []:
        apply_override(data, item)
    cfg = from_dict(cls, data)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(item, "override must look like section.field=value")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part} is not a section")
    node[parts[-1]] = value


def from_dict(cls: type, data: Any, prefix: str = ""):
    """Recursively build dataclass `cls` from plain data, checking field names and types."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(fields)}"
        raise ConfigError(_join(prefix, key), f"unknown field{hint}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(prefix, str(exc)) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _coerce(tp, value, name: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(name, f"{value!r} does not fit {tp}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, name)
    if tp is Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, f"expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        return [_coerce(item_tp, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(name, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {value!r}")
        return value
    return value

"""Typed configuration: dataclasses loaded from YAML, with dotted command-line overrides.

    cfg = load_config(RunConfig, "run.yaml", ["algorithm.objective=ppo", "parallel.tp=2"])

Loading checks types and unknown fields (naming the dotted field and suggesting the closest
name), that every number is finite (NaN and inf are refused everywhere, option dicts included), and
the range each field declares with `bounded(default, "> 0")`; cross-field rules live in one
`validate()` per config, so every bad input is refused with a `ConfigError` naming the field before
any process or allocation starts. YAML syntax errors name the file (or override) and the line.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import hashlib
import importlib
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
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
        self.message = message
        super().__init__(f"{field_name}: {message}" if field_name else message)


class InputError(ConfigError):
    """An input file is wrong (data, model folder, run folder); `field` is the file (and line, where known)."""


# ----------------------------------------------------------------------------- declared ranges

_BOUND = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")  # "> 0", ">= 1"
_INTERVAL = re.compile(r"^([\[(])\s*([^,]+),\s*([^\])]+)([\])])$")  # "(0, 1]", "[0, 1)"


@dataclass(frozen=True)
class Range:
    """Allowed values of a number field, written as in math: "> 0", ">= 1", "(0, 1]", "[0, 1)"."""

    text: str
    note: str = ""  # what a boundary value means, e.g. "0 disables"

    def __post_init__(self) -> None:
        if not (_BOUND.match(self.text) or _INTERVAL.match(self.text)):
            raise ValueError(f"range {self.text!r}: expected e.g. '> 0', '>= 1', '(0, 1]' or '[0, 1)'")
        self.contains(0.0)  # the bounds are numbers: float() raises here, where the field is declared

    def contains(self, value: float) -> bool:
        bound = _BOUND.match(self.text)
        if bound:
            op, limit = bound[1], float(bound[2])
            return {">": value > limit, ">=": value >= limit, "<": value < limit, "<=": value <= limit}[op]
        opening, lo, hi, closing = _INTERVAL.match(self.text).groups()
        above = value > float(lo) if opening == "(" else value >= float(lo)
        below = value < float(hi) if closing == ")" else value <= float(hi)
        return above and below

    def check(self, name: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
        if not self.contains(value):
            kind = f"in {self.text}" if self.text[0] in "[(" else self.text
            raise ConfigError(name, f"must be {kind}{f' ({self.note})' if self.note else ''}, got {value!r}")


def bounded(default, allowed: str, note: str = ""):
    """A dataclass field whose value must lie in `allowed` (see Range); the loader and `check_fields` check it."""
    return field(default=default, metadata={"range": Range(allowed, note)})


def check_creatable_dir(path: str, field_name: str) -> None:
    """`path` is a folder, or one can be made there: no file in its place or above it."""
    p = Path(path)
    for existing in (p, *p.parents):
        if existing.exists():
            if not existing.is_dir():
                what = "is a file" if existing == p else f"lies under {existing}, which is a file"
                raise ConfigError(field_name, f"{path} {what}; it must be a folder")
            return


def check_fields(cfg, prefix: str = "", recursive: bool = True) -> None:
    """Raise ConfigError naming the first field of dataclass `cfg` (and, recursive, of its sections) that is
    not finite or outside its declared range. The loader calls it on every section it builds; `validate()`
    methods call it too, so a config built in Python is held to the same rules."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = _join(prefix, f.name)
        _check_finite(value, name)
        if "range" in f.metadata:
            f.metadata["range"].check(name, value)
        if recursive and dataclasses.is_dataclass(value):
            check_fields(value, name)


def _check_finite(value, name: str) -> None:
    """NaN and inf are never a meaningful setting (an option that can be off takes null)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite(item, f"{name}[{i}]")


# ----------------------------------------------------------------------------- field docs
# A field's doc is written where it is declared, as comments: the lines right above it (no blank line
# between) and the comment at the end of its line. `megapo config show` prints them.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` -> its doc, read from the class's source ("" for an undocumented field)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = _comments(source)
    class_def = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    docs = {}
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = []
            line = node.lineno - 1
            while comments.get(line, (False, ""))[0]:  # a whole-line comment right above
                above.insert(0, comments[line][1])
                line -= 1
            trailing = [comments[n][1] for n in range(node.lineno, node.end_lineno + 1)
                        if n in comments and not comments[n][0]]
            docs[node.target.id] = " ".join(text for text in above + trailing if text)
    return docs


def _comments(source: str) -> dict[int, tuple[bool, str]]:
    """line -> (whether the comment is the whole line, its text without '#'), found with tokenize (so a '#'
    inside a string is not a comment)."""
    lines = source.splitlines()
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            found[row] = (not lines[row - 1][:col].strip(), tok.string.lstrip("#").strip())
    return found


# ----------------------------------------------------------------------------- sections shared by
# the learner, the trainer and the launchers. The trainer's full run config is in trainer/config.py.


@dataclass
class ParallelConfig:
    """How the learner is split over processes. World size = tp * pp * dp; ep divides tp * dp."""

    tp: int = bounded(1, ">= 1")  # tensor-parallel size
    pp: int = bounded(1, ">= 1")  # pipeline-parallel stages
    ep: int = bounded(1, ">= 1")  # expert-parallel size (divides tp * dp)
    dp: int = bounded(1, ">= 1")  # data-parallel replicas
    dispatcher: str = "alltoall"  # MoE token dispatcher: "alltoall" | "allgather"
    distributed_optimizer: bool = False  # shard the optimizer state over the data-parallel ranks (Megatron's)
    recompute: bool = False  # full activation recompute
    MOVED: typing.ClassVar[dict[str, str]] = {"fp8": "train.fp8 (none | e4m3 | hybrid) with train.precision=bf16"}

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def validate(self, prefix: str = "parallel") -> None:
        check_fields(self, prefix)
        for name in ("tp", "pp", "ep", "dp"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"{prefix}.{name}", f"must be an integer >= 1, got {getattr(self, name)!r}")
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ConfigError(f"{prefix}.dispatcher", f"must be 'alltoall' or 'allgather', got {self.dispatcher!r}")
        if (self.tp * self.dp) % self.ep:
            raise ConfigError(
                f"{prefix}.ep",
                f"expert parallel size {self.ep} must divide tp*dp = {self.tp}*{self.dp} = {self.tp * self.dp}",
            )


FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class OptimConfig:
    """The learner's Adam optimizer and learning-rate schedule."""

    lr: float = bounded(1e-3, "> 0")  # learning rate after warmup (where a cosine / linear decay starts)
    min_lr: float = bounded(0.0, ">= 0")  # where a cosine / linear schedule ends, at the last step
    lr_schedule: str = "constant"  # "constant" | "cosine" | "linear"
    warmup_steps: int = bounded(0, ">= 0")  # steps of linear warmup from 0 to lr
    weight_decay: float = bounded(0.0, ">= 0")  # Adam's weight decay
    adam_beta1: float = bounded(0.9, "[0, 1)")  # decay rate of the gradient's running mean
    adam_beta2: float = bounded(0.999, "[0, 1)")  # decay rate of the squared gradient's running mean
    adam_eps: float = bounded(1e-8, "> 0")  # added to the root of the squared-gradient mean
    grad_clip: float = bounded(1.0, ">= 0", "0 disables")  # the gradients' global norm is clipped to this
    # Undo a non-finite update (megapo/learner/guard.py) from a copy of this rank's parameters and Adam state,
    # refilled every step: one more set of them in memory, twice what the optimizer holds. False keeps no copy:
    # a non-finite gradient norm still skips the step before Adam; non-finite parameters after Adam then stop
    # the run with an error naming this field, and no checkpoint of the poisoned weights is written.
    restore_nonfinite: bool = True

    def validate(self, prefix: str = "optim") -> None:
        check_fields(self, prefix)
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ConfigError(f"{prefix}.lr_schedule", f"must be constant, cosine or linear, got {self.lr_schedule!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"{prefix}.min_lr", f"{self.min_lr} is above {prefix}.lr={self.lr}")
        first_step = self.lr / (1.0 - self.adam_beta1)  # Adam's bias-corrected step size at step 1
        if first_step >= FLOAT32_MAX:
            raise ConfigError(f"{prefix}.lr", f"{self.lr}: Adam's first step size lr / (1 - adam_beta1) = "
                              f"{first_step:.3g} is beyond float32 (max {FLOAT32_MAX:.3g})")


def import_function(spec: str, field: str, kind: str):
    """The function a config field names as 'module:function' (a user reward, a user task), or a ConfigError
    naming `field`: the module does not import, or holds no such callable."""
    module_name, func_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, f"cannot import {kind} module {module_name!r}: {exc}") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(field, f"module {module_name!r} has no function {func_name!r}")
    return fn


# ----------------------------------------------------------------------------- loading


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                validate: bool = True):
    """Build `cls` from a YAML file plus `a.b=value` overrides (values parsed as YAML), then validate
    (validate=False: field names, types and declared ranges only; no cross-field rule, no file read)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("", f"config file {path} does not exist")
        loaded = _parse_yaml(path)
        if not isinstance(loaded, dict):
            raise ConfigError("", f"{path} must hold a mapping at the top level")
        data = loaded
    for item in overrides or []:
        apply_override(data, item)
    validates = validate and hasattr(cls, "validate")  # validate() checks the fields, naming them its own way
    cfg = from_dict(cls, data, check=not validates)
    if validates:
        cfg.validate()
    return cfg


def config_digest(path: str | Path) -> str:
    """sha256 of a YAML config's parsed content: comments, key order and formatting do not change it, so a
    bench folder made before a comment edit still continues."""
    content = json.dumps(_parse_yaml(Path(path)), sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading floats as YAML 1.2 does: `1e-3` and `1E+38` are numbers, where YAML 1.1
    (PyYAML's default) wants a dot (`1.0e-3`) and reads `1e-3` as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _parse_yaml(path: Path):
    try:
        return _load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise InputError(str(path), f"not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        raise InputError(_yaml_where(str(path), err), f"not valid YAML: {_yaml_problem(err)}") from None


def _yaml_where(source: str, err) -> str:
    mark = getattr(err, "problem_mark", None)
    return f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source


def _yaml_problem(err) -> str:
    problem = getattr(err, "problem", None)
    context = getattr(err, "context", None)
    return " ".join(p for p in (context, problem) if p) or str(err).splitlines()[0]


def apply_override(data: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(item, "override must look like section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = _load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(key, f"value {raw!r} is not valid YAML: {_yaml_problem(err)}") from None
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part} is not a section")
    node[parts[-1]] = value


def from_dict(cls: type, data: Any, prefix: str = "", check: bool = True):
    """Recursively build dataclass `cls` from plain data, checking field names, types and (`check`) ranges."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        moved = getattr(cls, "MOVED", {})  # a field that moved names its new home
        if key in moved:
            raise ConfigError(_join(prefix, key), f"this field moved: use {moved[key]}")
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(fields)}"
        raise ConfigError(_join(prefix, key), f"unknown field{hint}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    try:
        cfg = cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(prefix, str(exc)) from None
    if check:
        check_fields(cfg, prefix, recursive=False)  # nested sections were checked when they were built
    return cfg


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
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # X | None: X's own error names the field inside it
            return _coerce(options[0], value, name)
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

"""`megapo config show CONFIG [section.field=value ...] [--check]` / `megapo config show --defaults [...]`.

Prints every section and field of the run config with its effective value, its default where the two differ,
its declared range and its doc (the comments written where the field is declared, megapo.config.field_docs).
The file and the overrides are loaded as `megapo train` loads them: unknown fields, types and ranges are refused
naming the field (exit 2); `--check` also applies train's cross-field rules, which read the model folder and
the data files.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import textwrap
import typing

import yaml

SUBCOMMAND = "action"  # megapo.cli names it in error messages: `megapo config show: ...`
DOC_WIDTH = 110


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest=SUBCOMMAND, metavar="ACTION", required=True)
    show = sub.add_parser("show", help="print the effective run config with each field's default, range and doc")
    show.add_argument("config", nargs="?", help="run config (YAML); with --defaults, an override like the rest")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10 algorithm.kl_coef=0.1")
    show.add_argument("--defaults", action="store_true", help="start from the built-in defaults, not a file")
    show.add_argument("--check", action="store_true",
                      help="also apply megapo train's cross-field rules (reads the model folder and data files)")


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    items = [args.config, *args.overrides] if args.config is not None else list(args.overrides)
    if args.defaults:
        path, overrides = None, items
    elif args.config is None:
        raise ConfigError("CONFIG", "give a run config file, or --defaults for the built-in defaults")
    else:
        path, overrides = args.config, args.overrides
    cfg = load_config(RunConfig, path, overrides, validate=args.check)
    try:
        print("\n".join(show_lines(cfg)).lstrip("\n"))
    except BrokenPipeError:  # `megapo config show ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def show_lines(cfg, prefix: str = "") -> list[str]:
    """The text of dataclass `cfg`: each field's `name = value  (default ...; range ...)` line and its doc,
    each section (a dataclass field) under a header with the section's docstring."""
    from megapo.config import field_docs

    cls = type(cfg)
    defaults, docs, hints = cls(), field_docs(cls), typing.get_type_hints(cls)
    lines: list[str] = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        value, section = getattr(cfg, f.name), _section_class(hints[f.name])
        if section is not None:
            lines += _section(name, value, section, docs[f.name])
            continue
        notes = [f"default {_text(getattr(defaults, f.name))}"] if value != getattr(defaults, f.name) else []
        if "range" in f.metadata:
            allowed = f.metadata["range"]
            notes.append(f"range {allowed.text}" + (f", {allowed.note}" if allowed.note else ""))
        lines.append(f"{name} = {_text(value)}" + (f"  ({'; '.join(notes)})" if notes else ""))
        lines += _wrapped(docs[f.name])
    return lines


def _section(name: str, value, section: type, field_doc: str) -> list[str]:
    """A section's header, its doc (the field's, else the class's), and its fields; an unset optional section
    (null) shows its defaults."""
    header = ["", f"[{name}]" + ("  = null; its fields when set:" if value is None else "")]
    body = show_lines(section() if value is None else value, name)
    return header + _wrapped(field_doc or _docstring(section)) + body


def _docstring(cls: type) -> str:
    """The class's own docstring ("" where dataclass() filled __doc__ with the signature)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def _section_class(hint) -> type | None:
    """The dataclass a field holds (a section), also when it is optional (`X | None`), else None."""
    if typing.get_origin(hint) in (list, tuple, dict):  # a list of entries (algorithm.distill.teachers) is a value
        return None
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return options[0] if len(options) == 1 and dataclasses.is_dataclass(options[0]) else None


def _text(value) -> str:
    """The value as it would be written in the YAML file or an override (an enum field: its value, e.g. r3)."""
    value = value.value if isinstance(value, enum.Enum) else value
    if isinstance(value, list):  # entries written as mappings, as in the YAML file
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).removesuffix("\n...\n").strip()


def _wrapped(doc: str) -> list[str]:
    return textwrap.wrap(doc, DOC_WIDTH, initial_indent="    ", subsequent_indent="    ") if doc else []

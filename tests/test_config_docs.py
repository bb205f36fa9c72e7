"""Every run-config field carries a doc where it is declared, and `megapo config show` prints each field's
effective value, its default where the two differ, its range and that doc."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from megapo.cli import main
from megapo.config import bounded, field_docs
from megapo.trainer.config import RunConfig

CONFIG = Path(__file__).resolve().parents[1] / "megapo/configs/tiny_moe_addition.yaml"


def _leaves(cls: type, prefix: str = ""):
    """(dotted name, owning class, field) of every non-section field under dataclass `cls`; each section
    (a dataclass field, optional or not) as ("name/", section class, field). A list of entries (e.g.
    algorithm.distill.teachers) is one field, shown as its value."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if typing.get_origin(hints[f.name]) is not list and dataclasses.is_dataclass(inner[0]):
            yield name + "/", cls, f, inner[0]
            yield from _leaves(inner[0], name)
        else:
            yield name, cls, f, None


def _has_own_docstring(cls: type) -> bool:
    return bool(cls.__doc__) and not cls.__doc__.startswith(f"{cls.__name__}(")  # dataclass() writes a signature


def test_every_field_of_every_section_has_a_doc():
    undocumented = [name for name, owner, f, section in _leaves(RunConfig)
                    if not field_docs(owner)[f.name] and not (section and _has_own_docstring(section))]
    assert not undocumented, "config fields without a doc (write a comment above the field or at the end of its " \
                             f"line): {', '.join(undocumented)}"


@dataclasses.dataclass
class _Documented:
    """A class written for the doc reader: each field's expected doc is spelled out in the test below."""

    # above, first line
    # above, second line
    both: int = bounded(1, ">= 0")  # trailing
    # a comment separated from the next field by a blank line belongs to nobody

    bare: str = "# not a comment"
    spread: dict = dataclasses.field(
        default_factory=dict)  # trailing on the last line of a field written over two
    alone: float = 0.5  # only trailing


def test_field_docs_reads_the_comments_above_and_at_the_end_of_the_line():
    assert field_docs(_Documented) == {"both": "above, first line above, second line trailing", "bare": "",
                                       "spread": "trailing on the last line of a field written over two",
                                       "alone": "only trailing"}


def _show(capsys, *argv) -> tuple[int, list[str], str]:
    rc = main(["config", "show", *argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def _line(lines: list[str], name: str) -> int:
    found = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
    assert len(found) == 1, f"{name}: expected one line, found {len(found)}"
    return found[0]


def test_show_prints_the_override_its_default_range_and_doc(capsys):
    rc, lines, err = _show(capsys, str(CONFIG), "algorithm.kl_coef=0.25")
    assert rc == 0, err
    i = _line(lines, "algorithm.kl_coef")
    assert lines[i] == "algorithm.kl_coef = 0.25  (default 0.0; range >= 0)"
    # a value the file sets: the file's value, then the dataclass default
    steps = yaml.safe_load(CONFIG.read_text())["train"]["steps"]
    assert steps != 100 and lines[_line(lines, "train.steps")].startswith(f"train.steps = {steps}  (default 100;")
    # a field neither sets: no default note, and its doc (the comment written beside the field) below it
    i = _line(lines, "train.updates_per_rollout")
    assert lines[i] == "train.updates_per_rollout = 1  (range >= 1)"
    assert lines[i + 1].strip() == "passes over each rollout batch"


def test_show_defaults_lists_every_field_once(capsys):
    rc, lines, err = _show(capsys, "--defaults", "rollout.n_samples=4")
    assert rc == 0, err
    for name, *_ in _leaves(RunConfig):
        if name.endswith("/"):
            assert any(line.startswith(f"[{name[:-1]}]") for line in lines), f"no header of section {name[:-1]}"
        else:
            _line(lines, name)
    assert lines[_line(lines, "rollout.n_samples")] == "rollout.n_samples = 4  (default 8; range >= 1)"
    assert lines[_line(lines, "model.tiny.layers")] == "model.tiny.layers = 2  (range >= 1)"  # null section: defaults


def test_show_refuses_bad_input_naming_it(capsys):
    rc, _, err = _show(capsys)
    assert rc == 2 and "megapo config show: CONFIG:" in err
    rc, _, err = _show(capsys, str(CONFIG), "train.stepz=3")
    assert rc == 2 and "train.stepz: unknown field; did you mean 'steps'?" in err
    rc, _, err = _show(capsys, str(CONFIG), "rollout.top_p=1.5")
    assert rc == 2 and "rollout.top_p: must be in (0, 1]" in err
    # a cross-field rule: show alone prints the config, --check applies megapo train's rules
    assert _show(capsys, str(CONFIG), "train.mini_batches=7")[0] == 0
    rc, _, err = _show(capsys, "--check", str(CONFIG), "train.mini_batches=7")
    assert rc == 2 and "train.mini_batches: must divide data.prompts_per_step" in err

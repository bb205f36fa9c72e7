"""The probe's case registry (CASES, filled by @case in the case-group modules) and the verdict helpers
every group uses: a refusal's classification with the state it must leave, and a config refusal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tools.probe.context import Ctx
from tools.probe.outcomes import Outcome, changed, classify, snapshot


CASES: dict[str, tuple[str, Callable, bool]] = {}  # name -> (class, function, cheap)


def case(cls: str, cheap: bool = True):
    def register(fn):
        CASES[fn.__name__] = (cls, fn, cheap)
        return fn
    return register


def refused(ctx: Ctx, out: Outcome, *names, rc: int = 2, watch: Path | None = None, before: dict | None = None,
            forbid: tuple[Path, ...] = (), traceback_ok: bool = False):
    """The verdict of a refusal: exit rc naming `names`; `watch` unchanged since `before`; no `forbid` path."""
    wrong = changed(before, snapshot(watch)) if watch is not None else None
    made = [str(p) for p in forbid if p.exists()]
    if made:
        wrong = (wrong + "; " if wrong else "") + f"written: {', '.join(made)}"
    return out, classify(out, rc=rc, names=names, wrong_state=wrong, traceback_ok=traceback_ok)


def config_refusal(ctx: Ctx, name: str, overrides: tuple[str, ...], names: tuple[str, ...], **sections):
    """`megapo train` with `overrides`: exit 2 naming `names`, the output folder never created."""
    folder = ctx.fresh(name)
    config = ctx.config(folder, **sections)
    out = ctx.train(config, *overrides)
    return refused(ctx, out, *names, forbid=(folder / "run",))

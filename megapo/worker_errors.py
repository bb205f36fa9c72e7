"""One line for a failure, also when it happened in a worker process.

A command that starts worker processes under torchrun (`megapo convert`, `megapo logprobs` with more than one
process, `megapo launch local` running `megapo train`; megapo/launch/local.py) gives them ERROR_DIR, a fresh
folder. A worker that fails writes `rank<R>.json` there (`record`): its one-line message, its exit code (2 for a
ConfigError: bad input; 1 for anything else, as megapo.cli.report_errors maps them) and when it failed; it prints
no traceback, unless MEGAPO_DEBUG=1. The command then reads the first failure (`first_failure`), ends its output
with `megapo <command>: <message>` and exits with that code (`WorkersFailed`, which megapo.cli.report_errors
prints). First: the earliest record, except that a failure raised only because another rank failed (every rank
raises together in megapo.integrity.check_finite_all_ranks; such an exception has `other_rank = True`) comes
after the ones that name the cause. A rank that lost its peer in a collective fails after that peer, so time
orders those. A worker that died without a record (a signal, the OOM killer) is described from what
megapo.launch.quiet_torchrun saw (LAUNCHER_RECORD).

A worker is a child of megapo.launch.quiet_torchrun (LAUNCHER_PID) with ERROR_DIR set; a process a worker starts
(an engine server, a checkpoint writer) inherits both but is no worker. Outside a worker nothing changes: a
command's unexpected exception keeps its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ERROR_DIR = "MEGAPO_ERROR_DIR"  # set by the command for its workers
LAUNCHER_PID = "MEGAPO_LAUNCHER_PID"  # set by megapo.launch.quiet_torchrun: the workers are its children
DEBUG = "MEGAPO_DEBUG"  # 1: workers print their traceback too
LAUNCHER_RECORD = "launcher.json"  # megapo.launch.quiet_torchrun: the first failure torchrun saw, or its signal
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


@dataclass
class Failure:
    message: str  # one line, without the command's name
    code: int  # the exit code the command returns
    rank: int = 0
    time: float = 0.0
    other_rank: bool = False  # raised because another rank failed: its record names the cause


class WorkersFailed(Exception):
    """A command's worker processes failed; `failure` is the first one (megapo.cli.report_errors prints it)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure
        self.code = failure.code


def debug() -> bool:
    return os.environ.get(DEBUG, "") not in ("", "0")


def in_worker() -> bool:
    """Whether this process is a worker torchrun started for a megapo command (not a process a worker started
    in turn, e.g. an engine server: those inherit the environment but report as usual)."""
    return bool(os.environ.get(ERROR_DIR)) and os.environ.get(LAUNCHER_PID) == str(os.getppid())


def describe(exc: BaseException) -> Failure:
    """The exception as one line and an exit code. megapo's own errors read as they are; another type is
    named, with where to find its traceback."""
    from megapo.config import ConfigError

    code = EXIT_BAD_INPUT if isinstance(exc, ConfigError) else EXIT_FAILED
    args = exc.args
    text = args[0] if isinstance(exc, KeyError) and len(args) == 1 and isinstance(args[0], str) else str(exc)
    text = " ".join(text.split()) or "(no message)"
    rank = int(os.environ.get("RANK", "0") or 0)
    if not type(exc).__module__.startswith("megapo."):
        text = f"{type(exc).__name__}: {text} (rank {rank}; {DEBUG}=1 prints the traceback)"
    return Failure(text, code, rank, time.time(), bool(getattr(exc, "other_rank", False)))


def report(prog: str, exc: BaseException) -> int:
    """The exit code for `exc`. In a worker: recorded for the command that started it (and its traceback
    printed with MEGAPO_DEBUG=1); elsewhere printed as `prog: <message>` on stderr."""
    failure = describe(exc)
    if not in_worker():
        print(f"{prog}: {exc}", file=sys.stderr)  # as megapo has always printed it
        return failure.code
    if debug():
        traceback.print_exception(exc, file=sys.stderr)
    record(failure)
    return failure.code


def record(failure: Failure, name: str | None = None) -> None:
    """Write `failure` into ERROR_DIR (atomically: the command may read while others still write)."""
    folder = Path(os.environ[ERROR_DIR])
    path = folder / (name or f"rank{failure.rank}.json")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(failure)))
    os.replace(tmp, path)


def guard(prog: str, fn, *args) -> int:
    """fn(*args) as a worker's body: an exception becomes `report(prog, exc)`'s exit code; outside a worker it
    propagates (with its traceback)."""
    try:
        return int(fn(*args) or 0)
    except Exception as exc:
        if not in_worker():
            raise
        return report(prog, exc)


def first_failure(folder: str | Path) -> Failure | None:
    """The first failure the workers recorded in `folder`, else what the launcher saw, else None."""
    folder = Path(folder)
    found = [_read(p) for p in sorted(folder.glob("rank*.json"))]
    found = [f for f in found if f is not None]
    if found:
        return min(found, key=lambda f: (f.other_rank, f.time, f.rank))
    return _read(folder / LAUNCHER_RECORD)


def _read(path: Path) -> Failure | None:
    try:
        return Failure(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None

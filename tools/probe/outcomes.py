"""What the bad-input probe observes and how it judges it: the paths of the checkout's venv and the timeouts,
a command's Outcome, a case's Result, the message line, the good/poor/wrong classifier, running a command
with a timeout, and the folder snapshots that show what a refusal wrote or changed.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
MEGAPO = ROOT / ".venv" / "bin" / "megapo"
CONFIG_TIMEOUT_S = 120  # a refusal before anything starts (imports and the tokenizer only, on a loaded machine)
RUN_TIMEOUT_S = 300  # a run that builds the learner


@dataclass
class Outcome:
    """What a command did: its argv, exit code and output."""

    command: list[str]
    rc: int | None  # None: killed at the timeout
    stdout: str = ""
    stderr: str = ""

    @property
    def text(self) -> str:
        return self.stderr + "\n" + self.stdout


@dataclass
class Result:
    cls: str
    name: str
    command: str
    rc: int | None
    message: str
    verdict: str  # good | poor | wrong
    reason: str
    seconds: float = 0.0


def message_line(out: Outcome) -> str:
    """The message's first line: megapo's `megapo <cmd>: ...` line when there is one, else the last line of stderr
    (a traceback's exception), else of stdout."""
    for line in out.stderr.splitlines():
        if re.match(r"^megapo [\w-]+( [\w-]+)?: ", line):
            return line.strip()[:400]
    for text in (out.stderr, out.stdout):
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()[:400]
    return ""


def classify(out: Outcome, *, rc: int = 2, names: tuple[str, ...] = (), wrong_state: str | None = None,
             traceback_ok: bool = False) -> tuple[str, str]:
    """(verdict, reason) of a refusal expected with exit code `rc`, its message naming each of `names`;
    `wrong_state`: what the case found written or changed that should not be (None: nothing)."""
    if out.rc is None:
        return "wrong", "hung: killed at the timeout"
    if out.rc == 0 and rc != 0:
        return "wrong", "accepted: exit 0 on a bad input" + (f"; {wrong_state}" if wrong_state else "")
    if wrong_state:
        return "wrong", wrong_state
    problems = []
    if out.rc != rc:
        problems.append(f"exit {out.rc}, expected {rc}")
    if "Traceback (most recent call last)" in out.text and not traceback_ok:
        problems.append("traceback")
    missing = [n for n in names if n not in out.text]
    if missing:
        problems.append(f"culprit not named ({', '.join(map(repr, missing))} absent)")
    if problems:
        return "poor", "; ".join(problems)
    return "good", f"exit {rc}" + (f", names {', '.join(names)}" if names else "")


def run(argv: list, *, timeout: float = CONFIG_TIMEOUT_S, env: dict | None = None, cwd: Path = ROOT) -> Outcome:
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              errors="replace")
        return Outcome(argv, proc.returncode, proc.stdout, proc.stderr)
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else b) or ""
        return Outcome(argv, None, text(exc.stdout), text(exc.stderr))


def snapshot(root: Path) -> dict[str, str | None]:
    """path -> sha256 of every file under root (None for folders): what a refusal must leave as it was."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def changed(before: dict, after: dict) -> str | None:
    if before == after:
        return None
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    edited = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = [f"{what}: {', '.join(names[:4])}" for what, names in
             (("written", added), ("removed", removed), ("changed", edited)) if names]
    return "the folder changed (" + "; ".join(parts) + ")"

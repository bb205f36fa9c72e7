"""The GPU kit's orchestrator: starts worker processes, watches their progress, kills one whose section runs past
its timeout or the global budget and starts another for the sections still to go; then the report's summary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tools.gpu_kit.context import REPO
from tools.gpu_kit.registry import BY_NAME, SECTIONS


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start_worker(args, names: list[str], work: Path, progress: Path) -> subprocess.Popen:
    # (no progress bars of model writes and loads: the log keeps to the sections' lines)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    if args.cpu_dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU path even where a GPU is present
    cmd = [sys.executable, "-m", "tools.gpu_check", "--worker", "--work", str(work), "--progress", str(progress),
           "--sections", ",".join(names), "--peak-tflops", str(args.peak_tflops)]
    if args.cpu_dry_run:
        cmd.append("--cpu-dry-run")
    return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)


def read_events(progress: Path, seen: int) -> tuple[list[dict], int]:
    if not progress.is_file():
        return [], seen
    lines = progress.read_text().splitlines()
    complete = [json.loads(line) for line in lines[seen:] if line.endswith("}")]
    return complete, seen + len(complete)


def watch_worker(proc, progress: Path, results: dict, deadline: float, max_section_s: float) -> None:
    """Record the worker's results until it exits or must be killed (a section past its timeout or the
    global deadline); a section it was running then gets "timeout" or an error naming the exit code."""
    seen, current, started = 0, None, 0.0
    while True:
        events, seen = read_events(progress, seen)
        for e in events:
            if e["event"] == "start":
                current, started = e["section"], time.time()
            else:
                results[e["section"]], current = e["result"], None
        code = proc.poll()
        if code is not None:
            events, seen = read_events(progress, seen)
            for e in events:
                if e["event"] == "end":
                    results[e["section"]], current = e["result"], None
            if current is not None:
                results[current] = {"status": "error", "error": f"worker process exited with code {code} "
                                    f"({signal_name(code)}) during this section", "seconds": time.time() - started}
            return
        now = time.time()
        limit = min(BY_NAME[current].timeout_s, max_section_s) if current is not None else 0.0
        if current is not None and (now - started > limit or now > deadline):
            kill_group(proc)
            why = "global budget" if now > deadline else f"section timeout {limit:.0f} s"
            results[current] = {"status": "timeout", "error": f"killed after {now - started:.0f} s ({why})",
                                "seconds": now - started}
            return
        if current is None and now > deadline:
            kill_group(proc)
            return
        time.sleep(0.2)


def signal_name(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return "signal"
    return "exit"


def orchestrate(args, work: Path) -> dict:
    names = [s.name for s in SECTIONS if not args.sections or s.name in args.sections]
    results: dict[str, dict] = {}
    deadline = time.time() + args.budget_s
    attempt = 0
    while True:
        pending = [n for n in names if n not in results]
        if not pending:
            break
        if time.time() > deadline - 5:
            for n in pending:
                results[n] = {"status": "skipped: time budget spent", "seconds": 0.0}
            break
        progress = work / f"progress_{attempt}.jsonl"
        attempt += 1
        worker = start_worker(args, pending, work, progress)
        try:
            watch_worker(worker, progress, results, deadline, args.max_section_s)
        finally:
            if worker.poll() is None:  # (this process was interrupted)
                kill_group(worker)
        if all(n not in results for n in pending) and time.time() <= deadline:  # it died before finishing any
            results[pending[0]] = {"status": "error", "error": "worker exited before this section ended",
                                   "seconds": 0.0}
    return {n: results[n] for n in names}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def summary_text(report: dict) -> str:
    lines = [f"gpu_check {report['mode']} {report['started']} total {report['total_s']:.0f} s "
             f"(budget {report['budget_s']:.0f} s)"]
    for name, r in report["sections"].items():
        lines.append(f"{name:14s} {r['status'][:60]:24s} {r.get('seconds', 0):6.1f} s  {r.get('summary', '')}")
    return "\n".join(lines) + "\n"

"""The bad-input and fault probe of issue 22, as a command anyone can rerun:

    .venv/bin/python -m tools.probe_inputs --out benchmarks/results/probe_inputs.json [--only NAME ...] [--cheap]

One small function per case, grouped by the issue's classes. Each case builds its inputs in a temp folder (one
tiny model, one tiny run with two checkpoints, shared by the cases that need them), runs the real command as a
subprocess (`.venv/bin/megapo ...`, with a timeout) and classifies the outcome against the expectation written
in the case:

- good: the expected exit code, the message naming the culprit (field, file, line, function), no traceback,
  nothing written that should not be;
- poor: the right refusal, but a traceback, another exit code or the culprit not named;
- wrong: accepted (exit 0 on a bad input) or wrong state left (files written or changed, a payload run).

The JSON holds every case (class, name, command, exit code, the message's first line, verdict, reason) and the
counts; a table is printed. tests/test_probe_inputs.py runs a few of the cheapest cases through these functions.

This file is the command line; the cases, the classifier and the runner live in tools/probe/ (one module per class
of cases, listed in tools/probe/catalog.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python tools/probe_inputs.py): the checkout's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.probe.catalog import CASES
from tools.probe.context import Ctx
from tools.probe.outcomes import Outcome, Result, changed, classify, message_line, snapshot
from tools.probe.runner import NOT_RECONSTRUCTED, counts, run_case, table

__all__ = ["CASES", "NOT_RECONSTRUCTED", "Ctx", "Outcome", "Result", "changed", "classify", "counts", "main",
           "message_line", "run_case", "snapshot", "table"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.probe_inputs", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/probe_inputs.json")
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--cheap", action="store_true", help="only the cases that build no learner")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (each is one subprocess at a time)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    names = [n for n, (_, _, cheap) in CASES.items() if (not args.cheap or cheap)]
    if args.only:
        unknown = sorted(set(args.only) - set(CASES))
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}")
        names = [n for n in names if n in args.only]
    if args.list:
        print("\n".join(f"{CASES[n][0]:44} {n}" for n in names))
        return 0
    root = Path(tempfile.mkdtemp(prefix="megapo_probe_"))
    ctx = Ctx(root)
    start = time.monotonic()
    done: dict[str, Result] = {}
    # the cases that build a learner first, so they overlap with the many cheap refusals
    order = sorted(names, key=lambda n: CASES[n][2])
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(run_case, ctx, name): name for name in order}
            for future in as_completed(futures):
                res = done[futures[future]] = future.result()
                print(f"[{time.monotonic() - start:6.0f}s] {res.verdict:5} {res.name}: {res.reason[:120]}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    results = [done[n] for n in names if n in done]
    report = {"command": "python -m tools.probe_inputs " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.monotonic() - start, 1),
              "counts": counts(results), "not_reconstructed": NOT_RECONSTRUCTED,
              "cases": [asdict(r) for r in results]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(results))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

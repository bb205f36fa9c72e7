"""`megapo objectives`: list every registered objective, estimator, correction, aggregation, KL
estimator and shaping, with granularity and source paper (`--formulas` adds each formula)."""

from __future__ import annotations

import argparse
import os
import sys

from megapo.algorithms.registry import KINDS, entries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, help="only entries of this kind")
    parser.add_argument("--formulas", action="store_true", help="print each entry's formula and options")


def run(args: argparse.Namespace) -> int:
    try:
        _print_table(args)
    except BrokenPipeError:  # `megapo objectives | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_table(args: argparse.Namespace) -> None:
    rows = [(e.name, e.kind, e.granularity, e.paper, e) for e in entries(args.kind)]
    header = ("name", "kind", "granularity", "paper")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(3)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols[:3], widths)) + "  " + cols[3]
    print(line(header))
    for row in rows:
        print(line(row))
        if args.formulas:
            entry = row[4]
            for text in entry.formula.splitlines():
                print("    " + text.strip())
            if entry.option_names():
                print(f"    options: {entry.option_names()}")

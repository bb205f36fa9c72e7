"""`megapo objectives`: list every registered objective, estimator, correction, aggregation, KL
estimator and shaping, with granularity, default (an objective's loss_agg when the config says "auto",
an estimator's fewest samples per prompt) and source paper (`--formulas` adds each formula)."""

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
    rows = [(e.name, e.kind, e.granularity, _default(e), e.paper, e) for e in entries(args.kind)]
    header = ("name", "kind", "granularity", "default", "paper")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(4)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols[:4], widths)) + "  " + cols[4]
    print(line(header))
    for row in rows:
        print(line(row))
        if args.formulas:
            entry = row[5]
            for text in entry.formula.splitlines():
                print("    " + text.strip())
            if entry.option_names():
                print(f"    options: {entry.option_names()}")


def _default(entry) -> str:
    """What the entry brings unless told otherwise: an objective its paper's loss_agg, an advantage
    estimator its minimum group size."""
    if entry.kind == "objective":
        return f"loss_agg={entry.loss_agg}"
    if entry.kind == "advantage":
        return f"n_samples>={entry.min_group}"
    return "-"

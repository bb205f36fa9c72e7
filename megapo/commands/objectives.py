"""`megapo objectives`: list every registered objective, estimator, correction, aggregation, KL
estimator and shaping, with granularity, default (an objective's loss_agg when the config says "auto",
an estimator's fewest samples per prompt) and source paper (`--formulas` adds each formula); `--stages` lists
the stages algorithm.stages may name, with their kind (sequence | token), the inputs they read and their paper."""

from __future__ import annotations

import argparse
import os
import sys

from megapo.algorithms.registry import KINDS, entries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, help="only entries of this kind")
    parser.add_argument("--formulas", action="store_true", help="print each entry's formula and options")
    parser.add_argument("--stages", action="store_true",
                        help="list algorithm.stages' stages: kind, inputs, paper (--formulas: and options)")


def run(args: argparse.Namespace) -> int:
    try:
        _print_stages(args) if args.stages else _print_table(args)
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


def _print_stages(args: argparse.Namespace) -> None:
    """algorithm.stages' stages in pipeline.STAGES order: name, kind, inputs, paper."""
    from megapo.algorithms.pipeline import STAGES, entry

    rows = [(name, d.kind, ",".join(_default_inputs(name)) or "-", entry(name).paper, entry(name))
            for name, d in STAGES.items()]
    header = ("name", "kind", "inputs", "paper")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(3)]
    line = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols[:3], widths)) + "  " + cols[3]
    print(line(header))
    for row in rows:
        print(line(row))
        if args.formulas and row[4].option_names():
            print(f"    options: {row[4].option_names()}")


def _default_inputs(name: str) -> tuple[str, ...]:
    """What stage `name` reads with its default options (future_drift: ref_logp; against=engine: rollout_logp)."""
    from megapo.algorithms.pipeline import STAGES, parse_stages
    from megapo.config import ConfigError

    try:
        return parse_stages([{"name": name}])[0].inputs
    except ConfigError:  # a renamed stage refuses every option set
        return STAGES[name].inputs

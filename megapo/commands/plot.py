"""`megapo plot RUN_DIR --out curves.png`: reward, response length, KL and held-out accuracy of a run
(megapo/trainer/plot.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megapo.trainer.plot import plot_run

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run's output_dir (holds metrics.jsonl)")
    parser.add_argument("--out", default="curves.png")


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError

    run_dir = Path(args.run_dir)  # a ConfigError here (or a damaged metrics line) is exit 2 (megapo.cli)
    if not run_dir.is_dir():
        raise ConfigError("run_dir", f"{run_dir} does not exist (or is not a folder)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError("run_dir", f"{run_dir} has no metrics.jsonl")
    counts = plot_run(run_dir, args.out)
    print(f"wrote {args.out} ({', '.join(f'{k}: {n} points' for k, n in counts.items())})")
    return 0

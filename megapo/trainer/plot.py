"""`megapo plot RUN_DIR --out curves.png`: reward, response length, KL and held-out accuracy of a run."""

from __future__ import annotations

import argparse
from pathlib import Path

PANELS = (("reward", "reward (mean)"), ("response_len", "response length (tokens)"), ("kl", "KL (to reference; without kl_coef: engine vs learner)"),
          ("eval/accuracy", "held-out accuracy"))


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number under `key`; a resumed run's repeated steps keep
    the last value written."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(row["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_run(run_dir: str | Path, out: str | Path) -> dict[str, int]:
    """Write the curves to `out` (PNG); return how many points each panel drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megapo.trainer.metrics import read_metrics

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    counts = {}
    for ax, (key, title) in zip(axes.flat, PANELS):
        steps, values = series(rows, key)
        counts[key] = len(steps)
        if steps:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return counts


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

"""Curves of a run (reward, response length, KL, held-out accuracy) from its metrics.jsonl; the command is
`megapo plot` (megapo/commands/plot.py)."""

from __future__ import annotations

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


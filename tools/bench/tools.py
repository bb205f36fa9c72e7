"""`megapo bench tools`: the multi-turn calculator task learns (issue 19): RL from its SFT warm start, per seed,
held-out accuracy and tool-call metrics against the warm start.

    megapo bench tools --out benchmarks/results/tools [--seeds 1] [--config CONFIG] [--set a.b=v ...]
    megapo bench tools --out benchmarks/results/tools --report-only

Each seed is one `megapo train CONFIG` run (train.seed = the seed) in OUT/seed-K (its metrics.jsonl and
samples.jsonl stay there, its checkpoints are removed after the run); a seed whose metrics already reach
train.steps is not run again. Writes OUT/summary.json (per seed: held-out accuracy at step 0, final, best; the
tool-call rate, parse and tool errors at the first and last eval; wall time), OUT/table.md and
OUT/curves.png (held-out accuracy and tool calls per trajectory over steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megapo.config import ConfigError, load_config
from megapo.trainer.config import RunConfig

DEFAULT_CONFIG = "megapo/configs/tiny_moe_calculator.yaml"
EVAL_KEYS = ("eval/accuracy", "eval/env/tool_calls", "eval/env/parse_errors", "eval/env/tool_errors",
             "eval/env/finish/answer", "eval/env/turns")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder of the runs and the report")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the run config (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=1, help="runs, train.seed 0..N-1 (default 1)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the runs there")


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise ConfigError("--seeds", f"must be >= 1, got {args.seeds}")
    out = Path(args.out)
    cfg = load_config(RunConfig, args.config,
                      list(args.set) + [f"train.output_dir={out / 'seed-0'}", f"model.path={out / 'base'}"])
    if cfg.env_factory() is None:
        raise ConfigError("env.name", f"{args.config} has no environment: this bench measures multi-turn runs")
    steps = cfg.train.steps
    for seed in range(args.seeds if not args.report_only else 0):
        run_dir = out / f"seed-{seed}"
        if last_step(run_dir) >= steps:
            continue
        argv = [sys.executable, "-m", "megapo.cli", "train", args.config, *args.set, f"train.seed={seed}",
                f"train.output_dir={run_dir}", f"model.path={out / 'base'}", "--overwrite"]
        start = time.perf_counter()
        print(f"bench tools: seed {seed}: {' '.join(argv[3:])}", flush=True)
        code = subprocess.call(argv)
        if code != 0:
            print(f"bench tools: seed {seed} exited {code}; see {run_dir}/train.log")
            return code
        (run_dir / "wall_s.json").write_text(json.dumps({"wall_s": round(time.perf_counter() - start, 1)}))
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    summary = write_report(out, args.config, steps)
    print(json.dumps(summary["seeds"], indent=1))
    return 0


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()), default=0)


def eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "eval/accuracy" in r]


def seed_summary(run_dir: Path) -> dict:
    evals = eval_rows(run_dir)
    first, last = evals[0], evals[-1]
    wall = run_dir / "wall_s.json"
    return {"run": run_dir.name, "steps": last["step"], "start_accuracy": first["eval/accuracy"],
            "final_accuracy": last["eval/accuracy"], "best_accuracy": max(r["eval/accuracy"] for r in evals),
            "gain": last["eval/accuracy"] - first["eval/accuracy"],
            "start": {k: first.get(k) for k in EVAL_KEYS}, "final": {k: last.get(k) for k in EVAL_KEYS},
            "wall_s": json.loads(wall.read_text())["wall_s"] if wall.is_file() else None}


def write_report(out: Path, config: str, steps: int) -> dict:
    runs = sorted(p for p in out.glob("seed-*") if (p / "metrics.jsonl").is_file())
    seeds = [seed_summary(p) for p in runs]
    summary = {"config": config, "steps": steps, "seeds": seeds}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["# Calculator tool task: held-out accuracy and tool use, warm start -> RL", "",
             f"Config `{config}`, {steps} steps; eval: greedy multi-turn on the test split.", "",
             "| run | acc start | acc final (best) | gain | tool calls / traj start -> final | parse errors "
             "start -> final | tool errors start -> final | wall s |", "|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        a, b = s["start"], s["final"]
        lines.append(f"| {s['run']} | {s['start_accuracy']:.3f} | {s['final_accuracy']:.3f} ({s['best_accuracy']:.3f}) "
                     f"| {s['gain']:+.3f} | {a['eval/env/tool_calls']:.3f} -> {b['eval/env/tool_calls']:.3f} "
                     f"| {a['eval/env/parse_errors']:.0f} -> {b['eval/env/parse_errors']:.0f} "
                     f"| {a['eval/env/tool_errors']:.0f} -> {b['eval/env/tool_errors']:.0f} | {s['wall_s']} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(runs, out / "curves.png")
    return summary


def plot(runs: list[Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, calls) = plt.subplots(1, 2, figsize=(10, 3.5))
    for run_dir in runs:
        evals = eval_rows(run_dir)
        steps = [r["step"] for r in evals]
        acc.plot(steps, [r["eval/accuracy"] for r in evals], marker="o", label=run_dir.name)
        calls.plot(steps, [r.get("eval/env/tool_calls", 0) for r in evals], marker="o", label=run_dir.name)
    acc.set(xlabel="RL step", ylabel="held-out accuracy", title="accuracy")
    calls.set(xlabel="RL step", ylabel="tool calls per trajectory", title="tool use")
    for ax in (acc, calls):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

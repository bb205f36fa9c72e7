"""`megapo bench distill`: does on-policy distillation from a stronger teacher help the student? Two runs of the
main job's recipe from one student, the same seed, with and without `algorithm.distill`, and their held-out curves.

    megapo bench distill --student HF_DIR --teacher HF_DIR --out DIR [--steps 60] [--coef 1.0] [--eval-every 20]
                         [section.field=value ...]

Both runs are `megapo train megapo/configs/tiny_moe_addition.yaml` with sft.enabled=false and model.path the
student (e.g. the main job's SFT warm start), the teacher e.g. the main job's final checkpoint converted to HF
(`megapo convert megatron-to-hf`). Writes DIR/summary.json (held-out accuracy per eval step of each run, the
final difference, the commands, machine load), DIR/curves.png, and each run's folder (DIR/rl, DIR/distill).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from megapo.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "megapo/configs/tiny_moe_addition.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--student", required=True, help="HF folder the student starts from")
    parser.add_argument("--teacher", required=True, help="HF folder of the teacher (the student's tokenizer)")
    parser.add_argument("--out", required=True, help="folder for the two runs, summary.json and curves.png")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("overrides", nargs="*", help="section.field=value for both runs")


def run_args(args, name: str) -> list[str]:
    out = Path(args.out) / name
    argv = [sys.executable, "-m", "megapo.cli", "train", str(CONFIG), f"model.path={args.student}",
            "sft.enabled=false", f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
            f"train.output_dir={out}", "train.ckpt_every=0", "train.log=[jsonl]", *args.overrides]
    if name == "distill":
        argv += [f"algorithm.distill.teacher={args.teacher}", f"algorithm.distill.coef={args.coef}"]
    return argv + ["--overwrite"]


def held_out(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([s for s, _ in points], [a for _, a in points], marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out exact-match")
    ax.set_title("on-policy distillation vs RL alone (same student, seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    for name in ("student", "teacher"):
        if not (Path(getattr(args, name)) / "config.json").is_file():
            raise ConfigError(f"--{name}", f"{getattr(args, name)} is not an HF model folder (no config.json)")
    if args.steps < 1 or args.eval_every < 1:
        raise ConfigError("--steps", "--steps and --eval-every must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commands, curves = {}, {}
    load_start = os.getloadavg()
    for name in ("rl", "distill"):
        argv = run_args(args, name)
        commands[name] = " ".join(argv[2:])
        print(f"bench distill: {name}: megapo {' '.join(argv[4:])}", flush=True)
        if subprocess.run(argv, cwd=REPO).returncode != 0:
            print(f"bench distill: the {name} run failed (see its output above)", file=sys.stderr)
            return 1
        curves[name] = held_out(out / name)
    plot(curves, out / "curves.png")
    final = {name: points[-1][1] for name, points in curves.items()}
    summary = {"benchmark": "distill", "argv": sys.argv, "student": str(args.student), "teacher": str(args.teacher),
               "steps": args.steps, "coef": args.coef, "held_out": curves, "final": final,
               "distill_minus_rl": final["distill"] - final["rl"], "commands": commands,
               "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"bench distill: held-out at step {args.steps}: RL {final['rl']:.3f}, RL + distillation "
          f"{final['distill']:.3f} ({summary['distill_minus_rl']:+.3f}); {out / 'summary.json'}")
    return 0

"""`megapo bench scaling`: the RL training step over a grid of learner layouts and tiny model sizes.

    megapo bench scaling --out DIR                                  # default grid, local gloo processes
    megapo bench scaling --layouts tp1,tp2,pp2 --sizes small --steps 1 --out DIR
    megapo bench scaling --layouts tp1,tp8,ep8,tp2xep8 --sizes medium --plan-only --out DIR   # a cluster
    megapo bench scaling --report DIR                               # JSON + plots from DIR/raw_world*.jsonl

Layouts are names like `tp2`, `pp2`, `ep2`, `tp2xep2`, `dp2`, `tp2xpp2`: parts `tpN`, `ppN`, `epN`,
`dpN` joined by `x`; a missing part is 1, except dp, which defaults to the smallest value that lets
ep divide tp*dp (so `ep2` is ep2 over dp2, `tp2xep2` is ep2 over the two TP ranks). World size = tp*pp*dp.

For each size a tiny Qwen3-MoE is written (megapo.models.tiny); each layout runs the RL step of
tools/bench/scaling_worker.py (generate on rank 0's embedded engine, old log-probs, train, weight sync)
with a fixed global batch (strong scaling) and a batch that grows with the processes (weak scaling).
Layouts of one world size share one torchrun launch. Results: DIR/scaling.json (per layout: phase
times, tokens/s per device, MFU on GPUs, peak memory per rank) and PNG plots.

On a cluster: `--plan-only` writes the models and one spec per world size and prints the per-rank
command; run that under `srun` (docs/scaling.md), then `--report DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from megapo.config import ConfigError, ParallelConfig
from megapo.progress import Progress
from megapo.layout import check_layout

# Tiny Qwen3-MoE widths (arguments of megapo.models.tiny.write_tiny_model). All have 4 layers'
# worth of divisibility for pp2, kv_heads 2 (tp <= 2) or 4 (tp <= 4), and 8 experts (ep <= 8).
SIZES: dict[str, dict] = {
    "small": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, topk=2, ffn=128,
                  moe_ffn=64, vocab=512),
    "medium": dict(layers=4, hidden=192, heads=4, kv_heads=2, head_dim=48, experts=8, topk=2, ffn=384,
                   moe_ffn=192, vocab=1024),
    "large": dict(layers=4, hidden=512, heads=8, kv_heads=4, head_dim=64, experts=8, topk=2, ffn=1024,
                  moe_ffn=512, vocab=2048),
}
DEFAULT_LAYOUTS = "tp1,tp2,pp2,ep2,tp2xep2,dp2"
DEFAULT_SIZES = "small,medium"
LOCAL_MAX_PROCS = 4  # gloo processes on one CPU machine
PEAK_TFLOPS_DEFAULT = 989.0  # H100/H200 SXM dense BF16; MFU is reported only on GPUs
PHASES = ("generate", "old_logp", "train", "weight_sync")


@dataclass
class Layout(ParallelConfig):
    """A learner layout with the name it was given on the command line (`tp2xep2`)."""

    name: str = ""


def parse_layout(name: str) -> Layout:
    """`tp2xep2` -> Layout(tp=2, ep=2, dp=1); ConfigError naming --layouts on anything else."""
    sizes: dict[str, int] = {}
    for part in name.strip().lower().split("x"):
        key, digits = part[:2], part[2:]
        if key not in ("tp", "pp", "ep", "dp") or not digits.isdigit() or int(digits) < 1:
            raise ConfigError("--layouts", f"unknown layout {name!r}: expected parts tpN, ppN, epN, dpN joined by "
                                           f"'x' (e.g. tp2, ep2, tp2xep2), got part {part!r}")
        if key in sizes:
            raise ConfigError("--layouts", f"layout {name!r} names {key} twice")
        sizes[key] = int(digits)
    tp, ep = sizes.get("tp", 1), sizes.get("ep", 1)
    dp = sizes.get("dp")
    if dp is None:
        dp = next(d for d in range(1, ep + 1) if (tp * d) % ep == 0)
    return Layout(name=name.strip().lower(), tp=tp, pp=sizes.get("pp", 1), ep=ep, dp=dp)


def hf_config(size: dict) -> dict:
    """The config.json fields of a tiny Qwen3-MoE of this size (what check_layout and ModelShape read)."""
    return {"model_type": "qwen3_moe", "num_hidden_layers": size["layers"], "hidden_size": size["hidden"],
            "num_attention_heads": size["heads"], "num_key_value_heads": size["kv_heads"],
            "head_dim": size["head_dim"], "intermediate_size": size["ffn"], "moe_intermediate_size": size["moe_ffn"],
            "num_experts": size["experts"], "num_experts_per_tok": size["topk"], "vocab_size": size["vocab"],
            "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}


@dataclass
class Plan:
    layouts: list[Layout]
    sizes: list[str]
    steps: int
    prompts: int
    n: int
    prompt_len: int
    max_new_tokens: int
    micro_batch_tokens: int
    bucket_mb: float


def check_plan(plan: Plan, max_procs: int | None) -> None:
    """Every refusal, before any model is written or process started."""
    if not plan.layouts:
        raise ConfigError("--layouts", "empty")
    names = [lay.name for lay in plan.layouts]
    if len(set(names)) != len(names):
        raise ConfigError("--layouts", f"listed twice: {sorted({n for n in names if names.count(n) > 1})}")
    if not plan.sizes:
        raise ConfigError("--sizes", "empty")
    for s in plan.sizes:
        if s not in SIZES:
            raise ConfigError("--sizes", f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    for name in ("steps", "prompts", "n", "prompt_len", "max_new_tokens", "micro_batch_tokens"):
        if getattr(plan, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", f"must be >= 1, got {getattr(plan, name)}")
    if not plan.bucket_mb > 0:
        raise ConfigError("--bucket-mb", f"must be > 0, got {plan.bucket_mb}")
    for lay in plan.layouts:
        if max_procs is not None and lay.world_size > max_procs:
            raise ConfigError("--layouts", f"layout {lay.name} needs {lay.world_size} processes; this launcher runs at most "
                                           f"{max_procs} (use --plan-only and srun for more)")
        for s in plan.sizes:
            try:
                check_layout(lay, hf_config(SIZES[s]))
            except ConfigError as err:
                raise ConfigError("--layouts", f"layout {lay.name} does not fit size {s!r}: {err}") from None
        if plan.prompts * plan.n < lay.dp:
            raise ConfigError("--prompts", f"{plan.prompts} prompts x n={plan.n} is fewer sequences than dp={lay.dp} "
                                           f"of layout {lay.name}")
    longest = plan.prompt_len + plan.max_new_tokens
    if longest > 512:  # tiny models have max_position_embeddings 512
        raise ConfigError("--max-new-tokens", f"prompt_len + max_new_tokens = {longest} exceeds the tiny models' 512")


# ----------------------------------------------------------------------------- running


def write_models(out: Path, sizes: list[str]) -> dict[str, str]:
    from megapo.models.tiny import write_tiny_model

    dirs = {}
    for s in sizes:
        path = out / "models" / s
        if not (path / "config.json").is_file():
            write_tiny_model(path, "qwen3_moe", **SIZES[s])
        dirs[s] = str(path)
    return dirs


def write_specs(out: Path, plan: Plan, model_dirs: dict[str, str]) -> dict[int, Path]:
    """One spec per world size: every (layout, size) run of that world, for one launch."""
    by_world: dict[int, list[dict]] = {}
    for lay in plan.layouts:
        for s in plan.sizes:
            by_world.setdefault(lay.world_size, []).append({
                "name": f"{s}/{lay.name}", "size": s, "layout": lay.name, "model_dir": model_dirs[s],
                "parallel": {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "dp": lay.dp}})
    specs = {}
    for world, runs in sorted(by_world.items()):
        path = out / f"spec_world{world}.json"
        path.write_text(json.dumps({"runs": runs, "steps": plan.steps, "prompts": plan.prompts, "n": plan.n,
                                    "prompt_len": plan.prompt_len, "max_new_tokens": plan.max_new_tokens,
                                    "micro_batch_tokens": plan.micro_batch_tokens, "bucket_mb": plan.bucket_mb},
                                   indent=1))
        specs[world] = path
    return specs


def worker_args(spec: Path, raw: Path) -> list[str]:
    return ["-m", "tools.bench.scaling_worker", "--spec", str(spec), "--out", str(raw)]


def run_local(specs: dict[int, Path], out: Path, timeout_s: float) -> None:
    from megapo.launch.local import run_torchrun

    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONWARNINGS": "ignore"}
    # units: the (layout, size) runs, each launch doing those of its world size; a bar on a terminal
    runs = {world: len(json.loads(spec.read_text())["runs"]) for world, spec in specs.items()}
    bar = Progress(sum(runs.values()), "scaling")
    bar.update(0)
    done = 0
    for world, spec in specs.items():
        raw = out / f"raw_world{world}.jsonl"
        raw.unlink(missing_ok=True)
        start = time.perf_counter()
        rc = run_torchrun(worker_args(spec, raw), nproc=world, timeout_s=timeout_s, env=env)
        if rc != 0:
            bar.close()
            raise RuntimeError(f"scaling: the {world}-process launch failed with exit code {rc}")
        done += runs[world]
        bar.line(f"scaling: {world}-process launch done in {time.perf_counter() - start:.0f} s "
                 f"({done}/{bar.total} runs)", done=done)
    bar.close()


# ----------------------------------------------------------------------------- report


def _phase_metrics(part: dict, shape, world: int, peak_tflops: float | None) -> dict:
    """Adds tokens/s per device, FLOPs and MFU (GPU only) to one strong/weak measurement."""
    t = part["time_s"]
    mean_len = part["tokens"] / part["sequences"]  # attention FLOPs from the mean length (all equal here)
    train_flops = part["tokens"] * shape.flops_per_token(mean_len / 2, train=True)
    fwd_flops = part["tokens"] * shape.flops_per_token(mean_len / 2, train=False)
    out = dict(part)
    out.update(
        tokens_per_s_per_device=part["tokens"] / t["step"] / world,
        train_tokens_per_s_per_device=part["tokens"] / t["train"] / world,
        train_flops=train_flops, old_logp_flops=fwd_flops,
        mfu=None if peak_tflops is None else train_flops / (t["train"] * world * peak_tflops * 1e12),
        old_logp_mfu=None if peak_tflops is None else fwd_flops / (t["old_logp"] * world * peak_tflops * 1e12))
    return out


def build_report(raw_rows: list[dict], peak_tflops: float, machine: dict) -> dict:
    from tools.bench.projection import ModelShape

    results = []
    on_gpu = any(r["device"] != "cpu" for r in raw_rows)
    for r in raw_rows:
        size = SIZES[r["size"]]
        shape = ModelShape.from_hf_config(hf_config(size), name=f"tiny-{r['size']}")
        gpu = r["device"] != "cpu"
        peak = peak_tflops if gpu else None
        row = {k: r[k] for k in ("name", "size", "layout", "parallel", "world_size", "device", "threads_per_rank",
                                 "peak_memory_bytes_per_rank", "peak_memory_kind",
                                 "rss_at_run_start_bytes_per_rank", "calibration_s")}
        row["peak_memory_bytes_max"] = max(r["peak_memory_bytes_per_rank"])
        mean_len = r["strong"]["tokens"] / r["strong"]["sequences"]
        row["model"] = {**size, "total_params": shape.total_params, "active_params": shape.active_params,
                        "hf_tensors": shape.hf_tensors,
                        "flops_per_token_train_at_mean_len": shape.flops_per_token(mean_len / 2, train=True)}
        row["strong"] = _phase_metrics(r["strong"], shape, r["world_size"], peak)
        row["weak"] = _phase_metrics(r["weak"], shape, r["world_size"], peak) if r["weak"] else row["strong"]
        results.append(row)
    # ratios within this run: against the single-process layout of the same size
    for row in results:
        base = next((b for b in results if b["size"] == row["size"] and b["world_size"] == 1), None)
        if base is None:
            row["strong_speedup_vs_1proc"] = row["weak_efficiency_vs_1proc"] = None
            continue
        row["strong_speedup_vs_1proc"] = base["strong"]["time_s"]["step"] / row["strong"]["time_s"]["step"]
        row["strong_train_speedup_vs_1proc"] = base["strong"]["time_s"]["train"] / row["strong"]["time_s"]["train"]
        row["weak_efficiency_vs_1proc"] = base["strong"]["time_s"]["step"] / row["weak"]["time_s"]["step"]
    cores = machine.get("cpu_cores")
    note = (f"CPU run: {cores} cores shared by all ranks (and other users), gloo: the numbers show megapo's "
            f"overheads per layout, not speedups" if not on_gpu else "GPU run")
    return {"benchmark": "scaling", "note": note, "device": "gpu" if on_gpu else "cpu", "machine": machine,
            "peak_tflops_for_mfu": peak_tflops if on_gpu else None,
            "definitions": {
                "time_s": "rank 0's phase times of the step with the median total over --steps (a barrier starts "
                          "each step); all steps are in time_s_per_step",
                "tokens_per_s_per_device": "batch tokens (prompt + response) / step time / world size",
                "train_tokens_per_s_per_device": "batch tokens / train phase time / world size",
                "mfu": "train FLOPs (6 * matmul active params + attention, from the model shape) / train time / "
                       "(world * peak_tflops); null on CPU",
                "strong": "fixed global batch (--prompts prompts x n samples) whatever the world size",
                "weak": "--prompts x world_size prompts (equal to strong at world 1)",
                "strong_speedup_vs_1proc": "step time of tp1 (same size) / step time of this layout",
                "weak_efficiency_vs_1proc": "step time of tp1 / weak step time of this layout (ideal 1.0)",
                "peak_memory": "per rank: RSS sampled every 10 ms on CPU, torch.cuda.max_memory_allocated on GPU; "
                               "runs of one launch share processes, so on CPU a later run's RSS includes what "
                               "earlier runs left allocated (see rss_at_run_start_bytes_per_rank)",
                "calibration_s": "rank 0's time for a fixed 256x256 matmul loop just before the run: the "
                                 "machine's speed at that moment (the CPU is shared), to judge cross-run noise"},
            "results": results}


def plot_report(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in report["results"]))
    colors = {"generate": "#4c72b0", "old_logp": "#dd8452", "train": "#55a868", "weight_sync": "#c44e52"}
    files = []
    for kind, title in (("strong", "strong scaling (fixed global batch)"), ("weak", "weak scaling (batch x processes)")):
        fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 3.8 * len(sizes)), squeeze=False)
        for i, size in enumerate(sizes):
            rows = sorted((r for r in report["results"] if r["size"] == size),
                          key=lambda r: (r["world_size"], r["layout"]))
            ax = axes[i][0]
            labels = [f"{r['layout']}\n({r['world_size']}p)" for r in rows]
            bottom = [0.0] * len(rows)
            for phase in PHASES:
                vals = [r[kind]["time_s"][phase] for r in rows]
                ax.bar(labels, vals, bottom=bottom, color=colors[phase], label=phase)
                bottom = [b + v for b, v in zip(bottom, vals)]
            ax.set_ylabel("seconds per RL step (median)")
            ax.set_title(f"{size}: step time by phase ({kind})")
            ax.legend(fontsize=8)
            ax = axes[i][1]
            base = next((r for r in rows if r["world_size"] == 1), None)
            worlds = sorted({r["world_size"] for r in rows})
            for r in rows:
                if base is None:
                    continue
                y = (base["strong"]["time_s"]["step"] / r["strong"]["time_s"]["step"] if kind == "strong"
                     else base["strong"]["time_s"]["step"] / r["weak"]["time_s"]["step"])
                ax.scatter(r["world_size"], y, s=30)
                ax.annotate(r["layout"], (r["world_size"], y), fontsize=8, xytext=(4, 2), textcoords="offset points")
            ideal = worlds if kind == "strong" else [1.0] * len(worlds)
            ax.plot(worlds, ideal, "k--", linewidth=1, label="ideal")
            ax.set_xlabel("processes")
            ax.set_ylabel("speedup vs 1 process" if kind == "strong" else "efficiency vs 1 process")
            ax.set_xticks(worlds)
            ax.set_title(f"{size}: {'speedup' if kind == 'strong' else 'weak-scaling efficiency'}")
            ax.legend(fontsize=8)
        fig.suptitle(f"megapo RL step, {title}\n{report['note']}", fontsize=10)
        fig.tight_layout()
        path = out / f"{kind}_scaling.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files


def machine_info() -> dict:
    return {"cpu_cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def report_dir(out: Path, peak_tflops: float, machine: dict | None = None) -> dict:
    raws = sorted(out.glob("raw_world*.jsonl"))
    if not raws:
        raise ConfigError("--report", f"no raw_world*.jsonl in {out}")
    rows = [json.loads(line) for p in raws for line in p.read_text().splitlines() if line.strip()]
    report = build_report(rows, peak_tflops, machine or machine_info())
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    report["plots"] = [str(p) for p in plot_report(report, out)]
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    return report


def print_summary(report: dict) -> None:
    print(report["note"])
    print(f"{'size/layout':<22}{'procs':>6}{'calib':>7}{'step s':>9}{'gen':>7}{'logp':>7}{'train':>7}{'sync':>7}"
          f"{'tok/s/dev':>11}{'speedup':>9}{'weak eff':>9}{'peak MiB':>10}")
    for r in report["results"]:
        t = r["strong"]["time_s"]
        sp, we = r.get("strong_speedup_vs_1proc"), r.get("weak_efficiency_vs_1proc")
        print(f"{r['name']:<22}{r['world_size']:>6}{r['calibration_s']:>7.3f}{t['step']:>9.2f}{t['generate']:>7.2f}"
              f"{t['old_logp']:>7.2f}"
              f"{t['train']:>7.2f}{t['weight_sync']:>7.2f}{r['strong']['tokens_per_s_per_device']:>11.0f}"
              f"{'-' if sp is None else f'{sp:.2f}':>9}{'-' if we is None else f'{we:.2f}':>9}"
              f"{r['peak_memory_bytes_max'] / 2**20:>10.0f}")


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma list (default {DEFAULT_LAYOUTS})")
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"comma list of {', '.join(SIZES)} (default {DEFAULT_SIZES})")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and batch (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (strong); x world size (weak)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=256)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="weight-sync bucket size")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_DEFAULT,
                        help="per-GPU peak for MFU (default: H100/H200 dense BF16)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per launch before it is killed")
    parser.add_argument("--plan-only", action="store_true",
                        help="write models and specs, print the per-rank command (for srun); start nothing")
    parser.add_argument("--report", metavar="DIR", default=None,
                        help="only aggregate DIR/raw_world*.jsonl into DIR/scaling.json and plots")
    parser.add_argument("--out", default=None, help="output folder")


def plan_from_args(args: argparse.Namespace) -> Plan:
    layouts = [parse_layout(n) for n in args.layouts.split(",") if n.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    return Plan(layouts, sizes, args.steps, args.prompts, args.n, args.prompt_len, args.max_new_tokens,
                args.micro_batch_tokens, args.bucket_mb)


def run(args: argparse.Namespace) -> int:
    if not args.peak_tflops > 0:
        raise ConfigError("--peak-tflops", f"must be > 0, got {args.peak_tflops}")
    if args.report:
        report = report_dir(Path(args.report), args.peak_tflops)
        print_summary(report)
        return 0
    if not args.out:
        raise ConfigError("--out", "required (the output folder)")
    plan = plan_from_args(args)
    check_plan(plan, None if args.plan_only else LOCAL_MAX_PROCS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    specs = write_specs(out, plan, write_models(out, plan.sizes))
    if args.plan_only:
        for world, spec in specs.items():
            raw = out / f"raw_world{world}.jsonl"
            print(f"world {world}: python -m torch.distributed.run --nnodes $NNODES --nproc-per-node $GPUS_PER_NODE "
                  f"--rdzv-backend c10d --rdzv-endpoint $HEAD:29500 {shlex.join(worker_args(spec, raw))}")
        print(f"then: megapo bench scaling --report {out}")
        return 0
    machine = machine_info()
    run_local(specs, out, args.timeout)
    report = report_dir(out, args.peak_tflops, machine)
    report["wall_s"] = time.perf_counter() - start
    (out / "scaling.json").write_text(json.dumps(report, indent=1))
    print_summary(report)
    print(f"wrote {out / 'scaling.json'} and {', '.join(Path(p).name for p in report['plots'])} "
          f"in {report['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from megapo.cli import report_errors

    parser = argparse.ArgumentParser(prog="megapo bench scaling", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return report_errors(parser.prog, run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

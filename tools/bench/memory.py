"""`megapo bench memory`: bytes per parameter of weights, gradients and optimizer state in fp32 and bf16, with and
without Megatron's distributed optimizer, measured on the tiny MoE model; the learner step time bf16 vs fp32 in the
same run; the same bytes per parameter carried to Qwen3-30B-A3B and DeepSeek-V3 layouts (arithmetic).

    megapo bench memory --out benchmarks/results/memory.json [--threads 1] [--steps 10] [--warmup 2]
                        [--layouts dp1-fp32,dp1-bf16,...] [--work-dir DIR]

Measured (tools/bench/memory_worker.py, one torchrun launch per world size, the layouts of a launch one after the
other in its processes): the learner (megapo.learner.Learner, precision fp32 or bf16 with fp32 main parameters) of
each layout takes --warmup + --steps REINFORCE train steps on one fixed batch (Adam's state exists only after a
step), then every rank counts the tensors it holds, numel * element_size (memory_worker.tensor_bytes): the model's
parameters, DDP's fp32 grad buffers (param.main_grad, each storage once), the optimizer's main parameters where
they are not the model's own (mixed precision) and Adam's exp_avg / exp_avg_sq; megapo's guard copy
(optim.restore_nonfinite) apart. Bytes per parameter = one rank's bytes / the model's total parameter count (all
of its parameters, on every rank together): a per-GPU figure. In the DP-only layouts every rank holds the whole
model, so it is also per parameter on that rank; in dp2-ep2 a rank holds half the experts. Padding: with the
distributed optimizer DDP's buffers are padded (each parameter to 64 elements, each bucket to lcm(DP, 128)); the
"exact" numbers count the tensors, "storage" the buffers with their padding.
Process memory (CPU: resident set size, before / after building / after the steps, and its sampled peak; GPU: the
CUDA allocator's counters) is recorded per layout; on CPU it is noise next to a 0.5 M-parameter model (Python,
Megatron and the activations dominate it), so the tensor sizes are the numbers to read.
Step time: the median of --steps train steps after --warmup, wall and this process's CPU seconds, rank 0; the
ratio bf16 / fp32 for each pair of layouts that differ only in precision. A measurement on this CPU, not a target.
Projected: GiB per GPU of weights + gradients + optimizer state (no activations) for Qwen3-30B-A3B and DeepSeek-V3
under stated layouts, from the measured bf16 (and fp32) bytes per parameter, optimizer state sharded over the data-
parallel ranks of each parameter (dense: DP; experts: expert-DP = TP * DP / (EP * ETP)) by the distributed optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GIB = 2 ** 30

# name -> the learner's layout (tp, pp: 1 unless given)
LAYOUTS = {
    "dp1-fp32": dict(dp=1, ep=1, precision="fp32", distributed_optimizer=False),
    "dp1-bf16": dict(dp=1, ep=1, precision="bf16", distributed_optimizer=False),
    "dp2-fp32": dict(dp=2, ep=1, precision="fp32", distributed_optimizer=False),
    "dp2-bf16": dict(dp=2, ep=1, precision="bf16", distributed_optimizer=False),
    "dp2-fp32-do": dict(dp=2, ep=1, precision="fp32", distributed_optimizer=True),
    "dp2-bf16-do": dict(dp=2, ep=1, precision="bf16", distributed_optimizer=True),
    # experts split over EP=2 at DP=2: expert-DP = 1, so the distributed optimizer cannot shard the experts' state
    "dp2-ep2-bf16-do": dict(dp=2, ep=2, precision="bf16", distributed_optimizer=True),
    # model-parallel layouts (not run by default; tests/test_plan.py checks `megapo plan` against them): TP=2 with the
    # experts over EP=2 (ETP = 1), and two pipeline stages, each at DP=1
    "tp2-ep2-bf16-do": dict(tp=2, dp=1, ep=2, precision="bf16", distributed_optimizer=True),
    "pp2-bf16-do": dict(pp=2, dp=1, ep=1, precision="bf16", distributed_optimizer=True),
}
DEFAULT_LAYOUTS = [n for n, lay in LAYOUTS.items() if lay.get("tp", 1) == lay.get("pp", 1) == 1]
# pairs whose step times are compared: (bf16 layout, fp32 layout)
PAIRS = {"dp1": ("dp1-bf16", "dp1-fp32"), "dp2": ("dp2-bf16", "dp2-fp32"), "dp2_do": ("dp2-bf16-do", "dp2-fp32-do")}
COMPONENTS = ("weights", "grads", "optimizer_main", "optimizer_moments")


# ----------------------------------------------------------------------------- measuring


def make_batch(vocab: int, sequences: int = 8, seed: int = 0) -> list[dict]:
    """One fixed train batch: `sequences` random token sequences of 48-96 tokens, a 16-token prompt each."""
    import random

    rng = random.Random(seed)
    batch = []
    for _ in range(sequences):
        n, p = rng.randrange(48, 97), 16
        batch.append(dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p,
                          advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (n - p)))
    return batch


def run_layouts(model_dir, names: list[str], *, steps: int, warmup: int, threads: int, work_dir,
                timeout_s: float = 600) -> dict[str, list[dict]]:
    """Every rank's raw result of each layout in `names` (memory_worker.run_layout), one launch per world size."""
    from megapo.launch.local import run_torchrun
    from megapo.layout import read_hf_config

    vocab = int(read_hf_config(model_dir)["vocab_size"])
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "PYTHONWARNINGS": "ignore"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    by_world: dict[int, list[dict]] = {}
    for name in names:
        layout = LAYOUTS[name]
        world = layout.get("tp", 1) * layout.get("pp", 1) * layout["dp"]
        by_world.setdefault(world, []).append(dict(layout, name=name))
    out: dict[str, list[dict]] = {}
    work = Path(work_dir)
    for world, layouts in sorted(by_world.items()):
        spec, raw = work / f"spec_world{world}.json", work / f"raw_world{world}.json"
        spec.write_text(json.dumps({"model": str(model_dir), "layouts": layouts, "steps": steps, "warmup": warmup,
                                    "threads": threads, "batch": make_batch(vocab)}))
        raw.unlink(missing_ok=True)
        rc = run_torchrun(["-m", "tools.bench.memory_worker", "--spec", str(spec), "--out", str(raw)], world,
                          timeout_s=timeout_s, env=env)
        if rc != 0:
            raise RuntimeError(f"memory bench: the {world}-process launch failed with exit code {rc}")
        for every in json.loads(raw.read_text())["results"]:
            out[every[0]["name"]] = every
    return {name: out[name] for name in names}


def summarize(ranks: list[dict]) -> dict:
    """One layout's numbers from its ranks' raw results: bytes per parameter per rank (rank bytes / the model's
    total parameter count), their max over ranks, the optimizer summed over ranks, step medians."""
    layout = ranks[0]["layout"]
    b0 = ranks[0]["bytes"]
    total = b0["params_on_rank"] - b0["expert_params_on_rank"] + b0["expert_params_on_rank"] * layout.get("ep", 1)
    if layout.get("tp", 1) * layout.get("pp", 1) > 1:  # a rank holds a TP shard / a stage: the model's own count
        total = b0["model_params_total"]

    def per_param(b: dict) -> dict:
        out = {k: b[k] / total for k in (*COMPONENTS, "optimizer_other", "guard_copy", "other_grads",
                                         "weights_storage", "grads_storage")}
        out["optimizer"] = out["optimizer_main"] + out["optimizer_moments"]
        out["total"] = out["weights"] + out["grads"] + out["optimizer"]
        out["total_with_guard"] = out["total"] + out["guard_copy"]
        return out

    per_rank = [per_param(r["bytes"]) for r in ranks]
    return {
        "layout": {k: v for k, v in layout.items() if k != "name"}, "world": len(ranks),
        "params_total": total, "params_on_rank": [r["bytes"]["params_on_rank"] for r in ranks],
        "bytes_per_param": per_rank[0],
        "bytes_per_param_max_over_ranks": {k: max(p[k] for p in per_rank) for k in per_rank[0]},
        "bytes_per_param_per_rank": per_rank,
        "bytes_per_param_per_rank_own_params": [
            {k: r["bytes"][k] / r["bytes"]["params_on_rank"] for k in (*COMPONENTS, "guard_copy")} for r in ranks],
        "optimizer_bytes_per_param_summed_over_ranks":
            sum(r["bytes"]["optimizer_main"] + r["bytes"]["optimizer_moments"] for r in ranks) / total,
        "main_params_summed_over_ranks": sum(r["bytes"]["main_params_numel"] for r in ranks),
        "bytes_per_rank": [r["bytes"] for r in ranks],
        "step_wall_median_s": ranks[0]["step_wall_median_s"], "step_cpu_median_s": ranks[0]["step_cpu_median_s"],
        "step_wall_median_s_per_rank": [r["step_wall_median_s"] for r in ranks],
        "step_wall_s": ranks[0]["step_wall_s"], "step_cpu_s": ranks[0]["step_cpu_s"],
        "build_s": ranks[0]["build_s"], "process_memory_per_rank": [r["process"] for r in ranks],
    }


def measure(model_dir, names: list[str] | None = None, *, steps: int = 5, warmup: int = 1, threads: int = 1,
            work_dir=None, timeout_s: float = 600) -> dict[str, dict]:
    """The measuring function: layout name -> summarize() of its ranks (names default: every layout)."""
    names = list(names or DEFAULT_LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        from megapo.config import ConfigError

        raise ConfigError("--layouts", f"unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        raw = run_layouts(model_dir, names, steps=steps, warmup=warmup, threads=threads, work_dir=work,
                          timeout_s=timeout_s)
    return {name: summarize(ranks) for name, ranks in raw.items()}


def step_ratios(layouts: dict[str, dict]) -> dict:
    """bf16 / fp32 step time (wall and CPU medians, rank 0) for each pair of layouts measured."""
    out = {}
    for key, (bf16, fp32) in PAIRS.items():
        if bf16 in layouts and fp32 in layouts:
            a, b = layouts[bf16], layouts[fp32]
            out[key] = {"layouts": [bf16, fp32],
                        "bf16_over_fp32_wall": a["step_wall_median_s"] / b["step_wall_median_s"],
                        "bf16_over_fp32_cpu": a["step_cpu_median_s"] / b["step_cpu_median_s"],
                        "bf16_wall_s": a["step_wall_median_s"], "fp32_wall_s": b["step_wall_median_s"]}
    return out


# ----------------------------------------------------------------------------- projection (arithmetic)


def deepseek_v3_counts() -> dict:
    """DeepSeek-V3's parameters by kind (config.json of deepseek-ai/DeepSeek-V3; the MTP module not counted: the
    671B of the model card is the main model). Per layer: MLA attention, 2 norms; layers 0-2 a dense MLP, 3-60 MoE:
    256 routed experts (2048 wide), 1 shared expert, a router (+ its expert bias)."""
    h, heads, q_lora, kv_lora, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    experts, moe_ffn, vocab = 256, 2048, 129280
    attention = (h * q_lora + q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora
                 + kv_lora * heads * (nope + v) + heads * v * h)
    return {"layers": 61, "dense_layers": 3, "hidden": h, "attention": attention, "norms": 2 * h,
            "dense_mlp": 3 * h * 18432, "routed": experts * 3 * h * moe_ffn, "shared": 3 * h * moe_ffn,
            "router": experts * h + experts, "embedding": vocab * h, "lm_head": vocab * h, "final_norm": h,
            "experts": experts, "topk": 8, "moe_ffn": moe_ffn}


def deepseek_v3_stages(tp: int, ep: int, stages: list[list[int]]) -> list[dict]:
    """Per-GPU parameters of each pipeline stage (`stages`: the decoder layers of each; the embedding on the first,
    the final norm and lm_head on the last): dense (attention, dense MLP, shared expert, embeddings split over TP;
    norms and router replicated) and expert (routed experts split over EP, ETP = 1)."""
    c = deepseek_v3_counts()
    out = []
    for i, layers in enumerate(stages):
        split, whole, expert = 0, 0, 0
        for layer in layers:
            split += c["attention"]
            whole += c["norms"]
            if layer < c["dense_layers"]:
                split += c["dense_mlp"]
            else:
                split += c["shared"]
                whole += c["router"]
                expert += c["routed"]
        if i == 0:
            split += c["embedding"]
        if i == len(stages) - 1:
            split += c["lm_head"]
            whole += c["final_norm"]
        out.append({"stage": i, "layers": [layers[0], layers[-1]], "dense": split // tp + whole,
                    "expert": expert // ep})
    return out


def qwen3_30b_stages(ep: int) -> list[dict]:
    from tools.bench.projection import MODELS

    m = MODELS["qwen3-30b-a3b"]
    return [{"stage": 0, "layers": [0, m.layers - 1], "dense": m.non_expert_params, "expert": m.expert_params // ep}]


def projection_layouts() -> list[dict]:
    """The layouts projected: name, model, GPUs, TP/PP/EP/ETP/DP, per-stage per-GPU parameter counts."""
    from tools.bench.projection import MODELS

    q = MODELS["qwen3-30b-a3b"]
    mbridge = [[0, 1, 2, 3]] + [list(range(4 + 4 * s, 8 + 4 * s)) for s in range(14)] + [[60]]
    even16 = [list(range(0, 4))] + [list(range(4 + 4 * s, 8 + 4 * s)) for s in range(14)] + [[60]]
    return [
        {"name": "qwen3-30b-a3b, 8 GPUs: EP=8, DP=8", "model": "qwen3-30b-a3b", "gpus": 8, "tp": 1, "pp": 1, "ep": 8,
         "etp": 1, "params_total": q.total_params, "params_active": q.active_params, "stages": qwen3_30b_stages(8),
         "note": "projection.py's default learner layout; expert-DP = 1: the experts' optimizer state is not sharded"},
        {"name": "qwen3-30b-a3b, 16 GPUs: EP=8, DP=16", "model": "qwen3-30b-a3b", "gpus": 16, "tp": 1, "pp": 1,
         "ep": 8, "etp": 1, "params_total": q.total_params, "params_active": q.active_params,
         "stages": qwen3_30b_stages(8), "note": "expert-DP = 2"},
        {"name": "deepseek-v3, 1024 GPUs: TP=2, PP=16, EP=64, DP=32", "model": "deepseek-v3", "gpus": 1024, "tp": 2,
         "pp": 16, "ep": 64, "etp": 1, "stages": deepseek_v3_stages(2, 64, mbridge),
         "note": "Megatron-Bridge's DeepSeek-V3 pretraining recipe parallelism (TP=2, PP=16, EP=64, ETP=1, stage "
                 "layout Et*4|(t*4|)*14tmL: the embedding + 4 layers, 14 x 4 layers, 1 layer + MTP + loss) at its "
                 "smallest world (EP * ETP must divide TP * DP: DP = 32); the MTP layer is not counted"},
        {"name": "deepseek-v3, 256 GPUs: PP=16, EP=16, DP=16", "model": "deepseek-v3", "gpus": 256, "tp": 1,
         "pp": 16, "ep": 16, "etp": 1, "stages": deepseek_v3_stages(1, 16, even16),
         "note": "the same stage layout on 256 GPUs; EP=64 cannot go with PP=16 on 256 GPUs (EP * ETP must divide "
                 "TP * DP = 16)"},
    ]


def per_gpu_bytes(stage: dict, bpp: dict, dp: int, edp: int, guard: bool) -> float:
    """Weights + grads + optimizer state of one GPU: each parameter's weights and grads whole, its optimizer state
    (main + moments) / the data-parallel ranks sharding it; `guard`: megapo's copy (optim.restore_nonfinite) on top,
    the weights whole and `guard_sharded` bytes per parameter / the ranks sharding it (the optimizer's tensors it
    copies, measured with the distributed optimizer)."""
    w, g, o = bpp["weights"], bpp["grads"], bpp["optimizer"]
    b = stage["dense"] * (w + g + o / dp) + stage["expert"] * (w + g + o / edp)
    if guard:
        og = bpp["guard_sharded"]
        b += stage["dense"] * (w + og / dp) + stage["expert"] * (w + og / edp)
    return b


def project(bytes_model: dict[str, dict]) -> list[dict]:
    """GiB per GPU of each projection layout under each precision's measured bytes per parameter."""
    out = []
    for lay in projection_layouts():
        dp = lay["gpus"] // (lay["tp"] * lay["pp"])
        edp = lay["tp"] * dp // (lay["ep"] * lay["etp"])
        row = {k: v for k, v in lay.items()}
        row.update(dp=dp, expert_dp=edp, gib_per_gpu={})
        if lay["model"] == "deepseek-v3":
            c = deepseek_v3_counts()
            row["params_total"] = (c["layers"] * (c["attention"] + c["norms"]) + c["dense_layers"] * c["dense_mlp"]
                                   + (c["layers"] - c["dense_layers"]) * (c["routed"] + c["shared"] + c["router"])
                                   + c["embedding"] + c["lm_head"] + c["final_norm"])
            row["params_active"] = row["params_total"] - (c["layers"] - c["dense_layers"]) * (
                c["experts"] - c["topk"]) * c["routed"] // c["experts"]
        for precision, bpp in bytes_model.items():
            for guard in (False, True) if bpp.get("guard_sharded") is not None else (False,):
                per_stage = [per_gpu_bytes(s, bpp, dp, edp, guard) / GIB for s in lay["stages"]]
                busiest = max(range(len(per_stage)), key=per_stage.__getitem__)
                key = precision + ("+guard" if guard else "")
                row["gib_per_gpu"][key] = {"max": per_stage[busiest], "busiest_stage": busiest,
                                           "per_stage": per_stage if len(per_stage) > 1 else None}
        out.append(row)
    return out


def bytes_model(layouts: dict[str, dict]) -> dict[str, dict]:
    """Unsharded bytes per parameter of each precision, from a layout without the distributed optimizer (or
    one with it, its optimizer summed over ranks); guard_sharded: what megapo's guard copies of the optimizer's
    tensors per parameter, before sharding (from the DP=2 distributed-optimizer layout: (guard - weights) x 2)."""
    out = {}
    for precision in ("bf16", "fp32"):
        for name in (f"dp1-{precision}", f"dp2-{precision}", f"dp2-{precision}-do"):
            if name in layouts:
                b = layouts[name]["bytes_per_param"]
                sharded_here = layouts[name]["layout"]["distributed_optimizer"]
                out[precision] = {"from": name, "weights": b["weights"], "grads": b["grads"],
                                  "optimizer": layouts[name]["optimizer_bytes_per_param_summed_over_ranks"]
                                  if sharded_here else b["optimizer"]}
                break
        sharded = layouts.get(f"dp2-{precision}-do")
        if precision in out:
            out[precision]["guard_sharded"] = None if sharded is None else (
                (sharded["bytes_per_param"]["guard_copy"] - sharded["bytes_per_param"]["weights"]) * 2)
    return out


# ----------------------------------------------------------------------------- command


def machine() -> dict:
    import torch

    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        import megatron.core

        megatron_version = megatron.core.__version__
    except Exception:  # noqa: BLE001 (only a description)
        megatron_version = None
    return {"cpu_count": os.cpu_count(), "cpu": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "megatron_core": megatron_version,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty_files": len(git("status", "--porcelain").splitlines())}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=10, help="timed train steps per layout (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed train steps per layout first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch's own)")
    p.add_argument("--work-dir", default=None, help="where the tiny model, specs and raw results go (default: a "
                                                    "temporary folder)")


def run(args: argparse.Namespace) -> int:
    from megapo.config import ConfigError
    from megapo.models.tiny import write_tiny_model

    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--threads", args.threads, 0)):
        if value < least:
            raise ConfigError(flag, f"must be >= {least}, got {value}")
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    if not names or any(n not in LAYOUTS for n in names):
        raise ConfigError("--layouts", f"choose from {', '.join(LAYOUTS)}, got {args.layouts!r}")
    load_start = os.getloadavg()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        model = write_tiny_model(work / "model", "qwen3_moe")
        layouts = measure(model, names, steps=args.steps, warmup=args.warmup, threads=args.threads,
                          work_dir=work)
    model_bytes = bytes_model(layouts)
    report = {
        "benchmark": "memory", "argv": sys.argv, "command": "megapo " + " ".join(sys.argv[1:])
        if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        "git": git_commit(), "machine": machine(), "threads": args.threads,
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "wall_s": time.perf_counter() - start,
        "model": {"family": "qwen3_moe", "tiny_model": "megapo.models.tiny.write_tiny_model defaults (2 layers, "
                  "8 experts top-2, hidden 64, vocab 512)",
                  "params_total": next(iter(layouts.values()))["params_total"]},
        "steps": args.steps, "warmup": args.warmup, "batch": "8 sequences of 48-96 tokens (16-token prompts), "
                                                             "REINFORCE, token-mean (make_batch)",
        "denominator": "bytes per parameter = one rank's bytes / the model's total parameter count (per GPU); "
                       "in the DP-only layouts every rank holds the whole model",
        "layouts": layouts,
        "step_time_ratio_bf16_over_fp32": step_ratios(layouts),
        "bytes_model": model_bytes,
        "projection": project(model_bytes),
        "notes": "Tensor sizes are the primary numbers (exact: numel * element_size; *_storage: the DDP buffers "
                 "with padding). grads are DDP's fp32 main_grad buffers in every precision, whole on every rank "
                 "(the distributed optimizer shards main parameters and Adam's moments, not the grad buffer). "
                 "guard_copy: megapo's copy for undoing a non-finite update (optim.restore_nonfinite=true, the "
                 "default), not part of Megatron's optimizer. Process memory on CPU (RSS) is noise at this model "
                 "size. Step times: layouts run one after the other in the same processes, on a shared CPU; bf16 "
                 "on a CPU without bf16 matrix units is not expected to be faster. Projection: arithmetic from "
                 "the measured bytes per parameter, no activations, no framework or allocator overhead.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print_summary(report, args.out)
    return 0


def print_summary(report: dict, out) -> None:
    print(f"{'layout':<18}{'weights':>9}{'grads':>8}{'optim':>8}{'total':>8}{'guard':>8}{'step s':>9}")
    for name, r in report["layouts"].items():
        b = r["bytes_per_param_max_over_ranks"]
        print(f"{name:<18}{b['weights']:>9.2f}{b['grads']:>8.2f}{b['optimizer']:>8.2f}{b['total']:>8.2f}"
              f"{b['guard_copy']:>8.2f}{r['step_wall_median_s']:>9.3f}")
    for key, r in report["step_time_ratio_bf16_over_fp32"].items():
        print(f"step time bf16/fp32 {key}: wall {r['bf16_over_fp32_wall']:.2f}, cpu {r['bf16_over_fp32_cpu']:.2f}")
    for row in report["projection"]:
        g = row["gib_per_gpu"]
        print(f"{row['name']}: " + ", ".join(f"{k} {v['max']:.1f} GiB" for k, v in g.items()))
    print(f"-> {out}")


if __name__ == "__main__":
    from megapo.cli import report_errors

    parser = argparse.ArgumentParser(prog="python -m tools.bench.memory")
    add_arguments(parser)
    raise SystemExit(report_errors(parser.prog, run, parser.parse_args()))

"""Benchmark: the learner's passes of one RL step on the main job's batch (megapo/configs/tiny_moe_addition.yaml:
its tiny Qwen3-MoE, 64 prompts x 8 samples, 8-token prompts, ~5-token responses, R3 routes, GSPO), this
checkout against a baseline revision, measured side by side. Writes JSON.

    megapo bench learner-passes --baseline cdaf2c2 --out benchmarks/results/learner_passes.json
    (or python -m tools.bench.learner_passes with the same arguments)

The baseline's megapo package (`git archive REV megapo`) runs the old-log-prob pass and the train step as
the trainer at REV did (train.micro_batch_tokens=512); this checkout runs the same and its other variants:
the same two passes with the baseline's packing (one row per micro-batch, row_tokens=512) and with
[rows x width] micro-batches, and the on-policy step without the separate pass at several budgets/widths.
Worker processes alternate (baseline, this checkout, ...) for --rounds rounds; inside a worker the variants
take turns step by step. Reported: medians per variant (wall and process CPU seconds per step) and ratios
to the baseline; CPU time is not inflated by waiting for a shared core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (name, micro_batch_tokens, row_tokens or None for the baseline's API, fused)
VARIANTS = [("two_pass_single_row_512", 512, 512, False), ("two_pass_rows_8192", 8192, 0, False),
            ("on_policy_8192", 8192, 0, True), ("on_policy_4096", 4096, 0, True), ("on_policy_2048", 2048, 0, True),
            ("on_policy_8192_w32", 8192, 32, True), ("on_policy_8192_w64", 8192, 64, True)]
BASELINE = ("baseline_two_pass_512", 512, None, False)


def main_job_batch(seed: int = 0, prompts: int = 64, n: int = 8, prompt_len: int = 8, vocab: int = 512,
                   layers: int = 2, topk: int = 2, experts: int = 8) -> list[dict]:
    """Train samples shaped as megapo.trainer.update.train_samples makes them for the main job (R3: the engine's routes)."""
    import numpy as np

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    batch = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for _ in range(n):
            response = rng.choices([4, 5, 6], [0.1, 0.85, 0.05])[0]  # 4 digits + end of sequence, mostly
            tokens = prompt + [rng.randrange(vocab) for _ in range(response)]
            routes = np.argsort(nrng.random((len(tokens) - 1, layers, experts)), axis=-1)[..., :topk]
            batch.append(dict(tokens=tokens, prompt_len=prompt_len, advantage=rng.uniform(-1.5, 1.5),
                              rollout_logp=[-rng.uniform(0.1, 3.0) for _ in range(response)],
                              routes=routes.astype(np.int32)))
    return batch


# ----------------------------------------------------------------------------- worker (either checkout)


def worker(spec: dict) -> dict:
    """Runs in a fresh process whose `megapo` is the checkout under test; only APIs both sides have."""
    import torch

    from megapo.config import OptimConfig, ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.replay import modes

    torch.manual_seed(0)
    batch = main_job_batch()
    learners = {}
    for name, budget, row_tokens, fused in spec["variants"]:
        kwargs = {} if row_tokens is None else {"row_tokens": row_tokens}
        learners[name] = Learner(spec["model"], ParallelConfig(), OptimConfig(lr=1e-6, grad_clip=1.0),
                                 micro_batch_tokens=budget, routing_replay=True, **kwargs)

    def step(name: str, fused: bool) -> dict:
        learner, samples = learners[name], [dict(s) for s in batch]
        t0, c0 = time.perf_counter(), time.process_time()
        if fused:
            modes.on_policy_step(learner, samples, "r3", "gspo", "seq-mean-token-mean")
            t1, c1 = t0, c0
        else:
            logps, _ = modes.old_logprobs(learner, samples, "r3")
            for s, lp in zip(samples, logps):
                s["old_logp"] = lp.tolist()
            t1, c1 = time.perf_counter(), time.process_time()
            learner.train_step(samples, "gspo", "seq-mean-token-mean")
        t2, c2 = time.perf_counter(), time.process_time()
        return {"old_logp_s": t1 - t0, "train_s": t2 - t1, "step_s": t2 - t0, "step_cpu_s": c2 - c0}

    out = {name: [] for name, *_ in spec["variants"]}
    for i in range(spec["steps"] + 1):  # the first step of each variant warms up
        order = spec["variants"] if i % 2 == 0 else spec["variants"][::-1]
        for name, _, _, fused in order:
            result = step(name, fused)
            if i:
                out[name].append(result)
    return out


# ----------------------------------------------------------------------------- driver


def baseline_tree(rev: str) -> Path:
    """`megapo` of revision `rev` unpacked into a temporary folder (git archive; reads the repository only)."""
    dest = Path(tempfile.mkdtemp(prefix="bench_baseline_"))
    archive = dest / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", rev, "megapo"], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def run_worker(spec: dict, pythonpath: str | None, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(Path(tmp) / "spec.json")],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(samples: list[dict]) -> dict:
    keys = samples[0].keys()
    return {f"median_{k}": statistics.median(s[k] for s in samples) for k in keys} | {"steps": len(samples)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megapo bench learner-passes")
    parser.add_argument("--out", help="JSON file written")
    parser.add_argument("--baseline", default="HEAD", help="git revision of the baseline megapo")
    parser.add_argument("--rounds", type=int, default=3, help="worker rounds (baseline, this checkout) x rounds")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of each worker")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return 0
    if not args.out:
        parser.error("--out is required")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")

    from megapo.config import load_config
    from megapo.models.tiny import write_tiny_model
    from megapo.trainer.config import RunConfig

    cfg = load_config(RunConfig, ROOT / "megapo" / "configs" / "tiny_moe_addition.yaml", [])
    t = cfg.model.tiny
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench_model_")), t.family, layers=t.layers,
                             experts=t.experts, topk=t.topk, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                             head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn, vocab=t.vocab, seed=t.seed)
    base_src = str(baseline_tree(args.baseline))
    results: dict[str, list] = {}
    for r in range(args.rounds):
        sides = [("baseline", [BASELINE], base_src), ("checkout", VARIANTS, str(ROOT))]
        for _, variants, src in (sides if r % 2 == 0 else sides[::-1]):
            spec = {"model": str(model), "variants": variants, "steps": args.steps}
            for name, steps in run_worker(spec, src, args.threads).items():
                results.setdefault(name, []).extend(steps)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary = {name: summarise(steps) for name, steps in results.items()}
    base = summary[BASELINE[0]]
    for name, s in summary.items():
        s["ratio_to_baseline_step"] = s["median_step_s"] / base["median_step_s"]
        s["ratio_to_baseline_cpu"] = s["median_step_cpu_s"] / base["median_step_cpu_s"]
    report = {"benchmark": "learner_passes", "baseline": args.baseline,
              "config": "megapo/configs/tiny_moe_addition.yaml",
              "batch": {"sequences": 512, "prompt_tokens": 8, "response_tokens": "4-6 (mostly 5)",
                        "routing_replay": "r3", "objective": "gspo"},
              "threads": args.threads, "rounds": args.rounds, "variants": {n: {"micro_batch_tokens": b, "row_tokens": w,
                                                                             "on_policy": f}
                                                                          for n, b, w, f in [BASELINE, *VARIANTS]},
              "summary": summary, "steps": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({n: {k: round(v, 3) for k, v in s.items() if k.startswith(("median_step", "ratio"))}
                      for n, s in summary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

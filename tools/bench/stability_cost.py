"""Benchmark: what the stability study's per-step metrics (megapo.replay.modes.stability_metrics) cost on the
stability grid's step (megapo/configs/stability_base.yaml: its tiny Qwen3-MoE, 64 prompts x 8 samples, bf16
embedded engine), measured side by side in one process. Writes JSON.

    python -m tools.bench.stability_cost --out benchmarks/results/stability/metrics_cost.json [--rounds 5]

Compared, each round in alternating order:
- engine.generate without and with the engine's routes (return_routes: needed for router/disagree off r3);
- the on-policy train step without replay, on a learner without and with a recording route hook (off-mode
  runs get the hook to compare their own routing with the engine's), the hook's side including the routes
  it recorded and the metrics;
- under r3: the on-policy step, and the extra forward pass with the learner's own routing (modes.free_routing)
  that mismatch/k3_free and router/* need (train.stability_metrics_every).
Reported: medians (wall seconds) and the extra costs as fractions of a whole step (generate + train).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "megapo" / "configs" / "stability_base.yaml"


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(rounds: int, seed: int = 0) -> dict[str, list[float]]:
    import torch

    from megapo.config import OptimConfig, load_config
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.learner.learner import Learner
    from megapo.models.tiny import write_tiny_model
    from megapo.replay import modes
    from megapo.trainer.config import RunConfig

    cfg = load_config(RunConfig, str(CONFIG), [])
    t = cfg.model.tiny
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench_model_")), t.family, layers=t.layers,
                             experts=t.experts, topk=t.topk, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                             head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn, vocab=t.vocab, seed=t.seed)
    engine = EmbeddedEngine(model, dtype=getattr(torch, cfg.rollout.compute_dtype(cfg.train.precision)), seed=seed)
    rng = random.Random(seed)
    optim = OptimConfig(lr=1e-6, grad_clip=1.0)
    budget = cfg.train.micro_batch_tokens
    learners = {"plain": Learner(model, cfg.parallel, optim, micro_batch_tokens=budget),
                "hook": Learner(model, cfg.parallel, optim, micro_batch_tokens=budget, routing_replay=True),
                "r3": Learner(model, cfg.parallel, optim, micro_batch_tokens=budget, routing_replay=True)}
    params = dict(n=cfg.rollout.n_samples, max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0)
    out: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        prompts = [[rng.randrange(3, 300) for _ in range(8)] for _ in range(cfg.data.prompts_per_step)]
        gens = {}
        for routes in ((False, True) if r % 2 else (True, False)):
            sampling = SamplingParams(**params, return_routes=routes)
            gens[routes], seconds = timed(lambda: engine.generate(prompts, sampling))
            out.setdefault(f"generate_routes_{routes}", []).append(seconds)
        batch = [dict(tokens=s.prompt_ids + s.output_ids, prompt_len=len(s.prompt_ids), advantage=rng.uniform(-1, 1),
                      rollout_logp=list(s.logprobs), engine_routes=s.routes) for g in gens[True] for s in g]
        steps = [("off_plain", "plain", "off"), ("off_hook", "hook", "off"), ("r3", "r3", "r3")]
        for name, learner, mode in (steps if r % 2 else steps[::-1]):
            samples = [dict(s, routes=s["engine_routes"]) if mode == "r3" else dict(s) for s in batch]
            _, seconds = timed(lambda: modes.on_policy_step(learners[learner], samples, mode, "ppo",
                                                            "seq-mean-token-mean"))
            out.setdefault(f"train_{name}", []).append(seconds)
        samples = [dict(s, routes=s["engine_routes"]) for s in batch]
        _, seconds = timed(lambda: modes.free_routing(learners["r3"], samples))
        out.setdefault("free_routing_pass", []).append(seconds)
        _, seconds = timed(lambda: modes.stability_metrics(samples, [torch.tensor(s["rollout_logp"]) for s in samples]))
        out.setdefault("stability_metrics_compute", []).append(seconds)
        if r == 0:
            out = {}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.stability_cost")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    samples = measure(args.rounds)
    med = {k: statistics.median(v) for k, v in samples.items()}
    step_off = med["generate_routes_False"] + med["train_off_plain"]
    step_r3 = med["generate_routes_True"] + med["train_r3"]
    ratios = {
        "engine_routes_extra_of_step": (med["generate_routes_True"] - med["generate_routes_False"]) / step_off,
        "off_hook_extra_of_step": (med["train_off_hook"] - med["train_off_plain"]) / step_off,
        "r3_free_pass_of_step": med["free_routing_pass"] / step_r3,
        "metrics_compute_of_step": med["stability_metrics_compute"] / step_off,
    }
    report = {"benchmark": "stability_cost", "config": str(CONFIG.relative_to(ROOT)), "rounds": args.rounds,
              "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None,
              "load_avg": os.getloadavg(), "median_s": med, "ratios": ratios, "samples_s": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"median_s": {k: round(v, 4) for k, v in med.items()},
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

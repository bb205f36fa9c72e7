"""Host memory of routing-replay routes: measured on one rollout batch of the tiny model, projected for a large one.

    megapo bench routes --out FILE.json [--prompts 64] [--samples 8] [--max-new 64]

Measured: the embedded engine draws one batch with routes on a tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers);
the bytes its samples' routes hold as megapo keeps them (the smallest integer type holding the expert ids,
megapo.replay.routes.route_dtype), after the learner's check (check_batch_routes), and what int64 would hold,
each counted from the arrays' nbytes. Projected: the same per-token arithmetic for a DeepSeek-V3-shaped model
(61 layers of which 58 MoE, 256 experts, top-8) on a batch of 64 prompts x 8 samples x 8192 tokens, written
out in the JSON next to the formula.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

# DeepSeek-V3 / Kimi-K2 shaped: 61 layers, the first 3 dense, 256 routed experts, 8 per token
LARGE = {"layers": 61, "moe_layers": 58, "experts": 256, "topk": 8, "prompts": 64, "samples": 8, "tokens": 8192}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--prompts", type=int, default=64, help="prompts in the measured batch")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=64, help="tokens per response")


def projected(shape: dict) -> dict:
    """Bytes of one batch's routes: positions x MoE layers x top-k x bytes per id."""
    from megapo.replay.routes import route_dtype

    ids = shape["prompts"] * shape["samples"] * (shape["tokens"] - 1) * shape["moe_layers"] * shape["topk"]
    compact = route_dtype(shape["experts"]).itemsize
    return {"shape": shape, "ids": ids, "dtype": str(route_dtype(shape["experts"])),
            "bytes": ids * compact, "bytes_int64": ids * 8, "gib": ids * compact / 2**30,
            "gib_int64": ids * 8 / 2**30,
            "formula": "prompts * samples * (tokens - 1) * moe_layers * topk * bytes per id"}


def measured(prompts: int, samples: int, max_new: int) -> dict:
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.models.tiny import write_tiny_model
    from megapo.replay.routes import RouteShape, check_batch_routes

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_tiny_model(model, "qwen3_moe")
        engine = EmbeddedEngine(model, seed=0)
        rng = np.random.default_rng(0)
        batch = [rng.integers(3, 30, size=int(n)).tolist() for n in rng.integers(6, 12, size=prompts)]
        groups = engine.generate(batch, SamplingParams(n=samples, max_new_tokens=max_new, return_routes=True))
        spec = engine.spec
    kept = [s.routes for g in groups for s in g]
    shape = RouteShape(spec.num_moe_layers, spec.topk, spec.experts)
    lengths = [len(s.prompt_ids) + len(s.output_ids) for g in groups for s in g]
    checked = check_batch_routes(kept, lengths, shape, "routes")
    ids = sum(r.size for r in kept)
    return {"model": {"moe_layers": spec.num_moe_layers, "experts": spec.experts, "topk": spec.topk},
            "samples": len(kept), "positions": sum(len(r) for r in kept), "ids": ids,
            "dtype": str(kept[0].dtype), "bytes_engine": sum(r.nbytes for r in kept),
            "bytes_learner_check": sum(r.nbytes for r in checked), "bytes_int64": ids * 8,
            "ratio_int64_over_kept": ids * 8 / max(sum(r.nbytes for r in kept), 1)}


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.samples, args.max_new) < 1:
        raise SystemExit("megapo bench routes: --prompts, --samples and --max-new must be >= 1")
    report = {"measured": measured(args.prompts, args.samples, args.max_new), "projected": projected(LARGE)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    m, p = report["measured"], report["projected"]
    print(f"measured: {m['samples']} samples, {m['positions']} positions, routes {m['bytes_engine']} B as {m['dtype']} "
          f"({m['ratio_int64_over_kept']:.0f}x less than int64); projected {p['gib']:.2f} GiB as {p['dtype']} "
          f"vs {p['gib_int64']:.2f} GiB int64 -> {args.out}")
    return 0

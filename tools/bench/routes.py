"""Host memory of routing-replay routes: measured on one rollout batch of the tiny model, projected for a large one.

    megapo bench routes --out FILE.json [--prompts 64] [--samples 8] [--max-new 64]

Measured: the embedded engine draws one batch with routes on a tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers);
the bytes its samples' routes hold as megapo keeps them (the smallest integer type holding the expert ids,
megapo.replay.routes.route_dtype), after the learner's check (check_batch_routes), and what int64 would hold,
each counted from the arrays' nbytes; and what each training rank receives of that batch with PP=2 (the tiny
model's layers split evenly over 2 pipeline stages, Megatron's default), rank 0 cutting each sample's routes to the
rank's stage's MoE-layer columns (megapo.trainer.handout.stage_groups) vs the whole batch every rank got when it was
broadcast: route bytes (nbytes of the cut arrays) and the whole pickled payload (tokens, log-probs, routes).
Projected: the same per-token arithmetic for a DeepSeek-V3-shaped model
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


def stage_moe_layers(moe_layers: list[bool], pp: int) -> list[list[int]]:
    """Each pipeline stage's MoE layers (their route columns: indices among the MoE layers) when `pp` stages hold
    the layers (moe_layers: per layer, MoE or dense) in equal contiguous shares, as Megatron splits them by default."""
    if len(moe_layers) % pp:
        raise ValueError(f"{len(moe_layers)} layers do not split evenly over {pp} pipeline stages")
    per = len(moe_layers) // pp
    column = np.cumsum(moe_layers) - 1
    return [[int(column[i]) for i in range(s * per, (s + 1) * per) if moe_layers[i]] for s in range(pp)]


def received(groups: list, stages: list[list[int]]) -> dict:
    """Bytes a training rank receives of rank 0's `groups` (megapo.trainer.rollout.Group) with pipeline stages
    holding MoE layers `stages`: today's broadcast (every rank the whole batch) vs megapo.trainer.handout.stage_groups
    (a rank of stage s other than rank 0 gets stage s's columns; rank 0 draws the batch and keeps it whole).
    Routes: nbytes of the arrays; payload: the pickled groups (tokens, log-probs, routes) the collective sends."""
    import pickle

    from megapo.trainer.handout import stage_groups

    def route_bytes(gs):
        return sum(s.routes.nbytes for g in gs for s in g.samples if s.routes is not None)

    def payload(gs):
        return len(pickle.dumps(gs, protocol=pickle.HIGHEST_PROTOCOL))

    by_stage = stage_groups(groups, [stages[0], *stages])[1:]  # what a rank (not rank 0) of each stage receives
    routes = [route_bytes(gs) for gs in by_stage]
    return {"pp": len(stages), "stage_moe_layers": stages,
            "route_bytes_broadcast": route_bytes(groups), "route_bytes_by_stage": routes,
            "payload_bytes_broadcast": payload(groups), "payload_bytes_by_stage": [payload(gs) for gs in by_stage],
            # torch's scatter_object_list pads every rank's message to the largest stage's
            "scatter_bytes_per_rank": max(payload(gs) for gs in by_stage),
            "route_ratio": route_bytes(groups) / max(max(routes), 1),
            "note": "per rank other than 0 (rank 0 draws the batch and keeps every MoE layer's routes)"}


def measured(prompts: int, samples: int, max_new: int) -> dict:
    from megapo.engines.base import SamplingParams
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.models.tiny import write_tiny_model
    from megapo.replay.routes import RouteShape, check_batch_routes
    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_tiny_model(model, "qwen3_moe")
        engine = EmbeddedEngine(model, seed=0)
        rng = np.random.default_rng(0)
        batch = [rng.integers(3, 30, size=int(n)).tolist() for n in rng.integers(6, 12, size=prompts)]
        groups = engine.generate(batch, SamplingParams(n=samples, max_new_tokens=max_new, return_routes=True))
        spec = engine.spec
        moe_pattern = list(spec.moe_layers)  # per layer: MoE or dense
    kept = [s.routes for g in groups for s in g]
    shape = RouteShape(spec.num_moe_layers, spec.topk, spec.experts)
    lengths = [len(s.prompt_ids) + len(s.output_ids) for g in groups for s in g]
    checked = check_batch_routes(kept, lengths, shape, "routes")
    ids = sum(r.size for r in kept)
    return {"model": {"moe_layers": spec.num_moe_layers, "experts": spec.experts, "topk": spec.topk},
            "samples": len(kept), "positions": sum(len(r) for r in kept), "ids": ids,
            "dtype": str(kept[0].dtype), "bytes_engine": sum(r.nbytes for r in kept),
            "bytes_learner_check": sum(r.nbytes for r in checked), "bytes_int64": ids * 8,
            "ratio_int64_over_kept": ids * 8 / max(sum(r.nbytes for r in kept), 1),
            "pp2": received([Group(Example("", ""), list(g), [0.0] * len(g)) for g in groups],
                            stage_moe_layers(moe_pattern, 2))}


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
    pp = m["pp2"]
    print(f"PP=2: routes a rank receives, by stage {pp['route_bytes_by_stage']} B (MoE layers "
          f"{pp['stage_moe_layers']}) vs {pp['route_bytes_broadcast']} B broadcast; pickled batch "
          f"{pp['payload_bytes_by_stage']} B vs {pp['payload_bytes_broadcast']} B")
    return 0

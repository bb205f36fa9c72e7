"""Benchmark: what the KL reference π_ref (megapo/learner/reference.py) costs per step on the main job's step
(megapo/configs/tiny_moe_addition.yaml: its tiny Qwen3-MoE, 64 prompts x 8 samples of 8-token prompts and
8-token responses, one process), measured side by side in one process. Writes JSON.

    python -m tools.bench.reference_cost --out benchmarks/results/reference_cost.json [--rounds 5]

Compared, each round in alternating order: the learner's on-policy train step (the step a KL term is added
to), the Megatron reference's log-probs with free routing and replaying routes (r2/r3), and the plain
reference's (megapo's PyTorch model). Reported: medians (wall seconds), each reference pass as a fraction of
the train step, megatron / plain, and the bytes each keeps (parameters; the learner's with grads and Adam).
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
CONFIG = ROOT / "megapo" / "configs" / "tiny_moe_addition.yaml"


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bytes(module, with_state: bool = False) -> int:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params * 4 if with_state else params  # + fp32 grad + Adam's two moments


def measure(rounds: int, seed: int = 0) -> tuple[dict[str, list[float]], dict[str, int]]:
    from megapo.config import OptimConfig, load_config
    from megapo.learner.learner import Learner
    from megapo.learner.reference import MegatronReference, PlainReference
    from megapo.models.tiny import write_tiny_model
    from megapo.replay import modes
    from megapo.trainer.config import RunConfig

    cfg = load_config(RunConfig, str(CONFIG), ["sft.enabled=false"])
    t = cfg.model.tiny
    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench_model_")), t.family, layers=t.layers,
                             experts=t.experts, topk=t.topk, hidden=t.hidden, heads=t.heads, kv_heads=t.kv_heads,
                             head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn, vocab=t.vocab, seed=t.seed)
    budget = cfg.train.micro_batch_tokens
    learner = Learner(model, cfg.parallel, OptimConfig(lr=1e-6), micro_batch_tokens=budget)
    refs = {"megatron_free": MegatronReference(model, cfg.parallel, micro_batch_tokens=budget),
            "megatron_replay": MegatronReference(model, cfg.parallel, micro_batch_tokens=budget, routing_replay=True),
            "plain": PlainReference(model)}
    rng = random.Random(seed)
    n_seqs = cfg.data.prompts_per_step * cfg.rollout.n_samples
    out: dict[str, list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up
        batch = []
        for _ in range(n_seqs):
            n = 8 + cfg.rollout.max_new_tokens
            routes = [[rng.sample(range(t.experts), t.topk) for _ in range(t.layers)] for _ in range(n - 1)]
            batch.append(dict(tokens=[rng.randrange(3, t.vocab) for _ in range(n)], prompt_len=8,
                              advantage=rng.uniform(-1, 1), routes=routes))
        free = [{k: v for k, v in s.items() if k != "routes"} for s in batch]
        runs = [("train", lambda: modes.on_policy_step(learner, [dict(s) for s in free], "off", "gspo",
                                                       "seq-mean-token-mean")),
                ("megatron_free", lambda: refs["megatron_free"].response_logprobs(free)),
                ("megatron_replay", lambda: refs["megatron_replay"].response_logprobs(batch)),
                ("plain", lambda: refs["plain"].response_logprobs(free))]
        for name, fn in (runs if r % 2 else runs[::-1]):
            out.setdefault(name, []).append(timed(fn))
        if r == 0:
            out = {}
    memory = {"learner_with_grads_and_adam": _bytes(learner.module, with_state=True),
              "megatron_reference": _bytes(refs["megatron_free"].model.module),
              "plain_reference": refs["plain"].model.num_parameters() * refs["plain"].model.dtype.itemsize}
    return out, memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.reference_cost")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    samples, memory = measure(args.rounds)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {"megatron_free_of_train_step": med["megatron_free"] / med["train"],
              "megatron_replay_of_train_step": med["megatron_replay"] / med["train"],
              "plain_of_train_step": med["plain"] / med["train"],
              "megatron_free_over_plain": med["megatron_free"] / med["plain"]}
    report = {"benchmark": "reference_cost", "config": str(CONFIG.relative_to(ROOT)), "rounds": args.rounds,
              "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None, "load_avg": os.getloadavg(),
              "median_s": med, "ratios": ratios, "bytes": memory, "samples_s": samples}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({"median_s": {k: round(v, 4) for k, v in med.items()},
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}, "bytes": memory}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

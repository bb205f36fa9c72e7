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
from pathlib import Path

from tools.bench.side_by_side import alternating_rounds, param_bytes, routed_batch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "megapo" / "configs" / "tiny_moe_addition.yaml"


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
    n_seqs, n = cfg.data.prompts_per_step * cfg.rollout.n_samples, 8 + cfg.rollout.max_new_tokens

    def passes():
        batch = routed_batch(rng, n_seqs, n, 8, t)
        free = [{k: v for k, v in s.items() if k != "routes"} for s in batch]
        return [("train", lambda: modes.on_policy_step(learner, [dict(s) for s in free], "off", "gspo",
                                                       "seq-mean-token-mean")),
                ("megatron_free", lambda: refs["megatron_free"].response_logprobs(free)),
                ("megatron_replay", lambda: refs["megatron_replay"].response_logprobs(batch)),
                ("plain", lambda: refs["plain"].response_logprobs(free))]

    out = alternating_rounds(rounds, passes)
    memory = {"learner_with_grads_and_adam": param_bytes(learner.module, trained=True),
              "megatron_reference": param_bytes(refs["megatron_free"].model.module),
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

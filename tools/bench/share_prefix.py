"""`megapo bench share-prefix`: the learner's train pass with each prompt held once in the micro-batches
(train.share_prefix) against unshared packing, in one process, alternating, on synthetic GRPO batches.

    megapo bench share-prefix --out FILE.json [--repeats 5] [--threads 2] [--cases main,long]

Cases: `main`, the main job's shape (prompts of 6-10 tokens, responses of 2-8, n = 8, 32 prompts, the tiny
Qwen3-MoE); `long`, prompts of 256 tokens, responses of 16-48, n = 8, 8 prompts. Per case: tokens of the batch and
tokens the forward ran (packed_tokens), the median train-step time of each side (one on-policy GSPO step; lr 0 then
negligible, so every repeat trains the same weights), their ratios, and the loss of both (they must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

CASES = {"main": dict(prompts=32, samples=8, prompt_len=(6, 10), response_len=(2, 8)),
         "long": dict(prompts=8, samples=8, prompt_len=(256, 256), response_len=(16, 48))}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=5, help="train steps per side and case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--cases", default="main,long", help=f"comma-separated of {', '.join(CASES)}")


def make_batch(prompts: int, samples: int, prompt_len: tuple, response_len: tuple, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    batch = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        for _ in range(samples):
            response = [rng.randrange(vocab) for _ in range(rng.randint(*response_len))]
            batch.append(dict(tokens=prompt + response, prompt_len=len(prompt), advantage=rng.uniform(-1, 1)))
    return batch


def measure(learner, batch: list[dict], repeats: int) -> dict:
    """Alternating steps with sharing off and on: median step time, tokens run, losses."""
    times = {"off": [], "auto": []}
    seen = {}
    for r in range(repeats + 1):  # the first round warms up
        for mode in (("off", "auto") if r % 2 else ("auto", "off")):
            learner.share_prefix = mode
            metrics, _ = learner.train_step_on_policy(batch, "gspo")
            if r:
                times[mode].append(metrics["step_time_s"])
            seen[mode] = metrics
    tokens = sum(len(s["tokens"]) for s in batch)
    off, on = (statistics.median(times[m]) for m in ("off", "auto"))
    return {"samples": len(batch), "tokens": tokens, "packed_tokens_unshared": seen["off"]["packed_tokens"],
            "packed_tokens_shared": seen["auto"]["packed_tokens"],
            "token_ratio": seen["auto"]["packed_tokens"] / seen["off"]["packed_tokens"],
            "step_s_unshared": off, "step_s_shared": on, "time_ratio": on / off,
            "times_unshared": times["off"], "times_shared": times["auto"],
            "loss_unshared": seen["off"]["loss"], "loss_shared": seen["auto"]["loss"]}


def run(args: argparse.Namespace) -> int:
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise SystemExit(f"megapo bench share-prefix: --cases: unknown {unknown or cases}; known: {', '.join(CASES)}")
    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("megapo bench share-prefix: --repeats and --threads must be >= 1")
    import torch

    from megapo.config import OptimConfig, ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.models.tiny import write_tiny_model

    torch.set_num_threads(args.threads)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    report = {"repeats": args.repeats, "threads": args.threads, "load_before": os.getloadavg()[0], "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "model", "qwen3_moe")
        learner = Learner(model, ParallelConfig(), OptimConfig(lr=1e-3, warmup_steps=10**9))
        for name in cases:
            batch = make_batch(**CASES[name], vocab=learner.spec.vocab_size)
            report["cases"][name] = {"shape": CASES[name], **measure(learner, batch, args.repeats)}
            c = report["cases"][name]
            print(f"{name}: {c['tokens']} tokens; the forward ran {c['packed_tokens_shared']} shared vs "
                  f"{c['packed_tokens_unshared']} ({c['token_ratio']:.2f}); step {c['step_s_shared']:.3f} s vs "
                  f"{c['step_s_unshared']:.3f} s ({c['time_ratio']:.2f}x)", flush=True)
        learner.close()
    report["load_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"-> {args.out}")
    return 0

"""Benchmark: megapo's RL train step vs a raw Megatron-core forward_backward on identical micro-batches,
and the padding waste of token-budget packing on a length-skewed batch. Writes JSON.

    python -m tools.bench.train_step --out bench_train_step.json [--layers 4 --hidden 128 --repeats 5]
    python -m torch.distributed.run --nproc-per-node 2 -m tools.bench.train_step --tp 2 --out ...

Both sides use the same model, optimizer and packed rows (megapo's packing): the raw side is what a
hand-written Megatron loop does (forward with labels -> Megatron's own cross-entropy, masked mean,
forward_backward, optimizer step); megapo's side is Learner.train_step (packing, vocab-parallel
log-probs + entropy, a PPO objective from megapo.algorithms, metrics, optimizer step). The two
alternate within one run and the ratio of medians is reported (target <= 1.10), with robust variants
for a shared machine: ratio of minimums, median of adjacent pairs' ratios, and CPU-time ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def skewed_lengths(n: int, seed: int, max_len: int) -> list[int]:
    """Long-tailed lengths as RL responses are: most short, a few near the maximum."""
    rng = random.Random(seed)
    return [min(max_len, int(8 + rng.paretovariate(1.1) * 12)) for _ in range(n)]


def padding_report(lengths: list[int], budget: int, dp: int, pad_multiple: int) -> dict:
    from megapo.learner import packing

    def rows(equal_shapes: bool):
        return [r for rank in range(dp) for mb in packing.plan(lengths, dp=dp, dp_rank=rank, budget=budget,
                                                               pad_multiple=pad_multiple, equal_shapes=equal_shapes)
                for r in mb.rows]

    packed = rows(False)
    # what padding to the longest sequence wastes with the same number of sequences per row
    per_mb = max(1, len(lengths) // max(1, len(packed)))
    naive_slots = sum(max(lengths[i:i + per_mb]) * len(lengths[i:i + per_mb]) for i in range(0, len(lengths), per_mb))
    return {"sequences": len(lengths), "tokens": sum(lengths), "rows": len(packed), "budget": budget,
            "pad_multiple": pad_multiple,
            "packed_padding_waste": packing.padding_waste(packed),
            # the allgather dispatcher needs one row width on every rank
            "packed_equal_width_padding_waste": packing.padding_waste(rows(True)),
            "pad_to_longest_waste": 1 - sum(lengths) / naive_slots}


def make_batch(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    batch = []
    for n in lengths:
        n = max(n, 4)
        p = max(1, n // 4)
        batch.append(dict(tokens=[rng.randrange(vocab) for _ in range(n)], prompt_len=p,
                          advantage=rng.uniform(-1, 1), old_logp=[-6.0] * (n - p)))
    return batch


def raw_megatron_step(learner, batch: list[dict]) -> float:
    """forward_backward + optimizer step written directly against Megatron-core, same rows."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megapo.learner.rope import set_positions

    lengths = np.asarray([len(b["tokens"]) for b in batch])
    prompts = np.asarray([b["prompt_len"] for b in batch])
    micro_batches = learner._micro_batches([b["tokens"] for b in batch], prompts - 1, lengths - 1)
    total = sum(len(b["tokens"]) - b["prompt_len"] for b in batch)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        labels = torch.roll(mb.tokens, shifts=-1, dims=1)
        real = mb.seq >= 0  # slots whose logits predict a response token: positions p-1 .. n-2
        seq = np.where(real, mb.seq, 0)
        predicts = real & (mb.pos >= prompts[seq] - 1) & (mb.pos < lengths[seq] - 1)
        loss_mask = torch.from_numpy(predicts.astype(np.float32)).to(mb.tokens.device)
        set_positions(model, mb.position_ids)
        out = model(mb.tokens, mb.position_ids, mb.attention_mask, labels=labels)

        def loss_func(per_token):
            loss = (per_token.float() * loss_mask).sum() / total * len(micro_batches)
            return loss, {"loss": loss.detach()}

        return out, loss_func

    start, cpu = time.perf_counter(), time.process_time()
    learner.model.zero_grad_buffer()
    learner.optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                model=[learner.model], num_microbatches=len(micro_batches),
                                seq_length=max(mb.layout.width for mb in micro_batches),
                                micro_batch_size=max(len(mb.layout.rows) for mb in micro_batches),
                                forward_only=False)
    learner.optimizer.step()
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.train_step")
    parser.add_argument("--out", required=True, help="JSON file written")
    parser.add_argument("--model", default=None, help="HF folder (default: a tiny Qwen3-MoE written to a temp dir)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    from megapo.config import OptimConfig, ParallelConfig
    from megapo.learner.learner import Learner

    model_dir = args.model
    if model_dir is None:
        from megapo.models.tiny import write_tiny_model

        model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="bench_model_")), "qwen3_moe", layers=args.layers,
                                     hidden=args.hidden, experts=args.experts, vocab=args.vocab, ffn=2 * args.hidden,
                                     moe_ffn=args.hidden)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, dispatcher=args.dispatcher)
    learner = Learner(model_dir, parallel, OptimConfig(lr=1e-6), micro_batch_tokens=args.micro_batch_tokens)
    lengths = skewed_lengths(args.sequences, seed=0, max_len=args.micro_batch_tokens // 2)
    batch = make_batch(lengths, learner.spec.vocab_size, seed=1)

    learner.train_step(batch, "ppo", "token-mean")  # warm-up both paths
    raw_megatron_step(learner, batch)
    megapo_times, raw_times = [], []

    def megapo_step() -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        learner.train_step(batch, "ppo", "token-mean")
        return time.perf_counter() - start, time.process_time() - cpu

    for i in range(args.repeats):  # pairs, alternating which side goes first
        if i % 2:
            raw_times.append(raw_megatron_step(learner, batch))
            megapo_times.append(megapo_step())
        else:
            megapo_times.append(megapo_step())
            raw_times.append(raw_megatron_step(learner, batch))
    pair_ratios = [m[0] / r[0] for m, r in zip(megapo_times, raw_times)]
    megapo_cpu, raw_cpu = [m[1] for m in megapo_times], [r[1] for r in raw_times]
    megapo_times, raw_times = [m[0] for m in megapo_times], [r[0] for r in raw_times]

    result = {
        "benchmark": "train_step",
        "layout": vars(parallel),
        "model": str(model_dir),
        "sequences": len(batch),
        "tokens": sum(len(b["tokens"]) for b in batch),
        "megapo_step_s": megapo_times,
        "raw_megatron_step_s": raw_times,
        "megapo_median_s": statistics.median(megapo_times),
        "raw_megatron_median_s": statistics.median(raw_times),
        "ratio_megapo_over_raw": statistics.median(megapo_times) / statistics.median(raw_times),
        # on a shared machine: the fastest of each side, and the median of adjacent pairs' ratios
        "ratio_of_minimums": min(megapo_times) / min(raw_times),
        "ratio_pairwise_median": statistics.median(pair_ratios),
        # CPU time of this process (rank 0): not inflated by waiting for a shared core
        "megapo_cpu_median_s": statistics.median(megapo_cpu),
        "raw_megatron_cpu_median_s": statistics.median(raw_cpu),
        "cpu_ratio_megapo_over_raw": statistics.median(megapo_cpu) / statistics.median(raw_cpu),
        "target_ratio": 1.10,
        "packing": padding_report(lengths, args.micro_batch_tokens, args.dp, max(args.tp, 2)),
        "target_padding_waste": 0.03,
    }
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps({k: result[k] for k in ("megapo_median_s", "raw_megatron_median_s", "ratio_megapo_over_raw",
                                                 "ratio_of_minimums", "ratio_pairwise_median",
                                                 "cpu_ratio_megapo_over_raw")}
                         | {"packed_padding_waste": result["packing"]["packed_padding_waste"]}))
    learner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-rank script of `megapo bench scaling`: every rank runs the RL training step for each run of a
spec (one layout x one model size, all with this world size) and rank 0 appends one JSON line per run.

    python -m torch.distributed.run --nproc-per-node 2 -m tools.bench.scaling_worker \
        --spec DIR/spec_world2.json --out DIR/raw_world2.jsonl

One step, as megapo's trainer does it (megapo/trainer/update.py), each phase timed on every rank:
  generate   rank 0's embedded engine samples n responses per prompt; the batch goes to every rank
  old_logp   learner.logprobs over the batch (collective)
  train      learner.train_step, PPO objective (collective)
  weight_sync megapo.weights.sync_learner with the tensor transport into rank 0's engine (collective gather)
Per run: one warm-up step (not timed), then --steps timed steps with the strong-scaling batch
(fixed `prompts`), then --steps with the weak-scaling batch (`prompts * world_size`; skipped at world 1,
where it equals the strong batch). Peak memory per rank: resident set size sampled every 10 ms on CPU,
torch.cuda.max_memory_allocated on GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path

import torch

PHASES = ("generate", "old_logp", "train", "weight_sync")


class PeakRSS:
    """Highest resident set size of this process while running (sampled; resettable per run)."""

    def __init__(self, interval_s: float = 0.01):
        import psutil

        self._proc = psutil.Process()
        self._interval = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def reset(self) -> None:
        self.peak = self._proc.memory_info().rss

    def read(self) -> int:
        return max(self.peak, self._proc.memory_info().rss)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def calibration_s(repeats: int = 20) -> float:
    """Seconds for a fixed matmul workload on this rank: how fast the (shared) CPU or GPU was just
    before a run, so runs measured at different moments can be compared with the load in mind."""
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(repeats):
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(count)]


def rollout_batch(engine, prompts: list[list[int]], n: int, max_new_tokens: int, seed: int) -> list[dict]:
    """Learner train samples from one generate call; reward = share of even token ids in the response
    (arbitrary but deterministic), advantage = reward minus its group mean."""
    from megapo.engines.base import SamplingParams

    params = SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed)  # no stop ids: every response full length
    batch = []
    for group in engine.generate(prompts, params):
        rewards = [sum(t % 2 == 0 for t in s.output_ids) / len(s.output_ids) for s in group]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(group, rewards):
            batch.append({"tokens": list(s.prompt_ids) + list(s.output_ids), "prompt_len": len(s.prompt_ids),
                          "advantage": r - mean, "rollout_logp": list(s.logprobs)})
    return batch


def _broadcast(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_step(learner, engine, prompts, spec: dict, version: int, seed: int) -> tuple[dict, list[dict]]:
    """Seconds per phase of one RL step on this rank, and the batch."""
    from megapo.weights import TensorTransport, bucket_bytes, sync_learner

    rank = torch.distributed.get_rank()
    device = learner.device if isinstance(learner.device, str) else learner.device.type
    times = {}
    torch.distributed.barrier()
    t = time.perf_counter()
    batch = rollout_batch(engine, prompts, spec["n"], spec["max_new_tokens"], seed) if rank == 0 else None
    batch = _broadcast(batch)
    times["generate"] = time.perf_counter() - t

    t = time.perf_counter()
    logps = learner.logprobs([s["tokens"] for s in batch])
    for s, lp in zip(batch, logps):
        s["old_logp"] = lp[s["prompt_len"] - 1:].tolist()
    _sync_device(device)
    times["old_logp"] = time.perf_counter() - t

    t = time.perf_counter()
    learner.train_step(batch, "ppo", "token-mean")
    _sync_device(device)
    times["train"] = time.perf_counter() - t

    t = time.perf_counter()
    sync_learner(learner, [engine] if rank == 0 else [], TensorTransport(), bucket_bytes(spec["bucket_mb"]), version)
    _sync_device(device)
    times["weight_sync"] = time.perf_counter() - t
    times["step"] = sum(times[p] for p in PHASES)
    return times, batch


def measure(learner, engine, prompts, spec: dict, steps: int, version: int, seed: int) -> tuple[dict, int]:
    rows, batch = [], None
    for i in range(steps):
        version += 1
        times, batch = one_step(learner, engine, prompts, spec, version, seed + i)
        rows.append(times)
    # the phases of the step with the median total (not per-phase medians, which need not add up)
    median = sorted(rows, key=lambda r: r["step"])[(len(rows) - 1) // 2]
    out = {"prompts": len(prompts), "sequences": len(batch), "tokens": sum(len(s["tokens"]) for s in batch),
           "response_tokens": sum(len(s["tokens"]) - s["prompt_len"] for s in batch),
           "sequence_lengths": sorted({len(s["tokens"]) for s in batch}),
           "time_s": median, "time_s_per_step": rows}
    return out, version


def run_one(run: dict, spec: dict, rss: PeakRSS) -> dict:
    from megapo.config import OptimConfig, ParallelConfig
    from megapo.engines.embedded import EmbeddedEngine
    from megapo.learner.learner import Learner

    parallel = ParallelConfig(**run["parallel"])
    learner = Learner(run["model_dir"], parallel, OptimConfig(lr=1e-5), seed=0,
                      micro_batch_tokens=spec["micro_batch_tokens"])
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    rss.reset()
    rss_start = rss.read()
    engine = EmbeddedEngine(run["model_dir"], seed=0) if rank == 0 else None
    vocab = learner.spec.vocab_size
    strong_prompts = make_prompts(spec["prompts"], spec["prompt_len"], vocab, seed=1)
    weak_prompts = make_prompts(spec["prompts"] * world, spec["prompt_len"], vocab, seed=1)
    version = 1
    torch.distributed.barrier()
    calibration = calibration_s()
    one_step(learner, engine, strong_prompts, spec, version, seed=0)  # warm-up: lazy init, allocator, caches
    strong, version = measure(learner, engine, strong_prompts, spec, spec["steps"], version, seed=100)
    weak = None
    if world > 1:
        weak, version = measure(learner, engine, weak_prompts, spec, spec["steps"], version, seed=200)
    peak = torch.cuda.max_memory_allocated() if on_cuda else rss.read()
    peaks, starts = [None] * world, [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    torch.distributed.all_gather_object(starts, None if on_cuda else rss_start)
    device = torch.cuda.get_device_name() if on_cuda else "cpu"
    learner.close()
    del engine, learner
    return {"name": run["name"], "size": run["size"], "layout": run["layout"], "parallel": run["parallel"],
            "world_size": world, "device": device, "threads_per_rank": torch.get_num_threads(),
            "strong": strong, "weak": weak, "peak_memory_bytes_per_rank": peaks,
            "rss_at_run_start_bytes_per_rank": starts, "calibration_s": calibration,
            "peak_memory_kind": "cuda_max_memory_allocated" if on_cuda else "rss_sampled_10ms"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.scaling_worker")
    parser.add_argument("--spec", required=True, help="spec JSON written by `megapo bench scaling`")
    parser.add_argument("--out", required=True, help="JSON-lines file rank 0 appends one line per run to")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    rss = PeakRSS()
    try:
        for run in spec["runs"]:
            result = run_one(run, spec, rss)
            if torch.distributed.get_rank() == 0:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(result) + "\n")
                t = result["strong"]["time_s"]
                print(f"scaling: {run['size']}/{run['layout']}: step {t['step']:.2f} s (generate {t['generate']:.2f}, "
                      f"old_logp {t['old_logp']:.2f}, train {t['train']:.2f}, sync {t['weight_sync']:.2f})", flush=True)
    finally:
        rss.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

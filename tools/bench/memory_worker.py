"""Per-rank script of `megapo bench memory` (tools/bench/memory.py): every rank builds the learner of each layout
of a spec in turn, takes warm-up + timed train steps on one fixed batch, then counts the bytes of the tensors the
learner holds; rank 0 writes every rank's counts as one JSON file.

    python -m torch.distributed.run --nproc-per-node 2 -m tools.bench.memory_worker --spec S.json --out R.json

What is counted (`tensor_bytes`), each as numel * element_size of the tensors themselves ("exact") and, for the
buffers that pack several tensors, as the bytes of their storages counted once ("storage": includes the padding
Megatron's distributed optimizer adds):
- weights: the model's parameters (learner.module); with the distributed optimizer they are views into DDP's
  param buffer;
- grads: DDP's grad buffers (param.main_grad, fp32: grad_reduce_in_fp32); any other .grad whose storage is not
  in a grad buffer is counted apart (other_grads);
- optimizer_main: the optimizer's main parameters (the torch optimizer's params) whose storage is not a model
  parameter's: the fp32 copies of mixed precision (whole, or this rank's shard with the distributed optimizer);
  fp32 training steps the model's own parameters (or views of them), which count 0 here;
- optimizer_moments: Adam's exp_avg and exp_avg_sq; optimizer_other: the rest of its state (step counters);
- guard_copy: megapo's own copy of the parameters and optimizer state that undoes a non-finite update
  (optim.restore_nonfinite, megapo/learner/guard.py), not part of Megatron's optimizer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr())


def _exact(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storages(tensors) -> int:
    seen = {}
    for t in tensors:
        seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def _unique(tensors) -> list:
    out, seen = [], set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def inner_optimizers(optimizer) -> list:
    """The Megatron optimizers in a (chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def tensor_bytes(learner) -> dict:
    """This rank's bytes of weights, gradients, optimizer state and megapo's guard copy (see the module doc)."""
    named = list(learner.module.named_parameters())
    params = _unique(p for _, p in named)
    expert = _unique(p for name, p in named if ".experts." in name)
    param_storages = {_storage_key(p) for p in params}
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    grad_storages = {_storage_key(g) for g in grads}
    main, moments, other_state, other_grads = [], [], [], []
    for opt in inner_optimizers(learner.optimizer):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if _storage_key(p) not in param_storages:
                    main.append(p)
                for key, value in torch_opt.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        (moments if key in ("exp_avg", "exp_avg_sq") else other_state).append(value)
    for p in params + main:
        if p.grad is not None and _storage_key(p.grad) not in grad_storages:
            other_grads.append(p.grad)
    main, moments, other_state, other_grads = map(_unique, (main, moments, other_state, other_grads))
    guard = learner.guard._saved if learner.guard is not None else []
    return {
        "weights": _exact(params), "weights_storage": _storages(params),
        "grads": _exact(grads), "grads_storage": _storages(grads),
        "optimizer_main": _exact(main), "optimizer_moments": _exact(moments), "optimizer_other": _exact(other_state),
        "other_grads": _exact(other_grads), "guard_copy": _exact(guard),
        "model_buffers": _exact(_unique(learner.module.buffers())),
        "params_on_rank": sum(p.numel() for p in params), "expert_params_on_rank": sum(p.numel() for p in expert),
        "main_params_numel": sum(p.numel() for p in main),
        "dtypes": {"weights": sorted({str(p.dtype) for p in params}), "grads": sorted({str(g.dtype) for g in grads}),
                   "optimizer_main": sorted({str(p.dtype) for p in main}),
                   "optimizer_moments": sorted({str(m.dtype) for m in moments})},
        "optimizers": [type(opt).__name__ for opt in inner_optimizers(learner.optimizer)],
    }


def model_params(model_dir) -> int:
    """The model's parameter count: the numel of every tensor in its safetensors files (headers only)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


class Memory:
    """Process memory around a layout: CUDA allocator counters on a GPU; on CPU the resident set size, read
    before and after and sampled every 10 ms for its peak (scaling_worker.PeakRSS)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.rss = self._proc = None
        if not self.cuda:
            import psutil

            from tools.bench.scaling_worker import PeakRSS

            self._proc = psutil.Process()
            self.rss = PeakRSS()

    def now(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return self._proc.memory_info().rss

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.rss.reset()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else self.rss.read()

    @property
    def kind(self) -> str:
        return "cuda_memory_allocated" if self.cuda else "rss"

    def close(self) -> None:
        if self.rss is not None:
            self.rss.close()


def run_layout(layout: dict, spec: dict, memory: Memory) -> dict:
    from megapo.config import OptimConfig, ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.learner.precision import Precision

    gc.collect()
    memory.reset_peak()
    before = memory.now()
    parallel = ParallelConfig(tp=layout.get("tp", 1), pp=layout.get("pp", 1), dp=layout["dp"], ep=layout.get("ep", 1),
                              distributed_optimizer=layout["distributed_optimizer"])
    start = time.perf_counter()
    learner = Learner(spec["model"], parallel, OptimConfig(lr=1e-4), precision=Precision(layout["precision"]))
    build_s = time.perf_counter() - start
    built = memory.now()
    walls, cpus = [], []
    for k in range(spec["warmup"] + spec["steps"]):
        torch.distributed.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = learner.train_step(spec["batch"], "reinforce")
        if memory.cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if not metrics.get("update_ok", True):
            raise RuntimeError(f"memory bench: layout {layout['name']}: step {k} was not applied ({metrics})")
        if k >= spec["warmup"]:
            walls.append(wall)
            cpus.append(cpu)
        if k == 0:
            after_first = memory.now()
    counted = tensor_bytes(learner)
    counted["model_params_total"] = model_params(spec["model"])
    after = memory.now()
    peak = memory.peak()
    learner.close()
    del learner
    gc.collect()
    return {"name": layout["name"], "layout": layout, "rank": torch.distributed.get_rank(),
            "world": torch.distributed.get_world_size(), "bytes": counted, "build_s": build_s,
            "step_wall_s": walls, "step_cpu_s": cpus,
            "step_wall_median_s": statistics.median(walls), "step_cpu_median_s": statistics.median(cpus),
            "process": {"kind": memory.kind, "before_build": before, "after_build": built,
                        "after_first_step": after_first, "after_steps": after, "peak": peak}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.memory_worker")
    parser.add_argument("--spec", required=True, help="spec JSON written by `megapo bench memory`")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes (every rank's results)")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    memory = Memory()
    results = []
    try:
        for layout in spec["layouts"]:
            mine = run_layout(layout, spec, memory)
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
            results.append(every)
            if torch.distributed.get_rank() == 0:
                print(f"memory: {layout['name']}: step {mine['step_wall_median_s']:.3f} s (median of "
                      f"{len(mine['step_wall_s'])})", flush=True)
    finally:
        memory.close()
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"results": results, "torch_threads": torch.get_num_threads(),
                                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

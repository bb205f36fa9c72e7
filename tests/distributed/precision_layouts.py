"""Run under torchrun (2 processes) by tests/test_precision.py: the learner in bf16 / fp16 under each layout.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/precision_layouts.py --spec S.json --out R.pt

SPEC.json: {"models": {"qwen3_moe": DIR, ...}, "precisions": ["bf16", "fp16"], "layouts": [{"tp": 2, ...}, ...],
            "sequences": [[...], ...], "routes": {"<model>/<precision>": [[n-1, layers, k] per sequence]}
            (transformers' routes in that dtype, replayed),
            "train_batch": [sample per sequence] (one step each layout takes, on the sequences and their routes),
            "step": {"model": DIR, "batch": [sample, ...], "optim": {...}}  (one bf16 step at DP=2 with the
                     distributed optimizer, its inner optimizers watched)}
Results: "logprobs/<model>/<precision>/<layout>": [tensor per sequence] under the given routes, "free/..." the same
with the learner's own routing and "routes/..." the routes it chose; "step": what the optimizer held before
and after its update (rank 0's share of the fp32 main parameters, their gradients, the model's bf16 slices).
"""

from __future__ import annotations

import numpy as np
import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.learner.precision import Precision
from megapo.replay.modes import logprobs_with_routes
from spec_io import finish, read_spec  # this script's folder is on sys.path


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for name, model_dir in spec["models"].items():
        for precision in spec["precisions"]:
            for layout in spec["layouts"]:
                learner = Learner(model_dir, ParallelConfig(**layout), precision=Precision(precision),
                                  routing_replay=True)
                key = f"{name}/{precision}/" + "-".join(f"{k}{v}" for k, v in layout.items())
                given = [np.asarray(r, dtype=np.int64) for r in spec["routes"][f"{name}/{precision}"]]
                results["logprobs/" + key] = logprobs_with_routes(learner, spec["sequences"], given)[0]
                results["free/" + key], results["routes/" + key], _ = logprobs_with_routes(learner, spec["sequences"])
                if "train_batch" in spec:  # one step under this layout, replaying transformers' routes
                    batch = [dict(s, routes=r) for s, r in zip(spec["train_batch"], given)]
                    results["train/" + key] = learner.train_step(batch, "reinforce")
                learner.close()
    if "step" in spec:
        results["step"] = watched_step(spec["step"])
    finish(results, out_path)


def watched_step(step: dict) -> dict:
    """One bf16 train step at DP=2 with the distributed optimizer; each inner optimizer's main-parameter shards
    and their gradients are read right before Megatron's Adam runs, and again after the step."""
    learner = Learner(step["model"], ParallelConfig(dp=2, distributed_optimizer=True), OptimConfig(**step["optim"]),
                      precision=Precision("bf16"))
    inner = learner.optimizer.chained_optimizers
    before = []

    def watch(opt):
        run = opt.step_with_ready_grads

        def step_with_ready_grads():
            before.extend((main.detach().clone(), main.grad.detach().clone())
                          for group in opt.shard_fp32_from_float16_groups for main in group)
            return run()

        opt.step_with_ready_grads = step_with_ready_grads

    for opt in inner:
        watch(opt)
    metrics = learner.train_step(step["batch"], "reinforce")
    after = [main.detach().clone() for opt in inner for group in opt.shard_fp32_from_float16_groups for main in group]
    model_slices, dims = [], []  # this rank's range of each model parameter, as the model holds it; its ndim
    for opt in inner:
        for group in opt.model_float16_groups:
            for param in group:
                piece = opt._get_model_param_range_map(param)["param"]
                model_slices.append(param.detach().view(-1)[piece.start:piece.end].clone())
                dims.append(param.dim())
    main_dtypes = sorted({str(m.dtype) for m in after})
    model_dtypes = sorted({str(p.dtype) for p in learner.module.parameters()})
    learner.close()
    return {"before": before, "after": after, "model": model_slices, "dims": dims, "metrics": metrics,
            "main_dtypes": main_dtypes, "model_dtypes": model_dtypes}


if __name__ == "__main__":
    main()

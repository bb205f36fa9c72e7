"""One learner of the tiny DeepSeek-V3 (tests/test_deepseek_v3.py): the HF tensors it exports right after
loading, then one REINFORCE step and its exported weights. Run directly (world 1) or under torchrun.
Rank 0 writes OUT/loaded.safetensors and OUT/stepped.safetensors (plus OUT/metrics.json)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.weights.safetensors_io import save_tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True, help="JSON list of {tokens, prompt_len, advantage, old_logp}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    parallel = ParallelConfig(tp=args.tp, pp=1, ep=args.ep, dp=1)
    # Adam with a huge eps: its first step is ~ lr * g / eps, linear in the gradient (see test_learner_layouts)
    learner = Learner(args.model, parallel, OptimConfig(lr=1000.0, adam_eps=1000.0, grad_clip=0.0), micro_batch_tokens=24)
    loaded = {n: t.clone() for n, t in learner.hf_state_dict()}
    metrics = learner.train_step(json.loads(Path(args.batch).read_text()), "reinforce", "token-mean")
    stepped = dict(learner.hf_state_dict())
    if torch.distributed.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        save_tensors(out / "loaded.safetensors", loaded)
        save_tensors(out / "stepped.safetensors", stepped)
        (out / "metrics.json").write_text(json.dumps({"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()

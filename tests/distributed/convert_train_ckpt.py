"""Run under torchrun by tests/test_convert.py: a Learner takes one REINFORCE step on a tiny model and
saves a trainer-style checkpoint (ROOT/step_00000001/learner, optimizer state included), and rank 0
saves the trained weights as gathered in memory (HF names), the reference the conversion must match.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/convert_train_ckpt.py \
        --model HF_DIR --root ROOT --weights TRAINED.pt --tp 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    learner = Learner(args.model, ParallelConfig(tp=args.tp), OptimConfig(lr=1e-2), micro_batch_tokens=64)
    gen = torch.Generator().manual_seed(1)
    batch = []
    for n, p in ((12, 4), (20, 6), (9, 3)):
        tokens = torch.randint(0, learner.spec.vocab_size, (n,), generator=gen).tolist()
        batch.append(dict(tokens=tokens, prompt_len=p, advantage=1.0 if n % 2 else -1.0, old_logp=[-6.0] * (n - p)))
    metrics = learner.train_step(batch, "reinforce", "token-mean")
    assert metrics["update_ok"], metrics
    learner.save(Path(args.root) / "step_00000001" / "learner")
    trained = dict(learner.hf_state_dict())
    if torch.distributed.get_rank() == 0:
        torch.save(trained, args.weights)
    learner.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing starts a helper process: keep the guard
    main()

"""Run under torchrun (2 ranks, TP=2) by tests/test_trainer_checkpoint.py: real trainer checkpoints of a
Megatron learner, distributed (each rank hashes its share of the files, verification gathers every rank's).

1. one train step, then a trainer checkpoint (step 1) through Learner.save; every rank verifies and
   loads it back (collective).
2. a NaN in rank 1's shard of one weight only: the save of step 2 must raise on *both* ranks (no rank
   left waiting in Megatron's collective save) and leave no step_00000002.
3. the same weights written as a bare torch_dist folder (dist_checkpointing.save, no check) for the
   converter's refusal test.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/trainer_checkpoints.py \
        --spec SPEC.json --out RESULTS.pt      (spec: model, root, nan_ckpt, poisoned)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_io import finish, read_spec  # noqa: E402

from megapo.config import OptimConfig, ParallelConfig  # noqa: E402
from megapo.integrity import NonFiniteError  # noqa: E402
from megapo.learner.learner import Learner  # noqa: E402
from megapo.trainer import checkpoint as ck  # noqa: E402


def main() -> None:
    from megatron.core import dist_checkpointing

    spec, out = read_spec()
    learner = Learner(spec["model"], ParallelConfig(tp=2), OptimConfig(lr=1e-2), micro_batch_tokens=64)
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(1)
    batch = []
    for n, p in ((12, 4), (20, 6)):
        tokens = torch.randint(0, learner.spec.vocab_size, (n,), generator=gen).tolist()
        batch.append(dict(tokens=tokens, prompt_len=p, advantage=1.0 if n % 2 else -1.0, old_logp=[-6.0] * (n - p)))
    assert learner.train_step(batch, "reinforce", "token-mean")["update_ok"]

    def save(step: int) -> Path:
        return ck.save_checkpoint(spec["root"], ck.TrainerState(step, {"index": step}, step), learner.save, keep_last=5,
                                  is_main=rank == 0, barrier=torch.distributed.barrier, rank=rank,
                                  rng_extra={"engine": torch.Generator().manual_seed(7).get_state()})

    path = save(1)
    results = {"verify": ck.verify_checkpoint(path, spec["model"])}
    results["loaded_step"] = ck.load_checkpoint(path, learner.load, rank=rank, model_dir=spec["model"]).step

    with torch.no_grad():
        if rank == 1:
            dict(learner.module.named_parameters())[spec["poisoned"]].view(-1)[3] = float("nan")
    try:
        save(2)
        message = ""
    except NonFiniteError as exc:
        message = str(exc)
    messages: list = [None, None]
    torch.distributed.all_gather_object(messages, message)
    results["nonfinite_messages"] = messages
    if rank == 0:
        Path(spec["nan_ckpt"]).mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"model": learner.module.sharded_state_dict()}, spec["nan_ckpt"])
    learner.close()
    finish(results, out)


if __name__ == "__main__":  # dist_checkpointing starts a helper process: keep the guard
    main()

"""The per-rank part of `megapo convert`, started by megapo/commands/convert.py under torchrun:

    python -m torch.distributed.run --nproc-per-node N -m megapo.convert.worker --job JOB.json [--job ...]

hf_to_megatron: every rank reads its shard of the HF safetensors into a Megatron model (the learner's
    mapping, megapo/weights/hf_load.py) and the ranks save it together with dist_checkpointing
    (torch_dist, weights only: {"model": sharded_state_dict}, the same key Learner.save uses).
megatron_to_hf: the ranks load the checkpoint under this layout (torch_dist reshards on load), gather
    one HF tensor at a time (megapo.weights.gather, as Learner.hf_state_dict), and rank 0 writes
    safetensors shards.
verify (optional, either direction): a Learner of the checkpoint's config loads the checkpoint and
    computes log-probs and entropies of the given sequences; rank 0 saves them for the caller to
    compare with Hugging Face transformers.
The models are built without DDP or an optimizer: conversion holds only each rank's shard.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import torch

from megapo.config import ParallelConfig
from megapo.integrity import check_finite_all_ranks
from megapo.worker_errors import guard


@dataclass
class Job:
    op: str  # "hf_to_megatron" | "megatron_to_hf" | "verify"
    config_dir: str  # folder whose config.json describes the Megatron model
    parallel: dict
    hf_dir: str = ""  # hf_to_megatron: source safetensors
    ckpt: str = ""  # torch_dist folder: written (hf_to_megatron) or read
    out: str = ""  # megatron_to_hf: folder the safetensors go to
    max_shard_bytes: int = 2 * 10**9
    dtype: str = "float32"
    expected: dict = field(default_factory=dict)  # HF name -> shape, checked on export
    verify: bool = False  # also compute the learner's log-probs of verify_sequences from the checkpoint
    verify_sequences: list = field(default_factory=list)
    verify_out: str = ""  # where rank 0 saves them
    inject_failure: str = ""  # tests: "after_save" | "after_shards:N" raise at that point

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @classmethod
    def load(cls, path) -> "Job":
        with open(path) as f:
            return cls(**json.load(f))


class InjectedFailure(RuntimeError):
    pass


def _build(config_dir: str, parallel: ParallelConfig):
    """A bare Megatron model chunk for this rank (no DDP wrapper, no optimizer)."""
    from megatron.core import tensor_parallel

    from megapo.layout import read_hf_config
    from megapo.learner import model as model_lib
    from megapo.models.family import family_for

    hf = read_hf_config(config_dir)
    family = family_for(hf)
    spec = family.spec(hf)
    backend = model_lib.detect_backend()
    tensor_parallel.get_cuda_rng_tracker().reset()
    model_lib.init_distributed(parallel, backend, seed=0, spec=spec)
    config = model_lib.transformer_config(spec, parallel, backend)
    module = model_lib.build_model(spec, parallel, backend, config, ddp=False)
    return module, family, spec


def hf_to_megatron(job: Job, parallel: ParallelConfig) -> None:
    from megatron.core import dist_checkpointing

    from megapo.weights import hf_load

    module, family, spec = _build(job.config_dir, parallel)
    hf_load.load_hf_weights(module, family, spec, job.hf_dir)
    check_finite_all_ranks(module.named_parameters(), f"--hf {job.hf_dir}")
    dist_checkpointing.save({"model": module.sharded_state_dict()}, job.ckpt)
    torch.distributed.barrier()
    if job.inject_failure == "after_save":
        raise InjectedFailure("injected failure after the checkpoint was saved (test)")


def load_checkpoint_model(job: Job, parallel: ParallelConfig):
    from megatron.core import dist_checkpointing

    module, family, spec = _build(job.config_dir, parallel)
    loaded = dist_checkpointing.load({"model": module.sharded_state_dict()}, job.ckpt)
    result = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"checkpoint {job.ckpt} lacks parameters {missing[:5]}")
    return module, family, spec


def megatron_to_hf(job: Job, parallel: ParallelConfig) -> None:
    from megapo.convert.hf_writer import ShardWriter
    from megapo.weights import gather

    module, family, spec = load_checkpoint_model(job, parallel)
    check_finite_all_ranks(module.named_parameters(), f"checkpoint {job.ckpt}")  # nothing exported yet
    rank0 = torch.distributed.get_rank() == 0
    writer = ShardWriter(job.out, job.max_shard_bytes, getattr(torch, job.dtype)) if rank0 else None
    fail_after = int(job.inject_failure.split(":")[1]) if job.inject_failure.startswith("after_shards:") else None
    seen = set()
    # no copies or fp32 conversion here: the writer copies each tensor into its shard in job.dtype
    for name, tensor in gather.iter_model_tensors(module, family, spec):
        if rank0:
            # An independent check of the export against the config: every name expected, every shape right.
            if name not in job.expected:
                raise RuntimeError(f"export produced {name!r}, which the config does not describe")
            if tuple(tensor.shape) != tuple(job.expected[name]):
                raise RuntimeError(f"export produced {name} with shape {tuple(tensor.shape)}, "
                                   f"config says {tuple(job.expected[name])}")
            writer.add(name, tensor)
            seen.add(name)
            if fail_after is not None and writer.shards_written >= fail_after:
                raise InjectedFailure(f"injected failure after {writer.shards_written} shard(s) (test)")
        del tensor
    if rank0:
        missing = sorted(set(job.expected) - seen)
        if missing:
            raise RuntimeError(f"export lacks {len(missing)} tensor(s) the config describes, e.g. {missing[:3]}")
        writer.close()
    del module
    torch.distributed.barrier()


def learner_logprobs(job: Job, parallel: ParallelConfig) -> None:
    """Log-probs and entropies of job.verify_sequences from the checkpoint, through the learner's forward."""
    from megapo.learner.learner import Learner

    longest = max(len(s) for s in job.verify_sequences)
    learner = Learner(job.config_dir, parallel, hf_weights=False, micro_batch_tokens=max(longest, 64))
    learner.load(job.ckpt, load_optimizer=False)
    logprobs, entropies = learner.logprobs(job.verify_sequences, with_entropy=True)
    if torch.distributed.get_rank() == 0:
        torch.save({"logprobs": logprobs, "entropy": entropies}, job.verify_out)
    learner.close()
    torch.distributed.barrier()


def run_job(job: Job) -> None:
    parallel = ParallelConfig(**job.parallel)
    if job.op == "hf_to_megatron":
        hf_to_megatron(job, parallel)
    elif job.op == "megatron_to_hf":
        megatron_to_hf(job, parallel)
    elif job.op != "verify":
        raise ValueError(f"job.op: unknown operation {job.op!r}")
    if job.verify:
        learner_logprobs(job, parallel)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megapo.convert.worker")
    parser.add_argument("--job", required=True, action="append",
                        help="job file; several run one after the other in the same processes")
    args = parser.parse_args(argv)
    for path in args.job:
        run_job(Job.load(path))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":  # dist_checkpointing starts a helper process: keep the guard
    # a failure: its one line recorded for `megapo convert` (megapo.worker_errors), no traceback
    sys.exit(guard("megapo convert", main))

"""Run under torchrun by tests/test_vllm_server.py: a Megatron learner (TP=2 x EP=2, gloo) syncs its weights to a
running vLLM server through megapo's Router + VLLMEngine and the disk transport.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/vllm_sync.py --spec S.json --out R.pt

SPEC: {"url", "api_key_file" (the server's key), "model_dir", "disk_dir", "version" (the server's current weight version), "prompts", "n",
       "max_new_tokens", "seed", "batch" (train samples), "lr", "bucket_bytes", "sync_port" (broadcast group)}
Rank 0 owns the Router. Steps: the server samples from the base weights (`pre`); every rank computes the learner's
log-probs of those samples; the learner takes one optimizer step; sync_learner(version + 1); the server samples
again (`post`); every rank computes the learner's log-probs of the new samples and of the old ones. Then the
server's worker joins a broadcast group, the learner steps again, syncs(version + 2) by broadcast, and the server
samples once more (`post2`). Rank 0 saves
the samples (tokens, vLLM's log-probs, versions), the learner's log-probs of the sampled tokens and the sync stats.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.engines.auth import read_key_file
from megapo.engines.base import SamplingParams
from megapo.engines.router import Router
from megapo.engines.vllm import VLLMEngine
from megapo.learner.learner import Learner
from megapo.weights import DiskTransport, sync_learner
from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, GroupAddress, join_group
from spec_io import read_spec  # this script's folder is on sys.path


def share(obj, rank: int):
    """rank 0's object on every rank (the samples exist only where the Router is)."""
    box = [obj if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def as_dicts(groups) -> list[dict]:
    return [{"prompt_ids": s.prompt_ids, "output_ids": s.output_ids, "logprobs": s.logprobs,
             "weight_version": s.weight_version, "finish_reason": s.finish_reason} for g in groups for s in g]


def learner_logprobs(learner: Learner, samples: list[dict]) -> list[list[float]]:
    """The learner's log-prob of every sampled token (the last len(output) positions of each sequence)."""
    seqs = [s["prompt_ids"] + s["output_ids"] for s in samples]
    out = learner.logprobs(seqs)
    return [lp[len(s["prompt_ids"]) - 1:].tolist() for lp, s in zip(out, samples)]


def main() -> None:
    spec, out_path = read_spec()
    parallel = ParallelConfig(tp=2, pp=1, ep=2, dp=1)
    learner = Learner(spec["model_dir"], parallel, OptimConfig(lr=spec["lr"], grad_clip=0.0), micro_batch_tokens=256)
    rank = torch.distributed.get_rank()
    version = int(spec["version"])
    router = None
    if rank == 0:
        key = read_key_file(spec["api_key_file"])
        router = Router([VLLMEngine(spec["url"], weight_version=version, config_dir=spec["model_dir"], api_key=key)],
                        weight_version=version)
    params = SamplingParams(n=spec["n"], max_new_tokens=spec["max_new_tokens"], seed=spec["seed"])

    def sample() -> list[dict]:
        return share(as_dicts(router.generate(spec["prompts"], params)) if rank == 0 else None, rank)

    res = {"pre": sample()}
    res["learner_pre"] = learner_logprobs(learner, res["pre"])  # base weights
    res["train"] = learner.train_step(spec["batch"], "reinforce", "token-mean")
    stats = sync_learner(learner, [router] if rank == 0 else [],
                         DiskTransport(spec["disk_dir"], config_dir=spec["model_dir"]), spec["bucket_bytes"],
                         version + 1)
    res["post"] = sample()
    res["learner_post"] = learner_logprobs(learner, res["post"])  # updated weights
    res["learner_new_on_pre"] = learner_logprobs(learner, res["pre"])

    # then the broadcast transport: the server's worker joins a group with the stage root (rank 0; rank 1
    # takes part in the TP/EP gather only), the learner takes a second step and streams its stage's tensors
    address = GroupAddress("127.0.0.1", spec["sync_port"], workers=1, timeout_s=300)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(router.join_weight_groups, address, 1, 1) if rank == 0 else None
        group = join_group(address, 0, 0) if rank == 0 else None
        if joined is not None:
            joined.result()
    res["train2"] = learner.train_step(spec["batch"], "reinforce", "token-mean")
    transport = BroadcastTransport(BroadcastSender(group) if rank == 0 else None)
    stats2 = sync_learner(learner, [router] if rank == 0 else [], transport, spec["bucket_bytes"], version + 2)
    res["post2"] = sample()
    res["learner_post2"] = learner_logprobs(learner, res["post2"])
    res["learner_v2_on_post"] = learner_logprobs(learner, res["post"])
    if rank == 0:
        res["stats"] = stats.to_dict()
        res["stats2"] = stats2.to_dict()
        res["router_version"] = router.weight_version
        res["server_version"] = router.engines[0].server_weight_version()
        res["served"] = list(router.served)
        router.close()
        torch.save(res, out_path)
    learner.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run under torchrun by tests/test_weight_sync_distributed.py: for each (model, layout) build a Learner,
take one optimizer step, compute the learner's log-probs of fixed sequences, then sync its weights to
embedded engines with every transport and record the engines' log-probs of the same sequences.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/sync_layouts.py --spec S.json --out R.pt

SPEC: {"cases": [{"name", "model_dir", "tp", "pp", "ep", "port"}], "sequences": [[...]], "batch": [sample],
       "bucket_bytes": N, "disk_dir": DIR, "host": "127.0.0.1"}
The broadcast transport sends to tests/distributed/sync_receiver.py (another process, started by the test)
through one group per pipeline stage at case["port"] + stage. Rank 0 saves, per case: learner log-probs,
engine log-probs before (stale) and after each in-process sync, the streamed tensors vs the learner's
own export, and the allocator peak of the tensor sync.
"""

from __future__ import annotations


import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.engines.embedded import EmbeddedEngine
from megapo.learner.learner import Learner
from megapo.weights import DiskTransport, TensorTransport, sync_learner
from megapo.weights import gather
from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, GroupAddress, join_group
from megapo.weights.memory import allocator_peak
from sync_receiver import engine_logprobs  # this script's folder is on sys.path
from spec_io import finish, read_spec  # this script's folder is on sys.path


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for case in spec["cases"]:
        parallel = ParallelConfig(tp=case["tp"], pp=case["pp"], ep=case["ep"], dp=1)
        learner = Learner(case["model_dir"], parallel, OptimConfig(lr=1e-3, grad_clip=0.0), micro_batch_tokens=256)
        learner.train_step(spec["batch"], "reinforce", "token-mean")
        rank = torch.distributed.get_rank()
        res = {"learner": learner.logprobs(spec["sequences"])}
        mine = rank == 0  # the rank that owns the in-process engines
        engine = EmbeddedEngine(case["model_dir"]) if mine else None
        if mine:
            res["stale"] = engine_logprobs(engine, spec["sequences"])

        # tensor transport (peak extra memory measured on rank 0 by torch's allocator events)
        def tensor_sync():
            return sync_learner(learner, [engine] if mine else [], TensorTransport(), spec["bucket_bytes"], 1)

        peak, stats = allocator_peak(tensor_sync)
        if mine:
            res["tensor"] = engine_logprobs(engine, spec["sequences"])
            res["tensor_stats"] = stats.to_dict()
            res["tensor_peak"] = peak
            res["tensor_version"] = engine.weight_version

        # disk transport into a fresh engine
        engine = EmbeddedEngine(case["model_dir"]) if mine else None
        stats = sync_learner(learner, [engine] if mine else [], DiskTransport(f"{spec['disk_dir']}/{case['name']}"),
                             spec["bucket_bytes"], 1)
        if mine:
            res["disk"] = engine_logprobs(engine, spec["sequences"])
            res["disk_version"] = engine.weight_version

        # broadcast transport: each stage root sends its own stage to the receiver process
        sender = None
        if gather.is_stage_root():
            address = GroupAddress(spec["host"], case["port"], workers=1, timeout_s=300)
            from megatron.core import parallel_state

            stage = parallel_state.get_pipeline_model_parallel_rank()
            sender = BroadcastSender(join_group(address, stage, rank=0))
        stats = sync_learner(learner, [], BroadcastTransport(sender), spec["bucket_bytes"], 1)
        res["broadcast_sent"] = stats.bytes

        # the streamed tensors against the learner's own (materialising) export: same names, order, values
        streamed = [(n, t.clone()) for n, t in gather.iter_model_tensors(*gather.learner_parts(learner))]
        export_peak, exported = allocator_peak(lambda: list(learner.hf_state_dict()))
        res["export_peak"] = export_peak
        if mine:
            res["names_match"] = [n for n, _ in streamed] == [n for n, _ in exported]
            res["max_tensor_diff"] = max((a - b).abs().max().item() for (_, a), (_, b) in zip(streamed, exported))
            res["model_bytes"] = sum(t.numel() * t.element_size() for _, t in streamed)
            res["largest_tensor"] = max(t.numel() * t.element_size() for _, t in streamed)
        sent = torch.tensor([res["broadcast_sent"]], dtype=torch.int64)
        torch.distributed.all_reduce(sent)  # bytes sent by all stage roots together
        res["broadcast_sent"] = int(sent.item())
        results[case["name"]] = res
        learner.close()
    finish(results, out_path)


if __name__ == "__main__":
    main()

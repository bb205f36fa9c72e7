"""An engine worker for tests/test_weight_sync_distributed.py: for each case of the spec (in order), build
an embedded engine from the case's model, join the case's weight-sync groups (one per learner pipeline
stage), receive one broadcast sync into the engine and record its log-probs of the spec's sequences.

    python tests/distributed/sync_receiver.py --spec S.json --out R.pt
"""

from __future__ import annotations


import torch

from megapo.engines.embedded import EmbeddedEngine
from megapo.weights.broadcast import BroadcastReceiver, GroupAddress, join_group
from spec_io import read_spec  # this script's folder is on sys.path


def engine_logprobs(engine: EmbeddedEngine, sequences: list[list[int]]) -> list[torch.Tensor]:
    """log p(seq[t] | seq[:t]) for t >= 1 under the engine's forward (fp32)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        logp = torch.log_softmax(engine.model.logits(ids)[0].float(), dim=-1)
        out.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
    return out


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for case in spec["cases"]:
        engine = EmbeddedEngine(case["model_dir"])
        address = GroupAddress(spec["host"], case["port"], workers=1, timeout_s=300)
        groups = [join_group(address, stage, rank=1) for stage in range(case["pp"])]
        receiver = BroadcastReceiver(groups)
        engine.pause()  # large tensors are written straight into the engine's weights
        version, moved = receiver.receive(engine.update_weights, engine.weight_buffers())
        engine.resume()
        acked = receiver.finish(version)
        results[case["name"]] = {"broadcast": engine_logprobs(engine, spec["sequences"]), "version": version,
                                 "engine_version": engine.weight_version, "acked": acked, "bytes": moved.bytes}
    torch.save(results, out_path)


if __name__ == "__main__":
    main()

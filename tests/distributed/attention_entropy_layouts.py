"""Run under torchrun (or alone for world 1) by tests/test_attention_entropy.py: for each run (a model under a
layout, a packing and a prefix-sharing mode), a Learner computes Learner.response_attention_entropy of the batch at
each requested layer. Rank 0 saves {run name: {layer: [per-sequence entropies]}}.

SPEC.json: {"runs": [{"name": ..., "model": DIR, "layout": {"tp": 2, "pp": 1, "ep": 1, "dp": 1},
                      "micro_batch_tokens": N, "row_tokens": N, "share_prefix": "off" | "auto"}, ...],
            "batch": [{"tokens": [...], "prompt_len": p}, ...], "layers": [0, -1, ...]}
"""

from __future__ import annotations

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from spec_io import finish, read_spec  # this script's folder is on sys.path


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    sequences = [b["tokens"] for b in spec["batch"]]
    prompt_lens = [b["prompt_len"] for b in spec["batch"]]
    for run in spec["runs"]:
        layout = run["layout"]
        parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], dp=layout["dp"])
        learner = Learner(run["model"], parallel, OptimConfig(), micro_batch_tokens=run["micro_batch_tokens"],
                          row_tokens=run["row_tokens"], share_prefix=run["share_prefix"])
        results[run["name"]] = {layer: learner.response_attention_entropy(sequences, prompt_lens, layer)
                                for layer in spec["layers"]}
        results[run["name"]]["packed_tokens"] = learner.packed_tokens
        learner.close()
    finish(results, out_path)


if __name__ == "__main__":
    main()

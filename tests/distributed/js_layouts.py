"""Run by tests/test_mrtpo.py (plain python for world 1, torchrun for world 2): Learner.response_js_distance (MRTPO's
input) on the tiny MoE under each layout of the spec, each with one-sequence rows and again with the pairs packed
several to a row. Rank 0 saves {layout name (+ "/rows"): the distances (one tensor per pair)}.

SPEC.json: {"model": DIR, "layouts": [{"tp": 2, "pp": 1, "ep": 1, "dp": 1}, ...], "sequences": [[...], ...],
            "prompt_lens": [...], "context_sequences": [[...], ...], "context_prompt_lens": [...]}
"""

from __future__ import annotations

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from spec_io import finish, read_spec  # this script's folder is on sys.path


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for layout in spec["layouts"]:
        name = "_".join(f"{k}{v}" for k, v in layout.items())
        for suffix, packing in (("", dict(micro_batch_tokens=40, row_tokens=1)),
                                ("/rows", dict(micro_batch_tokens=4096, row_tokens=64))):
            learner = Learner(spec["model"], ParallelConfig(**layout), OptimConfig(), **packing)
            results[name + suffix] = learner.response_js_distance(
                spec["sequences"], spec["prompt_lens"], spec["context_sequences"], spec["context_prompt_lens"])
            learner.close()
    finish(results, out_path)


if __name__ == "__main__":
    main()

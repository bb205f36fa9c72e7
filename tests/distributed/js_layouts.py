"""Run by tests/test_mrtpo.py (plain python for world 1, torchrun for world 2): Learner.response_js_distance (MRTPO's
input) on the tiny MoE under each layout of the spec, each with one-sequence rows and again with the pairs packed
several to a row. Rank 0 saves {layout name (+ "/rows"): the distances (one tensor per pair)}. With "more_contexts"
(MRTPO's K = 2 components), each packing also runs Learner.response_js_distances on [context_sequences,
more_contexts] and the two response_js_distance passes it replaces, counting the learner's passes (Learner._run calls)
and the tokens they pack: {"multi:" + name (+ "/rows" or "/chunked", the latter a budget that holds only pairs):
{"one": [K, tokens] per sequence, "separate": per list the distances, "passes": {...}, "tokens": {...}}}.

SPEC.json: {"model": DIR, "layouts": [{"tp": 2, "pp": 1, "ep": 1, "dp": 1}, ...], "sequences": [[...], ...],
            "prompt_lens": [...], "context_sequences": [[...], ...], "context_prompt_lens": [...],
            "more_contexts": [[...], ...], "more_context_prompt_lens": [...], "chunked_budget": N (optional)}
"""

from __future__ import annotations

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from spec_io import finish, read_spec  # this script's folder is on sys.path


def counting(learner: Learner) -> list:
    """Wraps learner._run (one call: one pass); each call appends the tokens the pass packed (packed_tokens)."""
    calls, run = [], learner._run

    def counted(micro_batches, loss_func, forward_only):
        calls.append(learner.packed_tokens)
        return run(micro_batches, loss_func, forward_only)

    learner._run = counted
    return calls


def components(learner: Learner, spec: dict) -> dict:
    """K = 2 context lists: the two separate paired passes, then response_js_distances, each counted."""
    seqs, plens = spec["sequences"], spec["prompt_lens"]
    lists = [(spec["context_sequences"], spec["context_prompt_lens"]),
             (spec["more_contexts"], spec["more_context_prompt_lens"])]
    calls = counting(learner)
    separate = [learner.response_js_distance(seqs, plens, c, lens) for c, lens in lists]
    passes, tokens = len(calls), sum(calls)
    calls.clear()
    one = learner.response_js_distances(seqs, plens, [c for c, _ in lists], [lens for _, lens in lists])
    return dict(one=one, separate=separate, passes=dict(separate=passes, one=len(calls)),
                tokens=dict(separate=tokens, one=sum(calls)))


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for layout in spec["layouts"]:
        name = "_".join(f"{k}{v}" for k, v in layout.items())
        packings = [("", dict(micro_batch_tokens=40, row_tokens=1)),
                    ("/rows", dict(micro_batch_tokens=4096, row_tokens=64))]
        if spec.get("chunked_budget"):
            packings.append(("/chunked", dict(micro_batch_tokens=spec["chunked_budget"], row_tokens=1)))
        for suffix, packing in packings:
            learner = Learner(spec["model"], ParallelConfig(**layout), OptimConfig(), **packing)
            if suffix != "/chunked":
                results[name + suffix] = learner.response_js_distance(
                    spec["sequences"], spec["prompt_lens"], spec["context_sequences"], spec["context_prompt_lens"])
            if spec.get("more_contexts"):
                results["multi:" + name + suffix] = components(learner, spec)
            learner.close()
    finish(results, out_path)


if __name__ == "__main__":
    main()

"""Run by tests/test_thr.py (plain python for world 1, torchrun for world 2): THR's two inputs on the tiny MoE under
each layout of the spec, first as the two passes DelTA and a lone old_vocab_logp take (Learner.response_hidden, then
Learner.response_logp_at), then from one pass (Learner.response_hidden_logp_at), counting the learner's passes
(Learner._run calls) and the micro-batch forwards in them. Rank 0 saves {layout name: {"separate": (hidden, logp),
"one": (hidden, logp), "passes": {"separate": n, "one": n}, "forwards": {...}}}.

SPEC.json: {"model": DIR, "layouts": [{"tp": 2, "pp": 1, "ep": 1, "dp": 1}, ...], "sequences": [[...], ...],
            "prompt_lens": [...], "ids": [...], "micro_batch_tokens": N, "row_tokens": N}
"""

from __future__ import annotations

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from spec_io import finish, read_spec  # this script's folder is on sys.path


def counting(learner: Learner) -> list:
    """Wraps learner._run (one call: one pass over its micro-batches); each call appends its micro-batch count."""
    calls, run = [], learner._run

    def counted(micro_batches, loss_func, forward_only):
        calls.append(len(micro_batches))
        return run(micro_batches, loss_func, forward_only)

    learner._run = counted
    return calls


def main() -> None:
    spec, out_path = read_spec()
    seqs, plens, ids = spec["sequences"], spec["prompt_lens"], spec["ids"]
    results = {}
    for layout in spec["layouts"]:
        learner = Learner(spec["model"], ParallelConfig(**layout), OptimConfig(),
                          micro_batch_tokens=spec["micro_batch_tokens"], row_tokens=spec["row_tokens"])
        calls = counting(learner)
        separate = (learner.response_hidden(seqs, plens), learner.response_logp_at(seqs, plens, ids))
        passes, forwards = len(calls), sum(calls)
        calls.clear()
        one = learner.response_hidden_logp_at(seqs, plens, ids)
        results["_".join(f"{k}{v}" for k, v in layout.items())] = dict(
            separate=separate, one=one, passes=dict(separate=passes, one=len(calls)),
            forwards=dict(separate=forwards, one=sum(calls)))
        learner.close()
    finish(results, out_path)


if __name__ == "__main__":
    main()

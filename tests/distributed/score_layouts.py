"""Run by tests/test_rm_train.py (plain python for one process, torchrun for more): a trainable Megatron score model
(megapo/learner/score.py) for each layout of the spec:

- "scores": every sequence's score (the chosen sequences, then the rejected ones);
- "metrics": backward_pairs' Bradley-Terry loss of the spec's pairs;
- "grads": the gradient it left, gathered to HF names (spec_io.hf_grads), before any optimizer step;
- "prefix_scores": the score of every prefix of the spec's prefix sequences from their start on (prefix_scores,
  dense rewards), taken before backward_pairs (a forward without gradients).
Rank 0 saves everything to --out.
"""

from __future__ import annotations

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.score import ScoreModel
from spec_io import finish, hf_grads, read_spec  # this script's folder is on sys.path


def run_layout(spec: dict, layout: dict) -> dict:
    pairs = [tuple(p) for p in spec["pairs"]]
    model = ScoreModel(spec["model"], ParallelConfig(**layout), OptimConfig(lr=1e-3), frozen=False,
                       micro_batch_tokens=spec["micro_batch_tokens"])
    out = {"scores": model.scores([c for c, _ in pairs] + [r for _, r in pairs])}
    prefix = spec["prefix"]
    out["prefix_scores"] = [t.tolist() for t in model.prefix_scores(prefix["sequences"], prefix["starts"])]
    out["metrics"] = model.backward_pairs(pairs)
    out["grads"] = hf_grads(model.learner)
    model.close()
    return out


def main() -> None:
    spec, out_path = read_spec()
    results = {"_".join(f"{k}{v}" for k, v in layout.items()): run_layout(spec, layout) for layout in spec["layouts"]}
    finish(results, out_path)


if __name__ == "__main__":
    main()

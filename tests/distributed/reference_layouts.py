"""Run by tests/test_reference.py (plain python for one process, torchrun for more): the Megatron KL reference
(megapo/learner/reference.py) beside a learner of the same layout, for each layout of the spec:

- "free":      reference log-probs of the batch's response tokens, free routing;
- "replayed":  the same replaying the spec's routes (sample["routes"], as r2/r3 leave them for training);
- "learner_replayed": the learner's response log-probs replaying those routes (same weights at the start);
- "after":     the reference's free log-probs again after the learner took an optimizer step, and the
               learner's own (which the step moved);
- "frozen":    the reference's local parameters all without requires_grad and grad, its optimizer None, its
               local parameter count beside the learner's, and whether its train_step refused;
- "teachers":  for each of the spec's teacher folders (other weights than the student's), the teacher that
               megapo/trainer/distill.py builds for `algorithm.distill.teacher` under this layout with
               routing_replay r3: its free and replayed log-probs, whether it replays the student's routes, and its
               top-5 ids and log-probs at each response token (free routing; MegatronReference.response_topk).
Rank 0 saves everything to --out.
"""

from __future__ import annotations

import numpy as np
import torch

from megapo.config import OptimConfig, ParallelConfig, load_config
from megapo.learner.learner import Learner
from megapo.learner.reference import MegatronReference
from megapo.trainer.config import RunConfig
from megapo.trainer.distill import build_teacher
from spec_io import finish, read_spec  # this script's folder is on sys.path


def response(full, batch):
    return [lp[s["prompt_len"] - 1:].tolist() for lp, s in zip(full, batch)]


def run_layout(spec: dict, layout: dict) -> dict:
    parallel = ParallelConfig(**layout)
    batch = spec["batch"]
    routed = [dict(s, routes=np.asarray(r, dtype=np.int32)) for s, r in zip(batch, spec["routes"])]
    sequences = [s["tokens"] for s in batch]
    learner = Learner(spec["model"], parallel, OptimConfig(lr=1e-2, warmup_steps=0), routing_replay=True,
                      micro_batch_tokens=spec["micro_batch_tokens"])
    rng_before = torch.get_rng_state()
    ref = MegatronReference(spec["model"], parallel, micro_batch_tokens=spec["micro_batch_tokens"],
                            routing_replay=True)
    out = {"rng_kept": bool(torch.equal(rng_before, torch.get_rng_state()))}
    out["free"] = ref.response_logprobs(batch)
    out["replayed"] = ref.response_logprobs(routed)
    out["learner_replayed"] = response(learner.logprobs(sequences, routes=[s["routes"] for s in routed]), batch)
    learner.train_step([dict(s, old_logp=lp) for s, lp in zip(batch, out["free"])], "reinforce", "token-mean")
    out["after"] = {"reference": ref.response_logprobs(batch), "learner": response(learner.logprobs(sequences), batch)}
    params = list(ref.model.module.parameters())
    try:
        ref.model.train_step(batch, "reinforce")
        refused = False
    except RuntimeError:
        refused = True
    out["frozen"] = {"requires_grad": any(p.requires_grad for p in params), "grads": any(p.grad is not None for p in params),
                     "optimizer": ref.model.optimizer is not None, "numel": sum(p.numel() for p in params),
                     "learner_numel": sum(p.numel() for p in learner.module.parameters()), "train_refused": refused}
    out["teachers"] = {name: teacher_logprobs(spec, layout, path, batch, routed)
                       for name, path in spec.get("teachers", {}).items()}
    ref.close()
    learner.close()
    return out


def teacher_logprobs(spec: dict, layout: dict, teacher: str, batch: list, routed: list) -> dict:
    """The teacher of a run config with algorithm.distill.teacher=`teacher` (built by megapo.trainer.distill)."""
    items = {"model.path": spec["model"], "data.task": "addition", "algorithm.distill.teacher": teacher,
             "algorithm.routing_replay": "r3", "train.micro_batch_tokens": spec["micro_batch_tokens"],
             "data.max_prompt_tokens": 16, "rollout.max_new_tokens": 8, "train.output_dir": "/tmp/unused_teacher",
             **{f"parallel.{k}": v for k, v in layout.items()}}
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in items.items()])
    model = build_teacher(cfg, spec["model"])
    out = {"free": model.response_logprobs(batch), "replayed": model.response_logprobs(routed),
           "replays": model.model.route_hook is not None,
           # topk_forward_kl's teacher values: its 5 most likely ids per response token, free routing
           "topk": [(ids.tolist(), logp.tolist()) for ids, logp in model.response_topk(batch, 5)]}
    model.close()
    return out


def main() -> None:
    spec, out_path = read_spec()
    results = {"_".join(f"{k}{v}" for k, v in layout.items()): run_layout(spec, layout) for layout in spec["layouts"]}
    finish(results, out_path)


if __name__ == "__main__":
    main()

"""Run by tests/test_learner.py (one process, or under torchrun): an on-policy step with the separate
old-log-prob pass and without it, from the same weights, for each routing replay mode.

For each mode: learner A runs the two-pass step the trainer ran before (old_logprobs, mismatch_kl, then
train_step on π_old from that pass); learner B runs on_policy_step (π_old from the train forward; under
r3 the free-routing pass for the KL first). Rank 0 saves both sides' metrics and weights after the step.

SPEC.json: {"model": DIR, "samples": [sample, ...], "modes": ["off", "r2", "r3"], "optim": {...},
            "layout": {"tp": 1, ...}, "micro_batch_tokens": N, "objective": "gspo", "loss_agg": "..."}
"""

from __future__ import annotations

import copy

import numpy as np

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.replay.modes import free_logprobs, mismatch_kl, old_logprobs, on_policy_step
from spec_io import finish, read_spec  # this script's folder is on sys.path


def two_passes(learner, samples, mode, spec) -> dict:
    logps, metrics = old_logprobs(learner, samples, mode)
    for s, lp in zip(samples, logps):
        s["old_logp"] = lp.tolist()
    if mode != "off":
        metrics.update(mismatch_kl(learner, samples, logps, free_logps=logps if mode == "r2" else None))
    train = learner.train_step(samples, spec["objective"], spec["loss_agg"])
    return {**metrics, **{f"train/{k}": v for k, v in train.items()}}


def one_pass(learner, samples, mode, spec) -> dict:
    free = free_logprobs(learner, samples, mode) if mode != "off" else None
    train, metrics = on_policy_step(learner, samples, mode, spec["objective"], spec["loss_agg"], measure_kl=True,
                                    free_logps=free)
    return {**metrics, **{f"train/{k}": v for k, v in train.items()}}


def run_modes(model: str, samples: list[dict], modes: list[str], layout: dict, spec: dict) -> dict:
    """{mode/side: {"metrics", "weights"}} for both sides of every mode (collective)."""
    results = {}
    for mode in modes:
        for side, step in (("two_passes", two_passes), ("one_pass", one_pass)):
            learner = Learner(model, ParallelConfig(**layout), OptimConfig(**spec["optim"]),
                              micro_batch_tokens=spec["micro_batch_tokens"], routing_replay=mode != "off")
            batch = copy.deepcopy(samples)
            for s in batch:
                s["routes"] = np.asarray(s["routes"]) if mode == "r3" else None
            metrics = step(learner, batch, mode, spec)
            results[f"{mode}/{side}"] = {"metrics": metrics, "weights": dict(learner.hf_state_dict())}
            learner.close()
    return results


def main() -> None:
    spec, out_path = read_spec()
    finish(run_modes(spec["model"], spec["samples"], spec["modes"], spec["layout"], spec), out_path)


if __name__ == "__main__":
    main()

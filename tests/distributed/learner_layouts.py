"""Run under torchrun by tests/test_learner_layouts.py: for each layout (all with this world size),
each model and each MoE dispatcher, build a Learner, compute log-probs of the given sequences, do one
train step on the given batch and gather the updated weights to HF names. Rank 0 saves everything.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/learner_layouts.py \
        --spec SPEC.json --out RESULTS.pt

SPEC.json: {"models": {"moe": DIR, "dense": DIR}, "layouts": [{"tp": 2, "pp": 1, "ep": 1, "dp": 1}, ...],
            "save_dir": DIR (a layout with "save": true: its MoE learner saves after one step, takes a second;
                        then a fresh learner of that layout loads the checkpoint and takes the second step),
            "load_dir": DIR (a MoE learner of the first layout loads only the weights of that checkpoint),
            "agg_variants": [{"loss_agg": ..., "micro_batch_tokens": N}, ...] (one MoE step each, first layout),
            "dispatchers": ["alltoall", ...] (the MoE token dispatchers each layout runs with; default both),
            "sequences": [[...], ...], "batch": [sample, ...], "optim": {...}, "micro_batch_tokens": N,
            "row_tokens": N (1: one sequence per row), "objective": "reinforce", "loss_agg": "token-mean",
            "rows_variant": {"row_tokens": N, "micro_batch_tokens": N} (every layout/model/dispatcher runs
                            again packed so: key + "/rows")}
A dense model runs every layout with ep=1 (same tp, pp, dp).
"""

from __future__ import annotations


import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.attention_entropy import attention_kind_error
from megapo.learner.learner import Learner
from megapo.layout import num_experts, read_hf_config
from spec_io import finish, hf_grads, read_spec  # this script's folder is on sys.path


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for layout in spec["layouts"]:
        for model_name, model_dir in spec["models"].items():
            moe = num_experts(read_hf_config(model_dir)) > 0
            dispatchers = spec.get("dispatchers", ["alltoall", "allgather"]) if moe else ["alltoall"]
            for dispatcher in dispatchers:
                parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"] if moe else 1,
                                          dp=layout["dp"], dispatcher=dispatcher,
                                          distributed_optimizer=layout.get("distributed_optimizer", False),
                                          recompute=layout.get("recompute", False))
                learner = Learner(model_dir, parallel, OptimConfig(**spec["optim"]),
                                  micro_batch_tokens=spec["micro_batch_tokens"], row_tokens=spec["row_tokens"])
                key = f"{model_name}/{_name(layout)}/{dispatcher}"
                results[key] = _logprobs_and_step(learner, spec)
                if layout.get("save") and model_name == "moe" and dispatcher == "alltoall":
                    learner.save(spec["save_dir"])  # after one step
                    learner.train_step(spec["batch"], spec["objective"], spec["loss_agg"])
                    results[key]["two_step_weights"] = dict(learner.hf_state_dict())
                learner.close()
                if spec.get("rows_variant"):  # the same batch packed into [rows x width] micro-batches
                    learner = Learner(model_dir, parallel, OptimConfig(**spec["optim"]), **spec["rows_variant"])
                    results[key + "/rows"] = _logprobs_and_step(learner, spec)
                    learner.close()
        if layout.get("save"):  # resume from the checkpoint under the same layout and take step two
            learner = _learner(spec, layout, spec["models"]["moe"])
            learner.load(spec["save_dir"])
            learner.train_step(spec["batch"], spec["objective"], spec["loss_agg"])
            results["moe/resumed"] = {"two_step_weights": dict(learner.hf_state_dict()), "step": learner.step}
            learner.close()
    for i, variant in enumerate(spec.get("agg_variants", [])):  # other loss aggregations / micro-batch budgets
        layout = spec["layouts"][0]
        parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], dp=layout["dp"])
        learner = Learner(spec["models"]["moe"], parallel, OptimConfig(**spec["optim"]),
                          micro_batch_tokens=variant["micro_batch_tokens"])
        metrics = learner.train_step(spec["batch"], spec["objective"], variant["loss_agg"])
        results[f"moe/variant{i}"] = {"weights": dict(learner.hf_state_dict()), "loss": metrics["loss"], **variant}
        learner.close()
    if spec.get("load_dir"):  # the weights of a checkpoint saved under another layout (resharded)
        learner = _learner(spec, spec["layouts"][0], spec["models"]["moe"])
        learner.load(spec["load_dir"], load_optimizer=False)
        results["moe/loaded"] = {"weights": dict(learner.hf_state_dict())}
        learner.close()
    finish(results, out_path)


def _logprobs_and_step(learner: Learner, spec: dict) -> dict:
    logprobs = learner.logprobs(spec["sequences"])
    hidden = learner.response_hidden([b["tokens"] for b in spec["batch"]], [b["prompt_len"] for b in spec["batch"]])
    out = {"logprobs": logprobs, "hidden": hidden}
    if attention_kind_error(learner.spec, 0, learner.backend.use_te) is None:  # not with sinks (gpt_oss), MLA, TE
        # layer 0: under PP=2 a stage other than the last holds it
        out["attention_entropy"] = learner.response_attention_entropy([b["tokens"] for b in spec["batch"]],
                                                                      [b["prompt_len"] for b in spec["batch"]], layer=0)
    metrics = learner.train_step(spec["batch"], spec["objective"], spec["loss_agg"])
    out.update(weights=dict(learner.hf_state_dict()), grad_norm=metrics["grad_norm"], loss=metrics["loss"])
    if not learner.parallel.distributed_optimizer:  # (its grad buffers hold only this rank's reduced shard)
        out["grads"] = hf_grads(learner)
    return out


def _learner(spec: dict, layout: dict, model_dir: str) -> Learner:
    parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], dp=layout["dp"])
    return Learner(model_dir, parallel, OptimConfig(**spec["optim"]), micro_batch_tokens=spec["micro_batch_tokens"],
                   row_tokens=spec["row_tokens"])


def _name(layout: dict) -> str:
    return "_".join(f"{k}{int(v)}" for k, v in layout.items())


if __name__ == "__main__":
    main()

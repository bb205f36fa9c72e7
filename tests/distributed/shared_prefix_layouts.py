"""Run under torchrun (or alone for world 1) by tests/test_shared_prefix.py: for each run (a model under a layout)
and each routing mode (free; r2: the routes a free pass recorded; r3: engine routes, the same on a prompt's
positions for all its samples except in a "diverging" group), the same learner computes log-probs and
entropies, then takes one on-policy step (kept log-probs, loss, entropy, gradients gathered to HF names), with
shared-prefix packing off and then auto. Rank 0 saves both.

SPEC.json: {"runs": [{"model": DIR, "layout": {"tp": 2, "pp": 1, "ep": 1, "dp": 1, ...}}, ...],
            "batch": [{tokens, prompt_len, advantage, group, diverges}, ...], "modes": ["free", "r2", "r3"],
            "micro_batch_tokens": N, "row_tokens": N, "objective": "gspo", "strict": bool (also try share_prefix=on
            with the diverging r3 routes, keeping the error)}
"""

from __future__ import annotations

import copy

import numpy as np

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.replay.routes import RouteShape
from spec_io import finish, hf_grads, read_spec  # this script's folder is on sys.path

# lr 0 at the first step, then lr / 1e9 (warm-up): the weights stay put between the passes compared
OPTIM = OptimConfig(lr=1e-3, warmup_steps=10**9)


def main() -> None:
    spec, out_path = read_spec()
    results = {}
    for run in spec["runs"]:
        layout = run["layout"]
        parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], dp=layout["dp"],
                                  distributed_optimizer=layout.get("distributed_optimizer", False))
        learner = Learner(run["model"], parallel, OPTIM, micro_batch_tokens=spec["micro_batch_tokens"],
                          row_tokens=spec["row_tokens"], routing_replay=True)
        engine_routes = _engine_routes(spec["batch"], RouteShape.from_spec(learner.spec))
        for mode in spec["modes"]:
            for share in ("off", "auto"):
                learner.share_prefix = share
                results[f"{run['name']}/{mode}/{share}"] = _passes(learner, spec, mode, engine_routes)
        if spec.get("strict"):
            learner.share_prefix = "on"
            try:
                _passes(learner, spec, "r3", engine_routes)
                results[f"{run['name']}/strict_error"] = None
            except ValueError as exc:
                results[f"{run['name']}/strict_error"] = str(exc)
        learner.close()
    finish(results, out_path)


def _engine_routes(batch: list[dict], shape: RouteShape) -> list[np.ndarray]:
    """Routes as an engine that prefills each prompt once reports them: a group's samples share the routes of
    every position their tokens share, except a diverging group, whose samples agree only before the prompt's
    second-to-last token."""
    rng = np.random.default_rng(0)

    def random_routes(n: int) -> np.ndarray:
        scores = rng.random((n, shape.num_moe_layers, shape.num_experts))
        return np.argsort(-scores, axis=-1)[..., :shape.topk].astype(np.int64)

    routes, first_of_group = [], {}
    for s in batch:
        own = random_routes(len(s["tokens"]) - 1)
        lead = first_of_group.setdefault(s["group"], (s, own))
        if lead[0] is not s:
            common = 0
            while common < len(own) and lead[0]["tokens"][common] == s["tokens"][common]:
                common += 1
            if s.get("diverges"):  # the prompt's second-to-last token already routed differently
                common = s["prompt_len"] - 2
            own[:common] = lead[1][:common]
        routes.append(own)
    return routes


def _passes(learner: Learner, spec: dict, mode: str, engine_routes: list[np.ndarray]) -> dict:
    batch = copy.deepcopy(spec["batch"])
    sequences = [s["tokens"] for s in batch]
    routes = engine_routes if mode == "r3" else None
    out = {}
    out["logprobs"], out["entropies"] = learner.logprobs(sequences, routes=routes, with_entropy=True,
                                                         prompt_lens=[s["prompt_len"] for s in batch])
    out["packed_logprobs"] = learner.packed_tokens
    used = learner.route_hook.routes_used(len(sequences))
    learner.route_hook.take_counts()
    if mode == "r2":  # replay what the free pass routed
        out["recorded"] = used
    for s, r in zip(batch, used if mode == "r2" else routes or [None] * len(batch)):
        s["routes"] = r
    metrics, old = learner.train_step_on_policy(batch, spec["objective"], keep_logprobs=True, keep_entropy=True)
    out.update(loss=metrics["loss"], entropy=metrics["entropy"], grad_norm=metrics["grad_norm"],
               packed=metrics["packed_tokens"], old_logprobs=old["logprobs"], old_entropies=old["entropies"])
    if not learner.parallel.distributed_optimizer:  # (its grad buffers hold only this rank's reduced shard)
        out["grads"] = hf_grads(learner)
    return out


if __name__ == "__main__":
    main()

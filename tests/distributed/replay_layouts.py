"""Run under torchrun by tests/test_replay_layouts.py: routing replay on the real Megatron-core learner
for several parallel layouts of one world size. For each layout, on the perturbed tiny model:

- "full":    `megapo logprobs --routes-in FULL.npz --routes-out OUT.npz` (the command's own replay
             code, megapo.commands.logprobs_routes.logprobs) -> log-probs and the routes written;
- "partial": the same with PARTIAL.npz (a missing key, short arrays, -1 entries);
- "free":    routes recorded with no routes given (the router's own choice);
- "metrics": replay metrics of a FULL pass;
- "train":   one train step replaying FULL with a linear loss -(adv*logp).sum()/N, then the router
             gradients (full [E, H] per MoE layer, gathered over stages), the loss and the routes used;
- "r2" (layout flag): old-log-prob pass (free, recorded) then two optimizer steps replaying it;
             the routes of every pass and the free routes after the updates;
- "r3" (layout flag): engine samples (spec) through old_logprobs(..., "r3") and mismatch_kl before any
             optimizer step, and a train step replaying them after the others;
- "stage":   FULL replayed with the routes handed out as the trainer hands out a train batch (megapo.trainer.handout:
             broadcast whole with PP=1; with PP>1 rank 0 keeps every MoE layer and the other ranks get only their
             stage's columns): log-probs, routes used, metrics, and per rank the routes received and the
             columns its hook saw ("train" hands out its batch routes the same way and records the same);
- "rows":    a learner packing [rows x width] micro-batches (spec "rows_variant"; the main learner has one
             sequence per row): FULL replay's log-probs and routes, and the "train" step's router gradients;
- "on_policy" (layout flag): on_policy_step.run_modes for r2 and r3 on the engine samples (fresh learners).
Rank 0 saves everything to --out.

    python -m torch.distributed.run --nproc-per-node 4 tests/distributed/replay_layouts.py --spec S.json --out R.pt
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.commands import logprobs_routes as route_cli
from megapo.replay.modes import logprobs_with_routes, mismatch_kl, old_logprobs
from megapo.engines.base import Sample
from megapo.replay.routes import load_routes
from megapo.tasks.base import Example
from megapo.trainer.handout import hand_out, rank_route_layers
from megapo.trainer.rollout import Group
from on_policy_step import run_modes  # this script's folder is on sys.path
from spec_io import finish, read_spec


def linear_loss(loss, logp, old_logp, advantages, mask, rollout_logp=None, *, cu_seqlens=None,
                global_tokens=None, global_seqs=None, **inputs):  # the learner's loss_fn; `loss` (a LossSpec) unread
    return -(advantages * logp).sum() / global_tokens, {}


def router_grads(learner) -> dict[int, torch.Tensor]:
    """{global layer: router weight gradient} of the whole model, on every rank."""
    mine = {}
    for layer in learner.module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            mine[layer.layer_number - 1] = router.weight.main_grad.detach().float().cpu().clone()
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    out = {}
    for p in parts:
        out.update(p)
    return out


def handed_out(routes, rank_layers) -> list:
    """Rank 0's `routes` (one array per sequence) on every rank as the trainer hands a train batch out
    (megapo.trainer.handout.hand_out): the routes this rank receives."""
    groups = None
    if torch.distributed.get_rank() == 0:
        groups = [Group(Example("", ""), [Sample([], [], [], "stop", 0, routes=r)], [0.0]) for r in routes]
    return [g.samples[0].routes for g in hand_out(groups, rank_layers)]


def per_rank(obj) -> list:
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, obj)
    return parts


def rows_variant(spec: dict, parallel: ParallelConfig, seqs, batch) -> dict:
    """FULL replay and the replayed train step with [rows x width] micro-batches."""
    learner = Learner(spec["model"], parallel, OptimConfig(**spec["optim"]), routing_replay=True,
                      loss_fn=linear_loss, **spec["rows_variant"])
    logps, used, _ = logprobs_with_routes(learner, seqs, load_routes(spec["full_npz"], len(seqs)))
    train_batch = [dict(s, routes=r) for s, r in zip(batch, load_routes(spec["batch_npz"], len(batch)))]
    metrics = learner.train_step(train_batch, "reinforce", "token-mean")
    out = {"logprobs": logps, "routes_out": used, "train": {"metrics": metrics, "grads": router_grads(learner),
                                                             "routes": learner.route_hook.routes_used(len(batch))}}
    learner.close()
    return out


def main() -> None:
    spec, out_path = read_spec()
    seqs, batch = spec["sequences"], spec["batch"]
    work = Path(spec["work_dir"])
    results = {}
    for layout in spec["layouts"]:
        name = "_".join(f"{k}{v}" for k, v in layout.items())
        parallel = ParallelConfig(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], dp=layout["dp"],
                                  dispatcher=layout.get("dispatcher", "alltoall"),
                                  recompute=layout.get("recompute", False))
        learner = Learner(spec["model"], parallel, OptimConfig(**spec["optim"]), routing_replay=True,
                          micro_batch_tokens=spec["micro_batch_tokens"], row_tokens=spec["row_tokens"],
                          loss_fn=linear_loss)
        # Megatron's global RouterReplay list holds exactly this model's routers of this rank, although
        # earlier layouts built models in this process too
        from megatron.core.transformer.moe.router_replay import RouterReplay

        res = {"instances": (len(RouterReplay.global_router_replay_instances), len(learner.route_hook.routers),
                             sum(1 for layer in learner.module.decoder.layers if hasattr(layer.mlp, "router")))}
        for case in ("full", "partial"):
            out = work / f"{name}_{case}_out.npz"
            cli_args = SimpleNamespace(routes_in=spec[f"{case}_npz"], routes_out=str(out))
            logps = route_cli.logprobs(learner, seqs, cli_args)
            torch.distributed.barrier()  # rank 0 wrote --routes-out
            res[case] = {"logprobs": logps, "routes_out": load_routes(out, len(seqs))}
        _, free, _ = logprobs_with_routes(learner, seqs, None)
        res["free"] = free
        _, _, res["metrics"] = logprobs_with_routes(learner, seqs, load_routes(spec["full_npz"], len(seqs)))
        rank_layers = rank_route_layers(learner)  # None unless PP gives ranks different MoE layers
        received = handed_out(load_routes(spec["full_npz"], len(seqs)), rank_layers)
        logps, used, m = logprobs_with_routes(learner, seqs, received)
        res["stage"] = {"rank_layers": rank_layers, "received": per_rank(received),
                        "columns": per_rank(learner.route_hook.given_columns), "logprobs": logps, "routes_out": used,
                        "metrics": m}

        if layout.get("r3"):  # before any optimizer step: log-probs and KL comparable to the HF reference
            engine_routes = [torch.tensor(s["routes"]).numpy() for s in spec["engine_samples"]]
            r3_samples = [dict(s, routes=r) for s, r in zip(spec["engine_samples"], engine_routes)]
            old, m_old = old_logprobs(learner, r3_samples, "r3")
            kl = mismatch_kl(learner, r3_samples, old)
            res["r3"] = {"engine_routes": engine_routes, "old_routes": [s["routes"] for s in r3_samples],
                         "old_metrics": m_old, "kl": kl, "old_logp": old}

        received = handed_out(load_routes(spec["batch_npz"], len(batch)), rank_layers)  # PP=2: stage columns
        train_batch = [dict(s, routes=r) for s, r in zip(batch, received)]
        metrics = learner.train_step(train_batch, "reinforce", "token-mean")
        res["train"] = {"metrics": metrics, "grads": router_grads(learner),
                        "routes": learner.route_hook.routes_used(len(batch)), "received": per_rank(received),
                        "columns": per_rank(learner.route_hook.given_columns)}

        if layout.get("r2"):
            samples = [dict(s) for s in batch]
            old, m_old = old_logprobs(learner, samples, "r2")
            steps = []
            for _ in range(2):
                m = learner.train_step(samples, "reinforce", "token-mean")
                steps.append({"metrics": m, "routes": learner.route_hook.routes_used(len(samples))})
            _, free_after, _ = logprobs_with_routes(learner, [s["tokens"] for s in samples], None)
            res["r2"] = {"old_routes": [s["routes"] for s in samples], "old_metrics": m_old, "steps": steps,
                         "free_after": free_after}
        if layout.get("r3"):  # the train step (weights changed by then) only checks the routes replayed
            m = learner.train_step(r3_samples, "reinforce", "token-mean")
            res["r3"].update(train_metrics=m, train_routes=learner.route_hook.routes_used(len(r3_samples)))
        learner.close()
        res["rows"] = rows_variant(spec, parallel, seqs, batch)
        if layout.get("on_policy"):
            res["on_policy"] = run_modes(spec["model"], spec["engine_samples"], ["r2", "r3"], vars(parallel),
                                         dict(spec["on_policy"], optim=spec["optim"]))
        results[name] = res
    finish(results, out_path)


if __name__ == "__main__":
    main()

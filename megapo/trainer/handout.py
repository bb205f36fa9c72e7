"""How rank 0 hands each step's train batch (its groups) to the other ranks.

Rank 0 draws the groups; every rank trains on them. Without pipeline parallelism every rank replays every MoE
layer, so the groups are broadcast as they are (megapo.dist.broadcast_object). With PP > 1 a rank's route hook
replays only its stage's MoE layers (RouteReplayHook.layers), and a sample's routes [m, num_moe_layers, topk] are
most of the batch's bytes (docs/scaling.md, "Host memory of routes"): rank 0 then sends every other rank the
groups with each sample's routes cut to that rank's stage's columns (megapo.replay.routes.stage_columns), one
scatter over the default group (megapo.dist.scatter_object: the same group, hence the same timeout, as the
broadcast). Rank 0 keeps its groups whole: the engine-vs-learner router metrics (router/disagree, logged by
rank 0) compare every MoE layer. A cut group says so (Group.route_layers): its samples get no engine_routes
(megapo.trainer.update.train_samples), and the hook takes the columns as its own by their width
(megapo.replay.routes.given_columns). TP/SP ranks of one stage still receive all of its positions.
"""

from __future__ import annotations

import dataclasses

from megapo.dist import all_gather_object, broadcast_object, multi_process, rank, scatter_object
from megapo.learner.protocol import Learner
from megapo.replay.routes import stage_columns


def rank_route_layers(learner: Learner) -> list[list[int]] | None:
    """Every rank's MoE layers (its route hook's `layers`), gathered once at setup (collective), when ranks replay
    different ones (PP > 1); None when one broadcast of the whole batch serves them all (a single process, no
    route hook, or every rank holds the same MoE layers)."""
    if not multi_process():
        return None
    hook = learner.route_hook
    layers = all_gather_object(None if hook is None else list(hook.layers))
    if any(x is None for x in layers) or all(x == layers[0] for x in layers):
        return None
    return layers


def stage_groups(groups: list, rank_layers: list[list[int]]) -> list[list]:
    """Rank 0's groups as each rank gets them: rank 0 its own groups (whole, the same objects), rank r copies whose
    samples' routes hold only MoE layers rank_layers[r] (Group.route_layers says which); ranks of one stage share
    one copy. `groups` are not changed."""
    cut: dict[tuple[int, ...], list] = {}
    out = [groups]
    for layers in rank_layers[1:]:
        key = tuple(layers)
        if key not in cut:
            cut[key] = [dataclasses.replace(g, route_layers=list(layers), samples=[
                dataclasses.replace(s, routes=stage_columns(s.routes, layers)) for s in g.samples]) for g in groups]
        out.append(cut[key])
    return out


def hand_out(groups: list, rank_layers: list[list[int]] | None) -> list:
    """Rank 0's `groups` on every rank (collective): broadcast whole when `rank_layers` is None, else each rank's
    stage_groups (rank 0 keeps its own)."""
    if rank_layers is None:
        return broadcast_object(groups)
    return scatter_object(stage_groups(groups, rank_layers) if rank() == 0 else None)

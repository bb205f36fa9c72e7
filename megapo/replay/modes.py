"""Routing replay modes for the trainer, and the train-inference metrics.

  off  no replay: every pass routes freely.
  r2   the learner's old-log-prob pass routes freely and records its routes; every training pass of
       that batch replays them (so several optimizer steps on one rollout batch keep its routing).
  r3   the rollout engine's routes (Sample.routes) are replayed in the old-log-prob pass and in
       training (positions the engine gave no route for fall back to the learner's own choice in the
       old-log-prob pass, and that choice is then replayed in training too).

    logps, metrics = old_logprobs(learner, samples, "r3")     # sets sample["routes"] for training
    metrics |= learner.train_step(samples, "ppo")             # replay/disagree_post == 0
    metrics |= mismatch_kl(learner, samples, logps)           # k3 KL to the rollout, with/without replay

An on-policy step (one update on one mini-batch, π_old from the learner) needs no separate pass:
`on_policy_step` trains on the batch with π_old taken from the train forward, which under r2 routes
freely (replaying its own routing within the same forward would change nothing) and under r3 replays
the engine's routes, and reports the metrics the old-log-prob pass would have.

A learner for r2/r3 is built with routing_replay=True (megapo/replay/hook.py plugs into it).
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch


class ReplayMode(str, Enum):
    OFF = "off"
    R2 = "r2"
    R3 = "r3"


def parse_mode(value, name: str = "routing_replay") -> ReplayMode:
    try:
        return ReplayMode(value)
    except ValueError:
        raise ValueError(f"{name}: must be one of off, r2, r3; got {value!r}") from None


def logprobs_with_routes(learner, sequences: list[list[int]], routes=None):
    """learner.logprobs replaying `routes` (None: free routing) -> (logprobs, routes used, metrics).
    Collective (all ranks call); routes used: int32 [n-1, L, k] per sequence, on every rank."""
    hook = learner.route_hook
    if hook is None:
        raise ValueError("learner: built without routing_replay=True, so routes cannot be replayed or recorded")
    logps = learner.logprobs(sequences, routes=routes)
    used = hook.routes_used(len(sequences))
    return logps, used, hook.metrics()


def old_logprobs(learner, samples: list[dict], mode) -> tuple[list[torch.Tensor], dict]:
    """The old-log-prob pass of a rollout batch under `mode`. Returns the per-response-token log-probs
    (one tensor per sample) and metrics; for r2/r3 it sets sample["routes"] to the routes this pass used,
    which every train_step on these samples then replays."""
    mode = parse_mode(mode)
    sequences = [list(s["tokens"]) for s in samples]
    if mode is ReplayMode.OFF:
        full = learner.logprobs(sequences)
        metrics = {}
    else:
        given = [s.get("routes") for s in samples] if mode is ReplayMode.R3 else None
        if mode is ReplayMode.R3 and all(r is None for r in given):
            raise ValueError("samples: routing replay r3 needs the engine's routes "
                             "(SamplingParams(return_routes=True))")
        full, used, metrics = logprobs_with_routes(learner, sequences, given)
        for s, r in zip(samples, used):
            s["routes"] = r
    logps = [lp[s["prompt_len"] - 1:] for lp, s in zip(full, samples)]
    return logps, metrics


def mismatch_kl(learner, samples: list[dict], replayed_logps: list[torch.Tensor] | None = None,
                prefix: str = "replay/", free_logps: list[torch.Tensor] | None = None) -> dict:
    """Train-inference mismatch: mean per-token k3 KL(rollout || learner) over response tokens, with the
    learner replaying each sample's routes (`replayed_logps` from old_logprobs, or computed here) and
    with free routing (`free_logps`, or one extra forward pass). Needs sample["rollout_logp"]. Collective."""
    from megapo.algorithms.kl import kl_penalty

    sequences = [list(s["tokens"]) for s in samples]
    rollout = torch.cat([torch.as_tensor(s["rollout_logp"], dtype=torch.float32) for s in samples])

    def response(full):
        return torch.cat([lp[s["prompt_len"] - 1:] for lp, s in zip(full, samples)])

    if learner.route_hook is None:
        free = response(learner.logprobs(sequences))
        return {prefix + "kl_k3_free": float(kl_penalty(rollout, free, "k3").mean())}
    if replayed_logps is None:
        replayed = response(learner.logprobs(sequences, routes=[s.get("routes") for s in samples]))
    else:
        replayed = torch.cat(list(replayed_logps))
    if free_logps is None:
        free = response(learner.logprobs(sequences, routes=None))
    else:
        free = torch.cat(list(free_logps))
    learner.route_hook.metrics()  # these extra passes are not part of the step's routing metrics
    return {prefix + "kl_k3": float(kl_penalty(rollout, replayed, "k3").mean()),
            prefix + "kl_k3_free": float(kl_penalty(rollout, free, "k3").mean())}


def free_logprobs(learner, samples: list[dict], mode) -> list[torch.Tensor] | None:
    """The response log-probs under free routing that mismatch_kl's kl_k3_free needs, taken before an
    on-policy step changes the weights: one forward pass under r3 (None otherwise: under r2 the step's
    own forward routes freely, and without replay there is nothing to compare). Collective."""
    if parse_mode(mode) is not ReplayMode.R3:
        return None
    full = learner.logprobs([list(s["tokens"]) for s in samples], routes=None)
    learner.route_hook.metrics()  # not part of the step's routing metrics
    return [lp[s["prompt_len"] - 1:] for lp, s in zip(full, samples)]


def on_policy_step(learner, samples: list[dict], mode, objective: str, loss_agg: str = "token-mean", *,
                   measure_kl: bool = False, free_logps: list[torch.Tensor] | None = None,
                   **options) -> tuple[dict, dict]:
    """One optimizer step on a fresh rollout batch whose π_old is the policy being trained, without the
    separate old-log-prob pass: π_old is the train forward's own log-probs (learner.train_step_on_policy).
    Under r3 that forward replays the engine's routes (own choice where there are none), under r2 it routes
    freely. Returns (train metrics, the metrics the old-log-prob pass would have reported: replay/* and,
    with measure_kl, mismatch_kl's; `free_logps` from free_logprobs under r3). Collective."""
    mode = parse_mode(mode)
    if mode is ReplayMode.R3 and all(s.get("routes") is None for s in samples):
        raise ValueError("samples: routing replay r3 needs the engine's routes (SamplingParams(return_routes=True))")
    if mode is not ReplayMode.OFF and learner.route_hook is None:
        raise ValueError("learner: built without routing_replay=True, so routes cannot be replayed or recorded")
    if mode is not ReplayMode.R3:  # r2 records this forward's own routing; off replays nothing
        samples = [{k: v for k, v in s.items() if k != "routes"} for s in samples]
    measure_kl = measure_kl and mode is not ReplayMode.OFF and all("rollout_logp" in s for s in samples)
    if measure_kl and mode is ReplayMode.R3 and free_logps is None:
        raise ValueError("free_logps: needed under r3 to measure the KL without replay "
                         "(free_logprobs, before the step)")
    train, old = learner.train_step_on_policy(samples, objective, loss_agg, keep_logprobs=measure_kl, **options)
    metrics = dict(old.get("metrics", {}))
    if measure_kl:
        replayed = old["logprobs"]
        free = replayed if free_logps is None else free_logps  # r2: this forward routed freely
        metrics.update(mismatch_kl(learner, samples, replayed, free_logps=free))
    return train, metrics


def routes_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b))

"""Routing replay modes for the trainer, and the train-inference metrics.

  off  no replay: every pass routes freely.
  r2   the learner's old-log-prob pass routes freely and records its routes; every training pass of
       that batch replays them (so several optimizer steps on one rollout batch keep its routing).
  r3   the rollout engine's routes (Sample.routes) are replayed in the old-log-prob pass and in
       training (positions the engine gave no route for fall back to the learner's own choice in the
       old-log-prob pass, and that choice is then replayed in training too).

    logps, metrics = old_logprobs(learner, samples, "r3")     # sets sample.routes for training
    metrics |= learner.train_step(samples, "ppo")             # replay/disagree_post == 0
    metrics |= mismatch_kl(learner, samples, logps)           # k3 KL to the rollout, with/without replay

An on-policy step (one update on one mini-batch, π_old from the learner) needs no separate pass:
`on_policy_step` trains on the batch with π_old taken from the train forward, which under r2 routes
freely (replaying its own routing within the same forward would change nothing) and under r3 replays
the engine's routes, and reports the metrics the old-log-prob pass would have.

Every step also reports the train-inference metrics of the stability study (`stability_metrics`, issue 13):
    mismatch/k3, mismatch/max_abs_dlogp   engine μ vs the learner's π_old as trained (after replay under r3)
    mismatch/k3_free                      engine vs the learner with its own routing
    router/disagree, router/disagree_any, router/disagree_l{i}
                                          engine routes (sample.engine_routes) vs the learner's own routing
                                          (sample.own_routes): (token, layer) pairs whose top-k expert set
                                          differs, tokens with any layer differing, per MoE layer
The mismatch metrics count the policy's response tokens only (sample.loss_mask 1 where samples carry one:
a multi-turn trajectory's observation tokens have no engine log-prob). Under off / r2 the π_old pass routes
freely, so it gives all of them; under r3 the free-routing ones need one
more forward pass (`free_routing`), which the trainer takes every train.stability_metrics_every steps.

A learner for r2/r3 is built with routing_replay=True (megapo/replay/hook.py plugs into it); the trainer builds
an off-mode learner with the hook too when it measures router disagreement (the hook then only records).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from megapo.algorithms.config import ReplayMode  # algorithm.routing_replay
from megapo.algorithms.sample import TrainSample, as_train_samples, without_routes


def parse_mode(value, name: str = "routing_replay") -> ReplayMode:
    try:
        return ReplayMode(value)
    except ValueError:
        raise ValueError(f"{name}: must be one of off, r2, r3; got {value!r}") from None


def logprobs_with_routes(learner, sequences: list[list[int]], routes=None, with_entropy: bool = False,
                         prompt_lens=None):
    """learner.logprobs replaying `routes` (None: free routing) -> (logprobs, routes used, metrics); with
    with_entropy the first item is (logprobs, entropies). Collective (all ranks call); routes used: int32
    [n-1, L, k] per sequence, on every rank. `prompt_lens`: shared prefixes (Learner.logprobs)."""
    hook = learner.route_hook
    if hook is None:
        raise ValueError("learner: built without routing_replay=True, so routes cannot be replayed or recorded")
    logps = learner.logprobs(sequences, routes=routes, with_entropy=with_entropy, prompt_lens=prompt_lens)
    used = hook.routes_used(len(sequences))
    return logps, used, hook.metrics()


def old_logprobs(learner, samples: list[TrainSample], mode,
                 with_entropy: bool = False) -> tuple[list[torch.Tensor], dict]:
    """The old-log-prob pass of a rollout batch under `mode`. Returns the per-response-token log-probs
    (one tensor per sample) and metrics; for r2/r3 it sets sample.routes to the routes this pass used,
    which every train_step on these samples then replays, and where it routed freely (off with a recording
    hook, r2) sample.own_routes too (stability_metrics). with_entropy: sample.old_entropy gets π_old's
    entropy at each response token (for the stages of megapo/algorithms/stages.py)."""
    samples = as_train_samples(samples)
    mode = parse_mode(mode)
    sequences = [list(s.tokens) for s in samples]
    prompt_lens = [s.prompt_len for s in samples]  # samples of one prompt share it in the micro-batches
    entropies = None
    if mode is ReplayMode.OFF:
        full = learner.logprobs(sequences, with_entropy=with_entropy, prompt_lens=prompt_lens)
        if with_entropy:
            full, entropies = full
        metrics = {}
        if learner.route_hook is not None:  # a recording hook: this free pass's routes
            keep_own_routes(samples, learner.route_hook.routes_used(len(samples)))
            learner.route_hook.metrics()
    else:
        given = [s.routes for s in samples] if mode is ReplayMode.R3 else None
        if mode is ReplayMode.R3 and all(r is None for r in given):
            raise ValueError("samples: routing replay r3 needs the engine's routes "
                             "(SamplingParams(return_routes=True))")
        full, used, metrics = logprobs_with_routes(learner, sequences, given, with_entropy=with_entropy,
                                                   prompt_lens=prompt_lens)
        if with_entropy:
            full, entropies = full
        for s, r in zip(samples, used):
            s.routes = r
        if mode is ReplayMode.R2:  # it routed freely
            keep_own_routes(samples, used)
    logps = [lp[s.prompt_len - 1:] for lp, s in zip(full, samples)]
    if entropies is not None:
        keep_old_entropy(samples, entropies, response=True)
    return logps, metrics


def keep_old_entropy(samples: list[TrainSample], entropies: list, response: bool = False) -> None:
    """sample.old_entropy: π_old's entropy at each response token (`entropies` per whole sequence when
    `response`, else per response token already)."""
    samples = as_train_samples(samples)
    for s, h in zip(samples, entropies):
        s.old_entropy = (h[s.prompt_len - 1:] if response else h).tolist()


def policy_token_mask(samples: list[TrainSample], count: int) -> np.ndarray:
    """[count] bool over the samples' response tokens end to end: the ones the policy sampled (sample.loss_mask
    1). Observation tokens (0) have no engine log-prob of the policy's (the engine reports 0.0 there), so the
    train-inference comparisons skip them. All True when no sample has a loss_mask."""
    samples = as_train_samples(samples)
    given = [s.loss_mask is not None for s in samples]
    if not any(given):
        return np.ones(count, dtype=bool)
    if not all(given):
        raise ValueError(f"samples[{given.index(False)}].loss_mask: missing (other samples have it)")
    mask = np.concatenate([np.asarray(s.loss_mask).reshape(-1) for s in samples]) == 1
    if mask.size != count:
        raise ValueError(f"loss_mask: {mask.size} values for {count} response tokens")
    if not mask.any():
        raise ValueError("loss_mask: 0 at every response token (no policy token to compare)")
    return mask


def mismatch_kl(learner, samples: list[TrainSample], replayed_logps: list[torch.Tensor] | None = None,
                prefix: str = "replay/", free_logps: list[torch.Tensor] | None = None) -> dict:
    """Train-inference mismatch: mean per-token k3 KL(rollout || learner) over the policy's response tokens
    (policy_token_mask), with the learner replaying each sample's routes (`replayed_logps` from old_logprobs, or
    computed here) and with free routing (`free_logps`, or one extra forward pass). Needs sample.rollout_logp.
    Collective."""
    samples = as_train_samples(samples)
    from megapo.algorithms.kl import kl_penalty

    sequences = [list(s.tokens) for s in samples]
    rollout = torch.cat([torch.as_tensor(s.rollout_logp, dtype=torch.float32) for s in samples])
    policy = torch.from_numpy(policy_token_mask(samples, rollout.numel()))

    def response(full):
        return torch.cat([lp[s.prompt_len - 1:] for lp, s in zip(full, samples)])

    def k3(learner_logps):
        return float(kl_penalty(rollout[policy], learner_logps[policy], "k3").mean())

    if learner.route_hook is None:
        free = response(learner.logprobs(sequences))
        return {prefix + "kl_k3_free": k3(free)}
    if replayed_logps is None:
        replayed = response(learner.logprobs(sequences, routes=[s.routes for s in samples]))
    else:
        replayed = torch.cat(list(replayed_logps))
    if free_logps is None:
        free = response(learner.logprobs(sequences, routes=None))
    else:
        free = torch.cat(list(free_logps))
    learner.route_hook.metrics()  # these extra passes are not part of the step's routing metrics
    return {prefix + "kl_k3": k3(replayed), prefix + "kl_k3_free": k3(free)}


def free_routing(learner, samples: list[TrainSample]) -> list[torch.Tensor]:
    """One forward pass with the learner's own routing (nothing replayed), before an update changes the weights:
    returns the response log-probs and sets each sample's "own_routes" (the routes it chose). Collective."""
    samples = as_train_samples(samples)
    if learner.route_hook is None:
        raise ValueError("learner: built without routing_replay=True, so its routes cannot be recorded")
    full, used, _ = logprobs_with_routes(learner, [list(s.tokens) for s in samples], None)
    keep_own_routes(samples, used)  # the pass's routing counts are dropped: not part of the step's metrics
    return [lp[s.prompt_len - 1:] for lp, s in zip(full, samples)]


def free_logprobs(learner, samples: list[TrainSample], mode) -> list[torch.Tensor] | None:
    """The response log-probs under free routing that mismatch_kl's kl_k3_free needs, taken before an
    on-policy step changes the weights: one forward pass under r3 (free_routing; None otherwise: under r2 the
    step's own forward routes freely, and without replay there is nothing to compare). Collective."""
    if parse_mode(mode) is not ReplayMode.R3:
        return None
    return free_routing(learner, samples)


def on_policy_step(learner, samples: list[TrainSample], mode, loss, loss_agg: str | None = None, *,
                   measure_kl: bool = False, free_logps: list[torch.Tensor] | None = None,
                   keep_entropy: bool = False, **options) -> tuple[dict, dict]:
    """One optimizer step on a fresh rollout batch whose π_old is the policy being trained, without the
    separate old-log-prob pass: π_old is the train forward's own log-probs (learner.train_step_on_policy).
    Under r3 that forward replays the engine's routes (own choice where there are none), under r2 it routes
    freely. Returns (train metrics, the metrics the old-log-prob pass would have reported: replay/*,
    stability_metrics' (every step; under r3 the free-routing ones need `free_logps` and the samples'
    "own_routes" from free_routing) and with measure_kl mismatch_kl's). keep_entropy: each sample's
    "old_entropy" from this forward (π_old's per-token entropy, as old_logprobs(with_entropy=True)). `loss`,
    `loss_agg` and options as learner.train_step_on_policy takes them (a LossSpec, or an objective name). Collective."""
    samples = as_train_samples(samples)
    mode = parse_mode(mode)
    given = samples
    if mode is ReplayMode.R3 and all(s.routes is None for s in samples):
        raise ValueError("samples: routing replay r3 needs the engine's routes (SamplingParams(return_routes=True))")
    if mode is not ReplayMode.OFF and learner.route_hook is None:
        raise ValueError("learner: built without routing_replay=True, so routes cannot be replayed or recorded")
    if mode is not ReplayMode.R3:  # r2 records this forward's own routing; off replays nothing
        samples = [without_routes(s) for s in samples]
    engine_logps = all(s.rollout_logp is not None for s in samples)
    measure_kl = measure_kl and mode is not ReplayMode.OFF and engine_logps
    if measure_kl and mode is ReplayMode.R3 and free_logps is None:
        raise ValueError("free_logps: needed under r3 to measure the KL without replay "
                         "(free_logprobs, before the step)")
    extra = {"keep_entropy": True} if keep_entropy else {}  # learners without the keyword still work
    if loss_agg is not None:
        extra["loss_agg"] = loss_agg
    train, old = learner.train_step_on_policy(samples, loss, keep_logprobs=engine_logps, **extra, **options)
    if keep_entropy:
        keep_old_entropy(given, old["entropies"])
    metrics = dict(old.get("metrics", {}))
    if mode is ReplayMode.OFF:  # a recording hook replays nothing: its replay/* counts mean nothing
        metrics = {}
        train = {k: v for k, v in train.items() if not k.startswith("replay/")}
    if mode is not ReplayMode.R3 and learner.route_hook is not None:  # this forward routed freely
        keep_own_routes(samples, learner.route_hook.routes_used(len(samples)))
    if engine_logps:
        replayed = old["logprobs"]
        free = replayed if mode is not ReplayMode.R3 else free_logps  # off / r2: this forward routed freely
        metrics.update(stability_metrics(samples, replayed, free))
        if measure_kl:
            metrics.update(mismatch_kl(learner, samples, replayed, free_logps=free))
    return train, metrics


# ----------------------------------------------------------------------------- stability metrics (issue 13)


def keep_own_routes(samples: list[TrainSample], routes: list[np.ndarray]) -> None:
    """Record on each sample the routes the learner chose itself (its "own_routes", for router/disagree)."""
    samples = as_train_samples(samples)
    for s, r in zip(samples, routes):
        s.own_routes = r


def engine_mismatch(samples: list[TrainSample], logps: list) -> dict[str, float]:
    """k3 = mean(ρ - 1 - log ρ), ρ = π/μ (an estimate of KL(μ || π)), and max |log π - log μ| over the policy's
    response tokens (policy_token_mask: loss_mask 1), between the engine's log-probs μ (sample.rollout_logp) and
    the learner's `logps` π (one sequence of response log-probs per sample)."""
    samples = as_train_samples(samples)
    from megapo.algorithms.corrections import mismatch_metrics

    def flat(values) -> torch.Tensor:  # tensors (the learner's) joined by torch, lists (the engine's) by numpy
        values = list(values)
        if values and all(isinstance(v, torch.Tensor) for v in values):
            return torch.cat([v if v.dim() == 1 else v.reshape(-1) for v in values]).to(torch.float64)
        if all(isinstance(v, list) for v in values):  # one pass over the floats, not an array per sample
            return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(values), dtype=np.float64))
        return torch.from_numpy(np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in values]))

    pi, mu = flat(logps), flat(s.rollout_logp for s in samples)
    if pi.shape != mu.shape:
        raise ValueError(f"logps: {pi.numel()} response log-probs for {mu.numel()} engine log-probs")
    # token means and a max: all tokens as one [1, N] row give the same as one row per sequence
    m = mismatch_metrics(pi[None], mu[None], torch.from_numpy(policy_token_mask(samples, pi.numel()))[None])
    return {"k3": float(m["mismatch_k3"]), "max_abs_dlogp": float(m["mismatch_max_abs_dlogp"])}


def route_disagreement(engine_routes: list, learner_routes: list, prefix: str = "router/") -> dict[str, float]:
    """Engine vs learner routing of the same sequences (int [positions, MoE layers, k] per sequence; a
    (position, layer) entry with a negative id has no engine route and is not counted). Returns
    disagree: the fraction of (position, layer) pairs whose top-k expert SETS differ (same experts in another
    order agree); disagree_any: the fraction of positions where any layer differs; disagree_l{i}: per layer."""
    pairs = []
    for i, (e, own) in enumerate(zip(engine_routes, learner_routes)):
        e, own = np.asarray(e), np.asarray(own)
        if e.shape != own.shape:
            raise ValueError(f"routes[{i}]: engine routes {list(e.shape)} vs learner routes {list(own.shape)}")
        pairs.append((e, own))
    if not pairs:
        return {}
    engine_ids = np.concatenate([e for e, _ in pairs])
    own = np.concatenate([o for _, o in pairs])
    given = (engine_ids >= 0).all(-1)  # [positions, layers]
    differ = (np.sort(engine_ids, -1) != np.sort(own, -1)).any(-1) & given
    tokens = given.any(-1)

    def frac(num, den) -> float:
        return float(num) / float(den) if den else 0.0

    out = {prefix + "disagree": frac(differ.sum(), given.sum()),
           prefix + "disagree_any": frac(differ.any(-1).sum(), tokens.sum())}
    for layer in range(engine_ids.shape[1]):
        out[f"{prefix}disagree_l{layer}"] = frac(differ[:, layer].sum(), given[:, layer].sum())
    return out


def stability_metrics(samples: list[TrainSample], logps: list, free_logps: list | None = None) -> dict[str, float]:
    """The per-step train-inference metrics of a rollout batch (see the module docstring): mismatch/k3 and
    mismatch/max_abs_dlogp of `logps` (π_old as trained), mismatch/k3_free of `free_logps` (the learner's own
    routing; None: not measured this step), router/* where every sample has "engine_routes" and "own_routes"."""
    samples = as_train_samples(samples)
    if not samples or not all(s.rollout_logp is not None for s in samples):
        return {}
    out = {f"mismatch/{k}": v for k, v in engine_mismatch(samples, logps).items()}
    if free_logps is not None:
        out["mismatch/k3_free"] = engine_mismatch(samples, free_logps)["k3"]
    if all(s.engine_routes is not None and s.own_routes is not None for s in samples):
        out.update(route_disagreement([s.engine_routes for s in samples], [s.own_routes for s in samples]))
    return out


def routes_equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b))

"""The RL driver loop: a thin function over the Learner and Engine interfaces (docs/CONTRACTS.md).

One step (sync mode):
    prompts ─► engine.generate (n samples each, log-probs, routes for R3)
            ─► rewards (+ overlong shaping) ─► dynamic sampling (drop equal-reward groups, refill)
            ─► advantages (megapo.algorithms) ─► learner old log-probs (R2 records routes, R3 replays
               the engine's; none when on-policy: then the train forward gives π_old and the routing
               metrics) ─► reference log-probs when kl_coef > 0 (algorithm.reference: a frozen Megatron copy
               replaying the same routes, or a plain one on rank 0)
            ─► learner.train_step per mini-batch ─► weight sync learner.hf_state_dict() → engine
            ─► metrics ─► held-out eval / checkpoint

Every rank runs this loop (the learner's methods are collective); only rank 0 owns the engine,
computes rewards and writes files, and broadcasts each step's train batch to the other ranks.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megapo.envs.base import Trajectory
from megapo.trainer import checkpoint as ckpt
from megapo.trainer.config import RunConfig
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.metrics import MetricsLogger, SampleLogger, StepTimer

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- process helpers


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    """rank 0's `obj` on every rank (no-op in a single process)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- model preparation


def prepare_model(cfg: RunConfig, out_dir: Path) -> Path:
    """The HF folder RL starts from: model.path (written first from model.tiny if absent), then, with
    sft.enabled, the warm-started copy under out_dir/sft (reused when a previous run made it)."""
    path = Path(cfg.model.path)
    if _rank() == 0 and not (path / "config.json").is_file():
        from megapo.models.tiny import write_tiny_model

        t = cfg.model.tiny
        write_tiny_model(path, t.family, layers=t.layers, experts=t.experts, topk=t.topk, hidden=t.hidden,
                         heads=t.heads, kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn,
                         vocab=t.vocab, seed=t.seed)
        log.info("wrote tiny %s model to %s", t.family, path)
    if not cfg.sft.enabled:
        _barrier()
        return path
    sft_dir = out_dir / "sft"
    if _rank() == 0 and not (sft_dir / "sft_result.json").is_file():
        from megapo.tasks.registry import get_task
        from megapo.trainer.sft import train_sft

        result = train_sft(path, sft_dir, cfg.sft, get_task(cfg.data.task, cfg.data.task_options),
                           cfg.data.chat_template, cfg.rollout.max_new_tokens, turns=turn_play(cfg))
        log.info("sft warm start: validation exact-match %.3f after %d steps (%.1f s)%s", result.val_accuracy,
                 result.steps, result.seconds, "" if result.reached else " -- threshold NOT reached")
    _barrier()
    return sft_dir


# ----------------------------------------------------------------------------- rollout


@dataclass
class Group:
    """The samples of one prompt kept for training, with their rewards (shaped by the length stage)."""

    example: Any  # megapo.tasks.base.Example
    samples: list  # list[megapo.engines.base.Sample]
    rewards: list[float]  # what the advantages are computed from
    scores: list[float] | None = None  # the verifier's rewards before length shaping (None: not shaped)
    correct: list[bool] | None = None  # the verifier's verdict, reward >= data.correct_threshold
    sampled: int | None = None  # responses drawn for this prompt (more than len(samples) after a group filter)
    prompt_index: int | None = None  # the prompt's place in the run's prompt pool
    sample_ids: list[int] | None = None  # each kept sample's index among those drawn (None: all, in order)


def make_reward_fn(cfg: RunConfig, tokenizer) -> Callable[[list], list[float]]:
    """[(example, sample), ...] -> rewards: the configured reward of each decoded response (stop token
    removed; of a multi-turn trajectory, its last policy turn unless its environment gave a reward), guarded
    (megapo.trainer.rewards.GuardedReward: data.reward_timeout_s, data.reward_errors) and scored in one call
    per round; a response without end-of-sequence (a trajectory cut short) gets data.truncated_reward.
    `reward.pop_errors()` counts the failures scored 0 since its last call, `reward.pop_truncated()` the
    (truncated, scored) responses."""
    from megapo.tasks.registry import reward_spec
    from megapo.trainer.rewards import GuardedReward

    fn = GuardedReward(reward_spec(cfg.data), cfg.data.reward_timeout_s, cfg.data.reward_errors,
                       truncated_reward=cfg.data.truncated_reward)

    stop = (tokenizer.eos_token_id,)

    def response_text(sample) -> str:
        if isinstance(sample, Trajectory):  # a multi-turn trajectory: its last policy turn is the answer
            return tokenizer.decode(sample.answer_ids(stop), skip_special_tokens=True)
        ids = sample.output_ids[:-1] if sample.finish_reason == "stop" else sample.output_ids
        return tokenizer.decode(ids, skip_special_tokens=True)

    def reward(pairs: list) -> list[float]:
        scores = fn.score_all([(response_text(sample), example.answer) for example, sample in pairs],
                              truncated=[sample.finish_reason != "stop" for _, sample in pairs])
        # an environment's own reward at the end of a trajectory replaces the verifier's
        return [s.env_reward if getattr(s, "env_reward", None) is not None else r for r, (_, s) in zip(scores, pairs)]

    reward.pop_errors = fn.pop_errors
    reward.pop_truncated = fn.pop_truncated
    return reward


def rollout_round(engine, params, examples: list, prompt_ids: list[list[int]], reward_fn,
                  indices: list[int] | None = None, sampler=None) -> list[Group]:
    """One sampling round: every prompt's samples with the verifier's rewards (before length shaping);
    `indices`: the prompts' places in the prompt pool; `sampler`: multi-turn trajectories in place of
    engine.generate (megapo.envs.rollout.trajectory_sampler)."""
    drawn = sampler(engine, prompt_ids, examples, params) if sampler is not None else engine.generate(prompt_ids, params)
    scores = iter(reward_fn([(ex, s) for ex, samples in zip(examples, drawn) for s in samples]))
    indices = indices if indices is not None else [None] * len(examples)
    return [Group(ex, samples, [next(scores) for _ in samples], prompt_index=i)
            for ex, samples, i in zip(examples, drawn, indices)]


def train_samples(groups: list[Group], cfg: RunConfig, step: int = 1, prompt_stats=None) -> list[dict]:
    """Learner train samples (CONTRACTS.md) with per-sequence advantages from the configured estimator (or
    algorithm.advantage_smoothing=cumulative from `prompt_stats`, stages.PromptRewardStats, updated here), then
    algorithm.sample_select (at trainer step `step`) and algorithm.advantage_polarity; `old_logp` is filled in
    by the old-log-prob pass (`old_logprob_pass`), the per-token stages after it (`token_stages`)."""
    adv = [a_g.tolist() for a_g in group_advantages(groups, cfg, step, prompt_stats)]
    sentence_ends = _sentence_end_ids(cfg)
    out = []
    for gi, g in enumerate(groups):
        for si, s in enumerate(g.samples):
            sample = {"tokens": list(s.prompt_ids) + list(s.output_ids), "prompt_len": len(s.prompt_ids),
                      "advantage": adv[gi][si], "rollout_logp": list(s.logprobs)}
            if isinstance(s, Trajectory):  # the environment's tokens are context, not the policy's
                sample["loss_mask"] = list(s.loss_mask)
            if sentence_ends is not None:  # the objective splits responses into sentences (sspo)
                from megapo.algorithms.trust_region import sentence_end_flags

                sample["sentence_end"] = sentence_end_flags(s.output_ids, sentence_ends)
            if cfg.algorithm.routing_replay == "r3":
                sample["routes"] = s.routes
            if getattr(s, "routes", None) is not None:  # for router/disagree (megapo.replay.modes.stability_metrics)
                sample["engine_routes"] = s.routes
            out.append(sample)
    return out


def group_advantages(groups: list[Group], cfg: RunConfig, step: int, prompt_stats=None) -> list[torch.Tensor]:
    """One advantage per sample, per group: the configured estimator (or algorithm.advantage_smoothing), then
    algorithm.sample_select, algorithm.advantage_polarity and algorithm.clamp_correct_adv. Groups of different
    sizes (a group filter kept k_i of each) get a group estimator one group at a time (RunConfig refuses the
    batch-level ones and the [P, n] stages with ragged groups)."""
    from megapo.algorithms import compute_advantages
    from megapo.algorithms.length import clamp_correct_advantages
    from megapo.algorithms.stages import apply_polarity, cumulative_advantages, select_samples

    a = cfg.algorithm
    sizes = [len(g.samples) for g in groups]
    if len(set(sizes)) > 1:
        per_group = [compute_advantages(a.advantage, torch.tensor([g.rewards], dtype=torch.float64),
                                        lengths=torch.tensor([[len(s.output_ids) for s in g.samples]]),
                                        **a.advantage_options)[0] for g in groups]
        adv = [apply_polarity(x, a.advantage_polarity, a.pos_scale, a.neg_scale) for x in per_group]
    else:
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        lengths = torch.tensor([[len(s.output_ids) for s in g.samples] for g in groups])  # token-weighted estimators
        if a.advantage_smoothing == "cumulative":
            if prompt_stats is None:
                raise ValueError("prompt_stats: algorithm.advantage_smoothing=cumulative needs the running statistics")
            full = cumulative_advantages(rewards, [g.example.prompt for g in groups], prompt_stats)
        else:
            full = compute_advantages(a.advantage, rewards, lengths=lengths, **a.advantage_options)
        if a.sample_select:
            full = select_samples(full, step=step, **a.sample_select)
        adv = list(apply_polarity(full, a.advantage_polarity, a.pos_scale, a.neg_scale))
    if a.clamp_correct_adv:
        if any(g.correct is None for g in groups):
            raise ValueError("algorithm.clamp_correct_adv: needs the verifier's verdicts (the length stage)")
        adv = [clamp_correct_advantages(x, torch.tensor(g.correct)) for x, g in zip(adv, groups)]
    return adv


def _sentence_end_ids(cfg: RunConfig) -> list[int] | None:
    """The objective's sentence-ending token ids when its loss reads sample["sentence_end"], else None."""
    from megapo.algorithms.loss import token_inputs

    a = cfg.algorithm
    return list(a.objective_options["sentence_end_ids"]) if "sentence_end" in token_inputs(
        a.objective, a.objective_options) else None


def old_logprob_pass(learner, batch: list[dict], cfg: RunConfig, measure_free_kl: bool = False,
                     free_logps: list | None = None) -> dict:
    """Set each sample's `old_logp` from the learner (collective). Under r2 the pass records the
    learner's routes and under r3 replays the engine's; either way sample["routes"] then holds the
    routes every train_step on this batch replays (megapo.replay.modes). Returns the pass's metrics and
    the stability metrics (modes.stability_metrics; under r3 the free-routing ones from `free_logps`, the
    samples' "own_routes" then set by modes.free_routing). `measure_free_kl` adds the engine-vs-learner
    k3 KL with and without replay (under r3 without `free_logps`, one extra forward pass)."""
    from megapo.replay.modes import mismatch_kl, old_logprobs, stability_metrics

    mode = cfg.algorithm.routing_replay
    logps, metrics = old_logprobs(learner, batch, mode, with_entropy=cfg.algorithm.needs_old_entropy())
    for sample, lp in zip(batch, logps):
        sample["old_logp"] = lp.tolist()
    free = logps if mode != "r3" else free_logps  # off / r2: this pass routed freely
    metrics.update(stability_metrics(batch, logps, free))
    if measure_free_kl and mode != "off" and all("rollout_logp" in s for s in batch):
        metrics.update(mismatch_kl(learner, batch, logps, free_logps=free))
    return metrics


def on_policy(cfg: RunConfig, learner) -> bool:
    """Whether π_old is the policy being trained (one update on one mini-batch, π_old from the learner): the
    train forward then is the old-log-prob pass too (megapo.replay.modes.on_policy_step). A learner without
    train_step_on_policy gets the separate pass, and so does a stage that needs π_old's per-token statistics
    before the loss (algorithm.token_advantage, algorithm.token_select)."""
    return (cfg.train.updates_per_rollout == 1 and cfg.train.mini_batches == 1 and cfg.old_policy() == "learner"
            and not cfg.algorithm.needs_old_stats() and hasattr(learner, "train_step_on_policy"))


def token_stages(batch: list[dict], cfg: RunConfig, step: int) -> dict:
    """The per-token stages after the old-log-prob pass, on the whole train batch at once (so their
    batch-global statistics do not depend on mini-, micro-batches or DP ranks): algorithm.token_advantage
    turns each sample's advantage into a per-token list, algorithm.token_select sets sample["token_weight"]
    (the learner multiplies the per-token loss by it). π_old = sample["old_logp"], its entropy
    sample["old_entropy"]. In order: token_advantage, kl_mode=future (FRPO's future-KL advantage from
    sample["ref_logp"]), token_select, token_mask (its weights multiply token_select's; nat_prefix draws from
    (train.seed, `step`), so a resumed run cuts as the unstopped one)."""
    from megapo.algorithms.stages import future_kl_advantages, token_advantages, token_mask_weights, \
        token_select_weights

    a, metrics = cfg.algorithm, {}
    if a.token_advantage != "none":
        adv = torch.tensor([s["advantage"] for s in batch], dtype=torch.float64)
        per_token = token_advantages(a.token_advantage, adv, [s["old_logp"] for s in batch],
                                     [s.get("old_entropy") for s in batch], group_size=cfg.rollout.n_samples,
                                     rollout_logp=[s.get("rollout_logp") for s in batch],  # fipo's other policy
                                     ref_logp=[s.get("ref_logp") for s in batch], **a.token_advantage_options)
        for sample, values in zip(batch, per_token):
            sample["advantage"] = values.tolist()
    if a.kl_mode == "future":
        per_token = future_kl_advantages([s["advantage"] for s in batch], [s["old_logp"] for s in batch],
                                         [s.get("ref_logp") for s in batch], beta=a.kl_coef)
        for sample, values in zip(batch, per_token):
            sample["advantage"] = values.tolist()
    if a.token_select:
        weights = token_select_weights([s["advantage"] for s in batch], [s["old_entropy"] for s in batch],
                                       step=step, **a.token_select)
        for sample, w in zip(batch, weights):
            sample["token_weight"] = w.tolist()
        metrics["token_select/kept_frac"] = float(torch.cat(weights).eq(1).double().mean())
    if a.token_mask != "none":
        masks = token_mask_weights(a.token_mask, lengths=[len(s["tokens"]) - s["prompt_len"] for s in batch],
                                   advantages=[s["advantage"] for s in batch],
                                   old_logp=[s.get("old_logp") for s in batch] if a.token_mask == "stapo" else None,
                                   entropy=[s.get("old_entropy") for s in batch], seed=cfg.train.seed, step=step,
                                   **a.token_mask_options)
        for sample, w in zip(batch, masks):
            before = sample.get("token_weight")
            sample["token_weight"] = (w if before is None else w * torch.tensor(before, dtype=w.dtype)).tolist()
        metrics[f"{a.token_mask}/kept_frac"] = float(torch.cat(masks).gt(0).double().mean())
    return metrics


def use_engine_logprobs(batch: list[dict]) -> dict:
    """algorithm.old_policy=engine: the objective's π_old becomes the engine's log-probs μ of the weights
    that drew each sample. Its clip then bounds the move from the sampling policy: a sample k versions
    old whose probability the last k updates already moved past the clip range stops pushing (the
    objective's ratio π_θ/μ is a clipped importance weight). Returns how far the learner now is from
    the engine on these samples: k3 = mean(ρ - 1 - log ρ), ρ = π_learner/μ (the staleness, plus numerics)."""
    from megapo.replay.modes import engine_mismatch

    m = engine_mismatch(batch, [s["old_logp"] for s in batch])
    for sample in batch:
        sample["old_logp"] = list(sample["rollout_logp"])
    return {"old_policy/learner_vs_engine_k3": m["k3"],
            "old_policy/learner_vs_engine_max_abs_dlogp": m["max_abs_dlogp"]}


def build_reference(cfg: RunConfig, model_dir: Path):
    """π_ref for the KL terms, or None when no term uses one (algorithm.reference, resolved by
    RunConfig.reference): megatron, a frozen Megatron copy of `model_dir` under the learner's layout on every
    rank (collective); plain, megapo's PyTorch model on rank 0 only (megapo/learner/reference.py)."""
    from megapo.layout import read_hf_config
    from megapo.learner.reference import MegatronReference, PlainReference

    if not cfg.algorithm.needs_reference():
        return None
    kind = cfg.reference(read_hf_config(model_dir))
    log.info("KL reference: %s (algorithm.reference=%s)", kind, cfg.algorithm.reference)
    if kind == "megatron":
        return MegatronReference(model_dir, cfg.parallel, micro_batch_tokens=cfg.train.micro_batch_tokens,
                                 row_tokens=cfg.train.row_tokens, routing_replay=cfg.algorithm.routing_replay != "off",
                                 seed=cfg.train.seed)
    return PlainReference(model_dir) if _rank() == 0 else None


def reference_logprobs(reference, batch: list[dict]) -> list[list[float]]:
    """π_ref's response log-probs of every sample, on every rank: computed by every rank (a Megatron reference)
    or on rank 0 and broadcast (a plain one)."""
    if getattr(reference, "collective", False):
        return reference.response_logprobs(batch)
    return _broadcast(reference.response_logprobs(batch) if reference is not None else None)


def loss_options(cfg: RunConfig) -> dict:
    """Keyword options of learner.train_step / policy_loss from the algorithm section."""
    a = cfg.algorithm
    opts = dict(a.objective_options)
    if a.mismatch != "none":
        opts["correction"] = a.mismatch
        if a.mismatch_options:
            opts["correction_options"] = dict(a.mismatch_options)
    elif cfg.async_correction() != "none":
        opts["correction"] = cfg.async_correction()  # stale rollouts are off-policy
    if a.kl_coef and a.kl_mode == "loss":  # kl_mode=future puts the KL into the advantages (token_stages)
        opts.update(kl_coef=a.kl_coef, kl_estimator=a.kl_estimator)
    if a.entropy_coef:
        opts["entropy_coef"] = a.entropy_coef
    return opts


# ----------------------------------------------------------------------------- weight sync


def make_transport(cfg: RunConfig, out_dir: Path, model_dir: Path, learner, engine):
    from megapo.weights import DiskTransport, TensorTransport

    if cfg.rollout.weight_sync == "tensor":
        return TensorTransport()
    if cfg.rollout.weight_sync == "disk":
        return DiskTransport(out_dir / "weights_sync", config_dir=model_dir)
    return broadcast_transport(cfg, learner, engine)


def broadcast_transport(cfg: RunConfig, learner, engine):
    """Form the weight-sync groups once (collective): every stage root of the learner joins its stage's
    group as rank 0 while rank 0 has the engine's workers join as ranks 1.. (megapo.weights.broadcast).
    Rank 0 serves every stage's rendezvous at rollout.sync_host (an address of its node), so stage roots
    on other nodes meet there too."""
    from concurrent.futures import ThreadPoolExecutor

    from megapo.net import free_port
    from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, GroupAddress, host_stores, join_group

    r = cfg.rollout
    stage, stages, root = learner.sync_stage()
    port, workers = _broadcast((r.sync_port or free_port(r.sync_host), engine.workers) if _rank() == 0 else None)
    address = GroupAddress(r.sync_host, port, workers)
    stores = host_stores(address, stages) if _rank() == 0 else []
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.join_weight_groups, address, 1, stages) if engine is not None else None
        group = join_group(address, stage, 0, host_store=False) if root else None
        if joined is not None:
            joined.result()
    log.info("weight sync: broadcast groups formed on %s:%d (%d stage(s), %d engine worker(s))", r.sync_host, port,
             stages, workers)
    return BroadcastTransport(BroadcastSender(group) if root else None, stores)


def sync_weights(learner, engine, version: int, cfg: RunConfig, transport) -> dict:
    """Hand the learner's weights to the engine through megapo.weights (collective on the learner side:
    every rank streams the gathered tensors; only rank 0 has an engine). A per-stage transport (broadcast)
    takes each stage's tensors on its own ranks, as views: nothing is copied on the learner."""
    from megapo.weights import bucket_bytes, sync_named

    named = learner.stage_tensors() if transport.per_stage else learner.hf_state_dict()
    stats = sync_named(named, [engine] if engine is not None else [], transport,
                       bucket_bytes(cfg.rollout.bucket_mb, "rollout.bucket_mb"), version)
    return {"sync/bytes": stats.bytes, "sync/buckets": stats.buckets}


# ----------------------------------------------------------------------------- one step


def collect_rollouts(engine, params, pool, source, reward_fn, cfg: RunConfig, length=None,
                     sampler=None) -> tuple[list[Group], dict, int]:
    """Rank 0: sample groups for one step (with dynamic sampling, refilled up to max_sampling_rounds), each
    round shaped and filtered by `length` (trainer.length_stage.LengthStage) before dynamic sampling judges it;
    `sampler`: multi-turn trajectories (rollout_round); returns the groups to train on (whole groups, a multiple
    of dp), metrics, generated tokens."""
    from megapo.trainer import data
    from megapo.trainer.metrics import length_metrics

    sampled: list[Group] = []  # every group generated this step, as the verifier scored it, for the metrics
    shaped: list[Group] = []  # the same after the length stage (kept responses only)
    if length is not None:
        length.begin_batch()

    def one_round() -> list[Group]:
        chosen = source.next_batch(cfg.data.prompts_per_step)
        items = [pool[i] for i in chosen]
        new = rollout_round(engine, params, [ex for ex, _ in items], [ids for _, ids in items], reward_fn,
                            [int(i) for i in chosen], sampler)
        sampled.extend(new)
        new = length.apply(new) if length is not None else new
        shaped.extend(new)
        return new

    metrics: dict[str, float] = {}
    if cfg.data.dynamic_sampling:
        groups, ds = data.fill_informative(one_round, lambda g: g.rewards, cfg.data.prompts_per_step,
                                           cfg.data.max_sampling_rounds)
        metrics.update({"dynamic/rounds": ds.rounds, "dynamic/groups_sampled": ds.groups_sampled,
                        "dynamic/groups_kept": ds.groups_kept})
    else:
        groups = one_round()
    samples = [s for g in sampled for s in g.samples]
    rewards = [r for g in sampled for r in g.rewards]
    if length is not None:
        kept = [r for g in shaped for r in g.rewards]
        metrics.update({"reward/shaped": sum(kept) / len(kept), "length/kept_frac": len(kept) / len(rewards),
                        "correct_frac": sum(r >= cfg.data.correct_threshold for r in rewards) / len(rewards),
                        **length.metrics()})
    metrics.update({
        "reward": sum(rewards) / len(rewards),  # the verifier's, before length shaping
        "response_len": sum(len(s.output_ids) for s in samples) / len(samples),
        "finish_length_frac": sum(s.finish_reason == "length" for s in samples) / len(samples)})
    metrics.update(length_metrics([len(s.output_ids) for s in samples],  # len/mean, len/p90, len/d{k} by difficulty
                                  [getattr(g.example, "difficulty", None) for g in sampled for _ in g.samples]))
    if sampler is not None:  # turns, tool calls, finish reasons, parse / tool errors
        from megapo.envs.rollout import trajectory_metrics

        metrics.update(trajectory_metrics(samples))
    if cfg.data.reward_errors == "zero" and hasattr(reward_fn, "pop_errors"):
        metrics["reward/errors"] = reward_fn.pop_errors()  # failed reward calls scored 0 this step
    if hasattr(reward_fn, "pop_truncated"):
        truncated, scored = reward_fn.pop_truncated()  # given data.truncated_reward instead of a score
        metrics["reward/truncated_frac"] = truncated / max(scored, 1)
    keep = len(groups) - len(groups) % cfg.parallel.dp  # every DP rank gets whole groups
    return groups[:keep], metrics, sum(policy_tokens(s) for s in samples)


def policy_tokens(sample) -> int:
    """Tokens the engine generated for a sample (a trajectory's observations are not)."""
    return sum(sample.loss_mask) if isinstance(sample, Trajectory) else len(sample.output_ids)


def mini_batch_bounds(group_sizes: list[int], mini_batches: int) -> list[tuple[int, int]]:
    """[lo, hi) sample ranges of the optimizer steps on one rollout batch: `mini_batches` of whole groups (fewer
    when dynamic sampling kept fewer groups than that), as even in groups as whole groups allow, in batch
    order; `group_sizes`: the samples of each group (they differ after a group filter)."""
    num_groups = len(group_sizes)
    parts = min(mini_batches, num_groups)
    counts = [num_groups // parts + (i < num_groups % parts) for i in range(parts)]
    ends = [sum(group_sizes[:sum(counts[:i + 1])]) for i in range(parts)]
    return list(zip([0] + ends[:-1], ends))


def update_policy(learner, groups: list[Group], cfg: RunConfig, reference, options: dict, timer: StepTimer,
                  measure_free_kl: bool = False, measure_free_routing: bool = False, step: int = 1,
                  prompt_stats=None) -> dict:
    """All ranks: advantages, old (and reference) log-probs, then the optimizer steps on mini-batches.
    π_old (sample["old_logp"]) and the replayed routes (sample["routes"]) are set once, before the first
    update, and stay fixed over all of them. Under r3, `measure_free_kl` / `measure_free_routing` take one more
    forward pass with the learner's own routing first (timed as "stability"): mismatch/k3_free, router/*."""
    from megapo.replay.modes import free_routing, on_policy_step

    metrics: dict[str, float] = {}
    mode = cfg.algorithm.routing_replay
    batch = train_samples(groups, cfg, step, prompt_stats)
    fused, free = on_policy(cfg, learner), None
    if mode == "r3" and (measure_free_kl or measure_free_routing):
        with timer("stability"):  # before any update: the weights π_old comes from
            free = free_routing(learner, batch)
    with timer("old_logp"):
        if not fused:
            metrics.update(old_logprob_pass(learner, batch, cfg, measure_free_kl, free_logps=free))
    if cfg.old_policy() == "engine":
        metrics.update(use_engine_logprobs(batch))
    if cfg.algorithm.needs_reference():  # before the stages: kl_mode=future's advantages read it
        with timer("ref_logp"):
            ref = reference_logprobs(reference, batch)
        for sample, lp in zip(batch, ref):
            sample["ref_logp"] = lp
    metrics.update(token_stages(batch, cfg, step))  # trainer step `step` (token_select's schedule, nat_prefix's cut)
    with timer("train"):
        last: dict = {}
        if fused:  # one update on the whole batch, π_old from its own forward
            last, old_pass = on_policy_step(learner, batch, mode, cfg.algorithm.objective,
                                            cfg.algorithm.loss_agg, measure_kl=measure_free_kl, free_logps=free,
                                            **options)
            metrics.update(old_pass)
        bounds = mini_batch_bounds([len(g.samples) for g in groups], cfg.train.mini_batches)
        for _ in range(0 if fused else cfg.train.updates_per_rollout):
            for lo, hi in bounds:
                last = learner.train_step(batch[lo:hi], cfg.algorithm.objective, cfg.algorithm.loss_agg, **options)
    metrics.update({f"train/{k}": v for k, v in last.items()  # off: a recording hook's replay/* mean nothing
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and not (mode == "off" and k.startswith("replay/"))})
    # "kl": to the reference when there is a KL penalty, else the engine-vs-learner mismatch (measured
    # before the update; with old_policy=engine the train step sees π_old = μ and measures nothing)
    kl_key = next((k for k in ("train/kl", "old_policy/learner_vs_engine_k3", "train/mismatch_k3") if k in metrics),
                  None)
    if kl_key is not None:
        metrics["kl"] = metrics[kl_key]
    return metrics


# ----------------------------------------------------------------------------- the loop


def turn_play(cfg: RunConfig):
    """The run's environment and turn limits (megapo.envs.rollout.TurnPlay), or None for single-turn rollouts."""
    from megapo.envs.rollout import TurnLimits, TurnPlay

    make_env = cfg.env_factory()
    if make_env is None:
        return None
    return TurnPlay(make_env, TurnLimits(cfg.env.max_turns, cfg.response_tokens()))


def build_engine(cfg: RunConfig, model_dir: Path):
    from megapo.trainer.engine_setup import engine_from_config

    return engine_from_config(cfg, model_dir, Path(cfg.train.output_dir))


def new_prompt_stats(cfg: RunConfig, saved: dict | None = None):
    """algorithm.advantage_smoothing=cumulative's running per-prompt reward statistics (stages.PromptRewardStats),
    restored from a checkpoint's TrainerState.extra when `saved` is given; None when not configured."""
    from megapo.algorithms.stages import PromptRewardStats

    if cfg.algorithm.advantage_smoothing != "cumulative":
        return None
    return PromptRewardStats((saved or {}).get("prompt_stats"))


def stage_state(prompt_stats) -> dict:
    """What the stages keep across steps, for TrainerState.extra (JSON)."""
    return {} if prompt_stats is None else {"prompt_stats": prompt_stats.state_dict()}


def records_routes(cfg: RunConfig, model_dir: Path) -> bool:
    """Whether the learner gets a route hook: for replay (r2/r3), and with the embedded engine on an MoE model to
    compare its own routing with the engine's every step (router/disagree; without replay the hook only records)."""
    from megapo.layout import num_experts, read_hf_config

    if cfg.algorithm.routing_replay != "off":
        return True
    return cfg.rollout.engine == "embedded" and bool(num_experts(read_hf_config(model_dir)))


def stability_step(cfg: RunConfig, step: int) -> bool:
    """Whether `step` measures the stability metrics that cost a forward pass under r3
    (train.stability_metrics_every; 0: the eval steps)."""
    every = cfg.train.stability_metrics_every or cfg.train.eval_every
    return bool(every) and step % every == 0


def build_learner(cfg: RunConfig, model_dir: Path):
    from megapo.learner.learner import Learner

    return Learner(model_dir, cfg.parallel, cfg.optim, seed=cfg.train.seed,
                   micro_batch_tokens=cfg.train.micro_batch_tokens, row_tokens=cfg.train.row_tokens,
                   total_steps=cfg.train.steps * cfg.train.updates_per_rollout * cfg.train.mini_batches,
                   routing_replay=records_routes(cfg, model_dir))


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, learner=None, engine=None,
          print_fn=print, stop=None) -> dict:
    """Run RL as configured; return the last metrics row. `learner`/`engine` may be passed in (tests).
    `resume` / `overwrite`: what to do with a previous run in train.output_dir (megapo.trainer.run_dir; a
    ConfigError before anything is written when neither fits). `stop` (megapo.trainer.stop.StopFlag): when
    set on any rank, every rank saves a checkpoint after the current step and raises TrainingStopped."""
    from transformers import AutoTokenizer

    from megapo.engines.base import SamplingParams
    from megapo.tasks.registry import get_task
    from megapo.trainer import data, run_dir
    from megapo.trainer.collapse import CollapseWatch
    from megapo.trainer.eval import evaluate
    from megapo.trainer.metrics import read_metrics

    start = run_dir.plan_start(cfg, resume=resume, overwrite=overwrite)  # reads only: refusals come before any write
    if start.step == cfg.train.steps:
        log.warning("--resume: %s is at train.steps=%d already; nothing to do", start.checkpoint, start.step)
        return {}
    out_dir = start.out_dir
    if run_dir.is_launch_rank0():  # torch.distributed is not initialised yet
        run_dir.begin(start)
    model_dir = prepare_model(cfg, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # prompts and reward before the learner and engine exist: a prompt set of which none fits is refused
    # without building them (rank 0 only needs the prompts; the others get the train batch broadcast)
    pool = data.prompt_pool(cfg, tokenizer)
    source = data.PromptSource(len(pool), seed=cfg.train.seed)
    reward_fn = make_reward_fn(cfg, tokenizer)
    learner = learner if learner is not None else build_learner(cfg, model_dir)
    own_engine = engine is None and _rank() == 0  # closed at the end (stops a server megapo started)
    if own_engine:
        engine = build_engine(cfg, model_dir)
    producer = None
    logger = samples_log = None
    try:  # a stopped or failed run still ends the rollout thread and any server megapo started
        reference = build_reference(cfg, model_dir)
        transport = make_transport(cfg, out_dir, model_dir, learner, engine)
        start_step, version = 0, 0
        prompt_stats = new_prompt_stats(cfg)
        length = LengthStage(cfg) if _rank() == 0 else None
        ckpt_root = out_dir / run_dir.CHECKPOINTS
        latest = start.checkpoint
        if latest is not None:
            state = ckpt.load_checkpoint(latest, learner.load, rank=_rank(), model_dir=model_dir)  # verified first
            if engine is not None and "engine" in ckpt.rng_extra(latest):  # sample as the unstopped run would
                engine.set_rng_state(ckpt.rng_extra(latest)["engine"])
            source.load_state_dict(state.data_cursor)
            start_step, version = state.step, state.weight_version
            prompt_stats = new_prompt_stats(cfg, state.extra)
            if length is not None:
                length.load_state_dict(state.extra.get("length", {}))
            if version > 0:
                sync_weights(learner, engine, version, cfg, transport)
            log.info("resumed from %s (step %d)", latest, start_step)

        if _rank() == 0:  # the run has started (a resume has loaded its checkpoint): metrics rows, config.json
            run_dir.started(start, cfg)
        logger = MetricsLogger(out_dir, cfg.train.log, asdict(cfg), cfg.train.steps, print_fn) if _rank() == 0 else None
        samples_log = SampleLogger(out_dir, tokenizer) if cfg.train.log_samples and _rank() == 0 else None
        # the engine's routes: replayed under r3; otherwise compared with the learner's (router/disagree) when the
        # learner records its own and the embedded engine hands them over in-process
        compare_routes = cfg.rollout.engine == "embedded" and getattr(learner, "route_hook", None) is not None
        params = SamplingParams(n=cfg.rollout.n_samples, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,),
                                return_routes=cfg.algorithm.routing_replay == "r3" or compare_routes)
        options = loss_options(cfg)
        turns = turn_play(cfg)
        sampler = None
        if turns is not None:
            from megapo.envs.rollout import trajectory_sampler

            sampler = trajectory_sampler(turns.make_env, tokenizer, cfg.data.chat_template, turns.limits)

        def held_out() -> dict:
            if not cfg.data.task or cfg.train.eval_prompts == 0 or engine is None:
                return {}
            r = evaluate(engine, get_task(cfg.data.task, cfg.data.task_options), "test", n=cfg.train.eval_prompts,
                         tokenizer=tokenizer, chat_template=cfg.data.chat_template,
                         max_new_tokens=cfg.rollout.max_new_tokens, turns=turns)
            return r.metrics("eval/")  # accuracy, response_len, and by difficulty acc_d{k}, len/*

        earlier = start_step and _rank() == 0 and (out_dir / "metrics.jsonl").is_file()  # a resumed run's history
        collapse = CollapseWatch(read_metrics(out_dir) if earlier else (), upto=start_step)
        if start_step == 0 and logger is not None and cfg.train.eval_every:
            logger.log(0, collapse.add(0, held_out()))
        row: dict = {}
        if cfg.train.mode == "async" and _rank() == 0:
            from megapo.trainer.async_rollout import AsyncRollouts

            producer = AsyncRollouts(lambda: collect_rollouts(engine, params, pool, source, reward_fn, cfg, length,
                                                              sampler),
                                     staleness=cfg.train.staleness, version_fn=lambda: engine.weight_version,
                                     generate_threads=max(1, torch.get_num_threads() // 2),
                                     cursor_fn=lambda: (source.state_dict(), length.state_dict()))
            producer.start(cfg.train.steps - start_step)
        # after the prompts of the last trained batch (what a checkpoint keeps), and the length stage then
        cursor, length_state = source.state_dict(), length.state_dict() if length is not None else {}
        for step in range(start_step + 1, cfg.train.steps + 1):
            timer = StepTimer()
            groups, metrics, gen_tokens = [], {}, 0
            if producer is not None:
                from megapo.trainer.async_rollout import next_batch

                groups, metrics, gen_tokens, (cursor, length_state) = next_batch(producer, version,
                                                                                 cfg.train.staleness, timer)
            elif _rank() == 0:
                with timer("generate"):
                    groups, metrics, gen_tokens = collect_rollouts(engine, params, pool, source, reward_fn, cfg,
                                                                   length, sampler)
                cursor, length_state = source.state_dict(), length.state_dict()
            if samples_log is not None and groups:
                samples_log.log(step, groups)
            groups = _broadcast(groups)
            if groups:
                eval_step = bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0
                metrics.update(update_policy(learner, groups, cfg, reference, options, timer, measure_free_kl=eval_step,
                                             measure_free_routing=stability_step(cfg, step), step=step,
                                             prompt_stats=prompt_stats))
                with timer("sync"):
                    version += 1
                    metrics.update(sync_weights(learner, engine, version, cfg, transport))
            else:
                log.warning("step %d: no informative group after %d sampling rounds; skipping the update", step,
                            cfg.data.max_sampling_rounds)
            if producer is not None:
                producer.mark_synced()  # the producer may start one more batch
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                with timer("eval"):
                    metrics.update(held_out())
            stopping = stop is not None and stop.agreed() and step < cfg.train.steps  # all ranks agree
            if stopping or step == cfg.train.steps or (cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0):
                with timer("checkpoint"):
                    state = ckpt.TrainerState(step, cursor, version,
                                              extra={**stage_state(prompt_stats), "length": length_state})
                    engine_rng = {"engine": engine.rng_state()} if hasattr(engine, "rng_state") else {}
                    ckpt.save_checkpoint(ckpt_root, state, learner.save, cfg.train.keep_last, _rank() == 0, _barrier,
                                         rank=_rank(), rng_extra=engine_rng)
            if logger is not None:  # tokens/s: generated tokens per second of the whole step
                row = logger.log(step, {**collapse.add(step, metrics), **timer.pop()}, tokens=gen_tokens)
            if stopping:
                from megapo.trainer.stop import TrainingStopped

                if logger is not None:
                    logger.close()
                raise TrainingStopped(step)
    finally:
        if producer is not None:
            producer.close()
        if own_engine:
            engine.close()
    if logger is not None:
        logger.close()
    if samples_log is not None:
        samples_log.close()
    return row

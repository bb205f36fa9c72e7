"""One RL run as an object: its parts (learner, engine, reference policy, weight transport, prompt source,
stages, loggers), how they are built and resumed, and what each phase of a step does with them.
`megapo.trainer.loop.train` is the order of the phases.

Every rank builds a Run (the learner's methods are collective); only rank 0 owns the engine, computes
rewards and writes files, and hands each step's train batch to the other ranks (megapo.trainer.handout: broadcast,
or with PP > 1 each rank's stage's route columns only).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from megapo.dist import any_rank, barrier, broadcast_object, rank
from megapo.engines.base import Engine
from megapo.engines.registry import capabilities
from megapo.learner.protocol import Learner
from megapo.learner.reference import Reference
from megapo.trainer import checkpoint as ckpt
from megapo.trainer.config import RunConfig
from megapo.trainer.critic_step import CRITIC_DIR, build_critic
from megapo.trainer.distill import build_teachers
from megapo.trainer.fleet import make_fleet
from megapo.trainer.handout import hand_out, rank_route_layers
from megapo.trainer.length_stage import LengthStage
from megapo.trainer.metrics import MetricsLogger, SampleLogger, StepTimer
from megapo.trainer.reward_model import build_reward_model
from megapo.trainer.run_dir import CHECKPOINTS
from megapo.trainer.privileged import privileged_rollouts
from megapo.trainer.anytime import anytime_rollouts
from megapo.trainer.soup import soup_rollouts
from megapo.trainer.rollout import Group, collect_rollouts, make_reward_fn, sampling_params, turn_play
from megapo.trainer.stop import signals_held
from megapo.trainer.update import (TEMPERATURE_STATS, new_prompt_stats, stability_step, stage_state,
                                   update_policy)

log = logging.getLogger(__name__)


class Run:
    """The parts of one run on this rank and the phases of a step. Build it with Run.open; close it (a `with`
    block) to end the rollout thread and any server megapo started, also when the run stops or fails."""

    @classmethod
    def open(cls, cfg: RunConfig, *, resume: bool = False, overwrite: bool = False,
             learner: Learner | None = None, engine: Engine | None = None,
             print_fn=print) -> "Run | None":
        """The run of `cfg`, resumed from its last checkpoint with `resume`; None when it is finished already.
        `resume` / `overwrite`: what to do with a previous run in train.output_dir (megapo.trainer.run_dir; a
        ConfigError before anything is written when neither fits). `learner`/`engine` may be passed in (tests)."""
        from megapo.trainer import run_dir

        start = run_dir.plan_start(cfg, resume=resume, overwrite=overwrite)  # reads only: refusals before any write
        if start.step == cfg.train.steps:
            log.warning("--resume: %s is at train.steps=%d already; nothing to do", start.checkpoint, start.step)
            return None
        return cls(cfg, start, learner=learner, engine=engine, print_fn=print_fn)

    def __init__(self, cfg: RunConfig, start, *, learner: Learner | None = None, engine: Engine | None = None,
                 print_fn=print):
        from transformers import AutoTokenizer

        from megapo.trainer import data, run_dir

        self.cfg, self.start, self.out_dir = cfg, start, start.out_dir
        if run_dir.is_launch_rank0():  # torch.distributed is not initialised yet
            run_dir.begin(start)
        self.model_dir = prepare_model(cfg, self.out_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # prompts and reward before the learner and engine exist: a prompt set of which none fits is refused
        # without building them (rank 0 only needs the prompts; the others get the train batch broadcast)
        self.pool = data.prompt_pool(cfg, self.tokenizer)
        # the prompt order: a seeded shuffle, SPO's prioritised sampling (from the run's value tracker, read at each
        # draw) or the semantic-entropy curriculum (megapo.trainer.data.prompt_source)
        self.source = data.prompt_source(cfg, self.pool, tracker=lambda: self.prompt_stats)
        self.reward_fn = make_reward_fn(cfg, self.tokenizer)
        self.learner = learner if learner is not None else build_learner(cfg, self.model_dir)
        self.own_engine = engine is None and rank() == 0  # closed by close() (stops a server megapo started)
        self.engine = build_engine(cfg, self.model_dir) if self.own_engine else engine
        # rank 0 with a Router: servers join (rollout.servers_file) and are dropped at each sync (megapo.trainer.fleet)
        self.fleet = make_fleet(cfg, self.model_dir, self.engine)
        if self.engine is not None and cfg.rollout.partial:
            self.engine.max_versions = cfg.rollout.partial_max_versions
        self.producer = self.logger = self.samples_log = None
        try:
            self._build_parts(print_fn)
            self._resume()
            self._begin_logs(print_fn)
        except BaseException:
            self.close()
            raise

    def _build_parts(self, print_fn) -> None:
        """The reference policy, the weight transport, the stages and what each rollout is drawn with."""
        cfg = self.cfg
        self.reference: Reference | None = build_reference(cfg, self.model_dir)
        # on-policy distillation's teachers (megapo/trainer/distill.py): frozen Megatron models on every rank
        self.teachers: list[Reference] = build_teachers(cfg, self.model_dir)
        # PPO's critic (megapo/trainer/critic_step.py): a trained Megatron value model on every rank
        self.critic = build_critic(cfg, self.model_dir) if cfg.algorithm.critic.enabled else None
        # data.reward_model (megapo/trainer/reward_model.py): a frozen Megatron score model on every rank (not closed
        # apart: it shares the learner's process groups, which the learner's close ends), or a remote scorer's client
        self.reward_model = build_reward_model(cfg) if cfg.data.reward_model.enabled else None
        self.transport = make_transport(cfg, self.out_dir, self.model_dir, self.learner, self.engine)
        self.step, self.version = 0, 0  # the last step trained (and logged), the engine's weight version
        self.made_ahead: list = []  # async batches a checkpoint kept, handed to the producer (start_rollouts)
        self.prompt_stats = new_prompt_stats(cfg)
        self.length = LengthStage(cfg, tokenizer=self.tokenizer) if rank() == 0 else None
        # the engine's routes: replayed under r3; otherwise compared with the learner's (router/disagree) when the
        # learner records its own and the embedded engine hands them over in-process
        compare_routes = capabilities(cfg.rollout.engine).in_process and self.learner.route_hook is not None
        # each rank's MoE layers when PP gives ranks different ones: each gets only its stage's route columns
        self.route_layers = rank_route_layers(self.learner)  # (collective; None: the batch is broadcast whole)
        self.params = sampling_params(cfg, self.tokenizer.eos_token_id,
                                      routes=cfg.algorithm.routing_replay == "r3" or compare_routes)
        self.loss = cfg.loss_spec()  # every train step's LossSpec (validate() has checked it)
        self.privileged = privileged_rollouts(cfg, self.tokenizer, self.params)  # stage hdpo's (None: not listed)
        self.anytime = anytime_rollouts(cfg, self.tokenizer, self.params)  # stage anytime's (None: not listed)
        self.soup = soup_rollouts(cfg, self.params)  # stage soup's mixed samples and prefix buffer (None: not listed)
        self.turns = turn_play(cfg)
        self.sampler = None
        if self.turns is not None:
            from megapo.envs.rollout import trajectory_sampler

            self.sampler = trajectory_sampler(self.turns.make_env, self.tokenizer, cfg.data.chat_template,
                                              self.turns.limits)

    def _resume(self) -> None:
        """Load the last checkpoint when the run resumes: learner, prompt cursor, stage state, engine RNG, weights."""
        latest = self.start.checkpoint
        if latest is None:
            return
        state = ckpt.load_checkpoint(latest, self.load_models, rank=rank(), model_dir=self.model_dir)  # verified
        if self.engine is not None and "engine" in ckpt.rng_extra(latest):  # sample as the unstopped run would
            self.engine.set_rng_state(ckpt.rng_extra(latest)["engine"])
        from megapo.trainer import data

        data.check_prompt_order(self.source, state.data_cursor, latest)
        self.source.load_state_dict(state.data_cursor)
        self.made_ahead = self._made_ahead(latest, state.extra.get("async"))
        self.step, self.version = state.step, state.weight_version
        self.prompt_stats = new_prompt_stats(self.cfg, state.extra)
        if self.length is not None:
            self.length.load_state_dict(state.extra.get("length", {}))
        if self.soup is not None:  # stage soup's prefix buffer: mix as the unstopped run would
            self.soup.buffer.load_state_dict(state.extra.get("soup", {}))
        self._set_temperature(state.extra.get("entropy_temperature", {}))
        if self.version > 0:
            sync_weights(self.learner, self.engine, self.version, self.cfg, self.transport, self.fleet)
        log.info("resumed from %s (step %d)", latest, self.step)

    def _made_ahead(self, checkpoint: Path, saved: dict | None) -> list:
        """The async batches a checkpoint kept (rank 0), for the producer to hand out first; refused when this
        run would generate on another schedule (train.mode, train.staleness) than the one that made them."""
        from megapo.config import ConfigError
        from megapo.trainer.rollout_store import load_batches

        if not saved:
            return []
        t = self.cfg.train
        if t.mode != "async" or t.staleness != saved["staleness"]:
            raise ConfigError("train.staleness" if t.mode == "async" else "train.mode",
                              f"{checkpoint} holds {saved['made_ahead']} rollout batch(es) made ahead with "
                              f"train.mode=async, train.staleness={saved['staleness']}: resume with the same")
        return load_batches(checkpoint) if rank() == 0 else []

    def _begin_logs(self, print_fn) -> None:
        """Rank 0 (the run has started, a resume has loaded its checkpoint): config.json, metrics rows, samples,
        the collapse watch over a resumed run's history, and the held-out score before the first step."""
        from megapo.trainer import run_dir
        from megapo.trainer.collapse import CollapseWatch
        from megapo.trainer.metrics import read_metrics

        cfg, first = self.cfg, rank() == 0
        if first:
            run_dir.started(self.start, cfg)
            self.logger = MetricsLogger(self.out_dir, cfg.train.log, asdict(cfg), cfg.train.steps, print_fn)
            if cfg.train.log_samples:
                self.samples_log = SampleLogger(self.out_dir, self.tokenizer)
        earlier = self.step and first and (self.out_dir / "metrics.jsonl").is_file()  # a resumed run's history
        self.collapse = CollapseWatch(read_metrics(self.out_dir) if earlier else (), upto=self.step)
        if self.step == 0 and self.logger is not None and cfg.train.eval_every:
            self.logger.log(0, self.collapse.add(0, self.evaluate()))

    # ------------------------------------------------------------------------- the phases of a step

    def steps(self) -> range:
        """The steps still to run."""
        return range(self.step + 1, self.cfg.train.steps + 1)

    def start_rollouts(self) -> None:
        """Async mode, rank 0: start the producer thread that generates ahead of the learner."""
        if self.cfg.train.mode != "async" or rank() != 0:
            return
        from megapo.trainer.async_rollout import AsyncRollouts

        self.producer = AsyncRollouts(self._collect, staleness=self.cfg.train.staleness,
                                      version_fn=lambda: self.engine.weight_version,
                                      generate_threads=max(1, torch.get_num_threads() // 2))
        self.producer.start(self.cfg.train.steps, done=self.step, ready=self.made_ahead)
        self.made_ahead = []

    def _collect(self) -> tuple[list[Group], dict, int]:
        return collect_rollouts(self.engine, self.params, self.pool, self.source, self.reward_fn, self.cfg,
                                self.length, self.sampler, self.privileged, self.anytime, soup=self.soup)

    def generate(self, step: int, timer: StepTimer) -> tuple[list[Group], dict, int]:
        """This step's groups on every rank (drawn on rank 0, or taken from the async producer; with PP > 1 the other
        ranks' routes hold their stage's MoE layers only, megapo.trainer.handout), the rollout metrics and the
        generated tokens."""
        groups, metrics, tokens = [], {}, 0
        if self.producer is not None:
            from megapo.trainer.async_rollout import next_batch

            groups, metrics, tokens = next_batch(self.producer, self.version, self.cfg.train.staleness, timer)
        elif rank() == 0:
            if self.anytime is not None:  # its budget draws follow (train.seed, step)
                self.anytime.step = step
            if self.soup is not None:  # its buffer and prefix draws follow the trainer step
                self.soup.step = step
            with timer("generate"):
                groups, metrics, tokens = self._collect()
            from megapo.trainer import data

            data.observe_answers(self.source, groups, self.tokenizer)  # the curriculum's semantic entropies (else nothing)
        if self.samples_log is not None and groups:
            self.samples_log.log(step, groups)
        return hand_out(groups, self.route_layers), metrics, tokens

    def update(self, step: int, groups: list[Group], timer: StepTimer) -> dict:
        """Advantages, π_old, π_ref, token stages and the optimizer steps (megapo.trainer.update)."""
        cfg = self.cfg
        metrics = update_policy(self.learner, groups, cfg, self.reference, self.loss.at_step(step), timer,
                                teachers=self.teachers,
                                critic=self.critic, reward_model=self.reward_model,
                                measure_free_kl=self.eval_due(step, last=False),
                                measure_free_routing=stability_step(cfg, step), step=step,
                                prompt_stats=self.prompt_stats, tokenizer=self.tokenizer)
        if cfg.rollout.adaptive_temperature > 0:  # HAPO: the next rollouts' temperatures from this batch's entropy
            self._set_temperature({k.split("/", 1)[1]: v for k, v in metrics.items()
                                   if k.startswith("hapo_temperature/")})
        return metrics

    def _set_temperature(self, stats: dict) -> None:
        """HAPO's adaptive temperature (rollout.adaptive_temperature): the next rollouts' per-token temperatures
        from the last train batch's π_old entropy statistics (update.temperature_stats; kept in checkpoints)."""
        from dataclasses import replace

        from megapo.engines.base import EntropyTemperature

        if self.cfg.rollout.adaptive_temperature > 0 and stats:
            self.params = replace(self.params, entropy_temperature=EntropyTemperature(
                tau=self.cfg.rollout.adaptive_temperature, **stats))

    def sync_weights(self, step: int) -> dict:
        """The learner's new weights (after `step`) to the engine, as the next version; async mode waits first
        for the batches generated on the weights before this update (AsyncRollouts.wait_made)."""
        if self.producer is not None and self.cfg.rollout.partial:
            self.engine.preempt()  # the batch in flight continues on the new weights (pause .. resume below)
        elif self.producer is not None:
            self.producer.wait_made(step + self.cfg.train.staleness)
        self.version += 1
        return sync_weights(self.learner, self.engine, self.version, self.cfg, self.transport, self.fleet)

    def rollouts_done(self) -> None:
        """The step has used its rollouts: the async producer may start one more batch."""
        if self.producer is not None:
            self.producer.mark_synced()

    def eval_due(self, step: int, last: bool = True) -> bool:
        """Whether `step` is a held-out eval step (train.eval_every; the last step too unless `last` is False)."""
        every = self.cfg.train.eval_every
        return bool(every) and (step % every == 0 or (last and step == self.cfg.train.steps))

    def evaluate(self) -> dict:
        """Held-out accuracy and lengths of the task's test split (rank 0; {} elsewhere or without a task)."""
        from megapo.tasks.registry import get_task
        from megapo.trainer.eval import evaluate

        cfg = self.cfg
        if not cfg.data.task or cfg.train.eval_prompts == 0 or self.engine is None:
            return {}
        r = evaluate(self.engine, get_task(cfg.data.task, cfg.data.task_options), "test", n=cfg.train.eval_prompts,
                     tokenizer=self.tokenizer, chat_template=cfg.data.chat_template,
                     max_new_tokens=cfg.rollout.max_new_tokens, turns=self.turns)
        out = r.metrics("eval/")  # accuracy, response_len, and by difficulty acc_d{k}, len/*
        if self.anytime is not None and self.turns is None:  # stage anytime: acc at each thinking budget, its AUC
            from megapo.trainer.anytime_eval import run_anytime_eval

            out.update(run_anytime_eval(cfg, self.engine, self.tokenizer, self.anytime))
        return out

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.ckpt_every
        return step == self.cfg.train.steps or bool(every and step % every == 0)

    def save_models(self, learner_dir: Path) -> None:
        """The learner into a checkpoint's learner/ and the critic, when there is one, beside it in critic/."""
        self.learner.save(learner_dir)
        if self.critic is not None:
            self.critic.save(learner_dir.parent / CRITIC_DIR)

    def load_models(self, learner_dir: Path) -> None:
        self.learner.load(learner_dir)
        if self.critic is not None:
            self.critic.load(learner_dir.parent / CRITIC_DIR)

    def checkpoint(self, step: int) -> None:
        """Save the learner, the prompt cursor, the stages' state and the engine's RNG after `step` (collective);
        in async mode also the batches made ahead, the cursor and the RNG then after them (nothing redrawn)."""
        from megapo.trainer.rollout_store import save_batches

        ahead = self.producer.made_ahead() if self.producer is not None else []  # the producer waits now
        extra = {**stage_state(self.prompt_stats), "length": self.length.state_dict() if self.length is not None else {}}
        if self.params.entropy_temperature is not None:  # HAPO's: the next rollout's temperature statistics
            t = self.params.entropy_temperature
            extra["entropy_temperature"] = {k: getattr(t, k) for k in TEMPERATURE_STATS}
        if self.producer is not None:
            extra["async"] = {"made_ahead": len(ahead), "staleness": self.cfg.train.staleness}
        if self.soup is not None:  # rank 0's prefix buffer (the others' is empty; rank 0 writes the state)
            extra["soup"] = self.soup.buffer.state_dict()
        state = ckpt.TrainerState(step, self.source.state_dict(), self.version, extra=extra)
        engine = self.engine
        engine_rng = {"engine": engine.rng_state()} if engine is not None and engine.capabilities.rng_state else {}
        with signals_held():  # a stop signal now must not kill the helper processes the save starts
            ckpt.save_checkpoint(self.out_dir / CHECKPOINTS, state, self.save_models, self.cfg.train.keep_last,
                                 rank() == 0, barrier, rank=rank(), rng_extra=engine_rng,
                                 write_files=(lambda folder: save_batches(folder, ahead)) if ahead else None)

    def log(self, step: int, metrics: dict, timer: StepTimer, tokens: int) -> dict:
        """Write the step's metrics row (rank 0) with the collapse watch and the phase times; returns the row."""
        self.step = step
        if self.logger is None:
            return {}
        return self.logger.log(step, {**self.collapse.add(step, metrics), **timer.pop()}, tokens=tokens)

    # ------------------------------------------------------------------------- end

    def finish(self) -> None:
        """Close the metrics and sample files (rank 0)."""
        for f in (self.logger, self.samples_log):
            if f is not None:
                f.close()
        self.logger = self.samples_log = None

    def close(self) -> None:
        """End the rollout thread and any engine megapo started."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        if self.own_engine and self.engine is not None:
            self.engine.close()
            self.own_engine = False

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- building the parts


def prepare_model(cfg: RunConfig, out_dir: Path) -> Path:
    """The HF folder RL starts from: model.path (written first from model.tiny if absent), then, with
    sft.enabled, the warm-started copy under out_dir/sft (reused when a previous run made it)."""
    path = Path(cfg.model.path)
    if rank() == 0 and not (path / "config.json").is_file():
        from megapo.models.tiny import write_tiny_model

        t = cfg.model.tiny
        write_tiny_model(path, t.family, layers=t.layers, experts=t.experts, topk=t.topk, hidden=t.hidden,
                         heads=t.heads, kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn, moe_ffn=t.moe_ffn,
                         vocab=t.vocab, seed=t.seed)
        log.info("wrote tiny %s model to %s", t.family, path)
    if not cfg.sft.enabled:
        barrier()
        return path
    sft_dir = out_dir / "sft"
    if rank() == 0 and not (sft_dir / "sft_result.json").is_file():
        from megapo.tasks.registry import get_task
        from megapo.trainer.sft import train_sft

        result = train_sft(path, sft_dir, cfg.sft, get_task(cfg.data.task, cfg.data.task_options),
                           cfg.data.chat_template, cfg.rollout.max_new_tokens, turns=turn_play(cfg))
        log.info("sft warm start: validation exact-match %.3f after %d steps (%.1f s)%s", result.val_accuracy,
                 result.steps, result.seconds, "" if result.reached else " -- threshold NOT reached")
    barrier()
    return sft_dir


def build_learner(cfg: RunConfig, model_dir: Path) -> Learner:
    from megapo.learner.learner import Learner as MegatronLearner

    return MegatronLearner(model_dir, cfg.parallel, cfg.optim, seed=cfg.train.seed,
                   micro_batch_tokens=cfg.train.micro_batch_tokens, row_tokens=cfg.train.row_tokens,
                   total_steps=cfg.train.steps * cfg.train.updates_per_rollout * cfg.train.mini_batches,
                   routing_replay=records_routes(cfg, model_dir), precision=cfg.train.precision_spec(),
                   share_prefix=cfg.train.share_prefix_mode())


def records_routes(cfg: RunConfig, model_dir: Path) -> bool:
    """Whether the learner gets a route hook: for replay (r2/r3), and with the embedded engine on an MoE model to
    compare its own routing with the engine's every step (router/disagree; without replay the hook only records)."""
    from megapo.layout import num_experts, read_hf_config

    if cfg.algorithm.routing_replay != "off":
        return True
    return capabilities(cfg.rollout.engine).in_process and bool(num_experts(read_hf_config(model_dir)))


def build_engine(cfg: RunConfig, model_dir: Path):
    from megapo.trainer.engine_setup import engine_from_config

    return engine_from_config(cfg, model_dir, Path(cfg.train.output_dir))


def build_reference(cfg: RunConfig, model_dir: Path) -> Reference | None:
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
                                 seed=cfg.train.seed, precision=cfg.train.precision_spec(),
                                 share_prefix=cfg.train.share_prefix_mode())
    return PlainReference(model_dir, cfg.train.precision_spec()) if rank() == 0 else None


def make_transport(cfg: RunConfig, out_dir: Path, model_dir: Path, learner: Learner, engine: Engine):
    from megapo.weights import DiskTransport, TensorTransport

    if cfg.rollout.weight_sync == "tensor":
        return TensorTransport()
    if cfg.rollout.weight_sync == "disk":
        return DiskTransport(out_dir / "weights_sync", config_dir=model_dir)
    return broadcast_transport(cfg, learner, engine)


def broadcast_transport(cfg: RunConfig, learner: Learner, engine: Engine):
    """Form the weight-sync groups (collective): every stage root of the learner joins its stage's group as
    rank 0 while rank 0 has the engine's workers join as ranks 1.. (megapo.weights.broadcast). Rank 0 serves
    every stage's rendezvous at rollout.sync_host (an address of its node), so stage roots on other nodes meet
    there too; a changed fleet forms the next generation there (megapo.trainer.fleet.form_groups)."""
    from megapo.net import free_port
    from megapo.trainer.fleet import form_groups, group_timeout_s
    from megapo.weights.broadcast import BroadcastTransport, GroupAddress, host_stores

    r = cfg.rollout
    _, stages, _ = learner.sync_stage()
    port = broadcast_object((r.sync_port or free_port(r.sync_host)) if rank() == 0 else None)
    stores = host_stores(GroupAddress(r.sync_host, port, 1, timeout_s=group_timeout_s(cfg)), stages) \
        if rank() == 0 else []
    transport = BroadcastTransport(None, stores, timeout_s=group_timeout_s(cfg))
    transport.port = port
    if not any_rank(not form_groups(cfg, learner, engine, transport)):
        return transport
    raise RuntimeError(f"weight sync: the broadcast groups could not be formed on {r.sync_host}:{port} (the log "
                       "says why)")


def sync_weights(learner: Learner, engine: Engine, version: int, cfg: RunConfig, transport, fleet=None) -> dict:
    """Hand the learner's weights to the engine through megapo.weights (collective on the learner side:
    every rank streams the gathered tensors; only rank 0 has an engine), within rollout.sync_timeout_s: a
    fleet's dead servers are dropped and the sync completes for the others (megapo.trainer.fleet). A per-stage
    transport (broadcast) takes each stage's tensors on its own ranks, as views: nothing is copied on the
    learner."""
    from megapo.trainer.fleet import sync_in_time

    return sync_in_time(learner, engine, version, cfg, transport, fleet)


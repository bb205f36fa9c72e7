"""The run config of `megapo train`: typed sections and the one `validate()` with the cross-field rules.

    cfg = load_config(RunConfig, "megapo/configs/tiny_moe_addition.yaml", ["train.steps=10"])

Every rule raises ConfigError naming the dotted field, before any process, file or tensor is made.
Checks that need the model folder (layout, tokenizer files) or the data files (empty file,
malformed row) read only small files: config.json, the tokenizer's file names, the jsonl rows or
the parquet footer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megapo.config import ConfigError, OptimConfig, ParallelConfig, bounded, check_fields
from megapo.learner.precision import ENGINE_DTYPES, Precision
from megapo.trainer.distill import DistillConfig

if TYPE_CHECKING:
    from megapo.algorithms.spec import LossSpec

# Objective, advantage, correction, aggregation and KL names come from megapo.algorithms' registry
# (which also says how many samples per prompt an advantage estimator needs: Entry.min_group).
ROUTING_REPLAY = ("off", "r2", "r3")
WEIGHT_SYNC = ("tensor", "disk", "broadcast")
SERVER_DTYPES = ("bfloat16", "float16", "float32")  # rollout.dtype (or auto): what vLLM's --dtype takes
# Which log-probs the objective's ratio π_θ/π_old takes as π_old (AlgorithmConfig.old_policy).
OLD_POLICIES = ("auto", "learner", "engine")
MODES = ("sync", "async")
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _registry_names(kind: str) -> list[str]:
    from megapo.algorithms.registry import entries

    names = [e.name for e in entries(kind)]
    return [n for n in names if n != "entropy"] if kind == "kl" else names  # "entropy" is a bonus, not a KL


def _check_options(kind: str, name: str, options: dict, field_name: str) -> None:
    from megapo.algorithms.registry import get

    try:
        get(kind, name).make_options(dict(options))
    except (ValueError, TypeError) as exc:
        raise ConfigError(field_name, str(exc).removeprefix("options: ")) from None


# LossSpec field -> the config field it is built from (RunConfig.loss_spec; "correction" depends on the run)
LOSS_SPEC_FIELDS = {"objective": "algorithm.objective", "loss_agg": "algorithm.loss_agg",
                    "objective_options": "algorithm.objective_options", "correction_options": "algorithm.mismatch_options",
                    "kl_coef": "algorithm.kl_coef", "kl_estimator": "algorithm.kl_estimator",
                    "entropy_coef": "algorithm.entropy_coef"}


def min_group(estimator: str) -> int:
    """The fewest samples per prompt advantage `estimator` is defined for (its registry entry says)."""
    from megapo.algorithms.registry import get

    return get("advantage", estimator).min_group


# ----------------------------------------------------------------------------- sections


@dataclass
class TinyModelConfig:
    """Arguments of megapo.models.tiny.write_tiny_model; the model is written to model.path if absent."""

    family: str = "qwen3_moe"  # qwen3_moe | mixtral (MoE) | qwen2 (dense)
    layers: int = bounded(2, ">= 1")  # decoder layers
    experts: int = bounded(8, ">= 1")  # routed experts per MoE layer (unused by qwen2)
    topk: int = bounded(2, ">= 1")  # experts each token is routed to (at most experts)
    hidden: int = bounded(64, ">= 1")  # hidden size
    heads: int = bounded(4, ">= 1")  # attention heads
    kv_heads: int = bounded(2, ">= 1")  # key/value heads (grouped-query attention)
    head_dim: int = bounded(32, ">= 1")  # width of one attention head
    ffn: int = bounded(128, ">= 1")  # intermediate size of a dense MLP (config.json intermediate_size)
    moe_ffn: int = bounded(128, ">= 1")  # intermediate size of one expert
    vocab: int = bounded(512, ">= 300", "256 byte symbols + specials + merges")  # tokenizer vocabulary size
    seed: int = 0  # seed of the random weights


@dataclass
class ModelConfig:
    """The model RL starts from."""

    path: str = ""  # HF folder (config.json, safetensors, tokenizer)
    tiny: TinyModelConfig | None = None  # create a tiny model at `path` when it does not exist yet


@dataclass
class SFTConfig:
    """Supervised warm start on the built-in task before RL (see megapo.trainer.sft)."""

    enabled: bool = False  # run the warm start on data.task's demonstrations before RL
    examples: int = bounded(2000, ">= 1")  # fixed training examples (fewer are memorised, more solve the task outright)
    lr: float = bounded(2e-3, "> 0")  # AdamW learning rate
    batch_size: int = bounded(128, ">= 1")  # examples per step
    threshold: float = bounded(0.2, "(0, 1]")  # stop when validation exact-match reaches this
    check_every: int = bounded(20, ">= 1")  # steps between validation checks
    max_steps: int = bounded(2000, ">= 1")  # stop here even below threshold (sft_result.json says which)
    seed: int = 0  # seed of the examples and their order


@dataclass
class AlgorithmConfig:
    """The RL algorithm: objective, advantages and the stages around them, KL, corrections."""

    objective: str = "gspo"  # the policy-gradient loss (`megapo objectives --kind objective`)
    objective_options: dict[str, Any] = field(default_factory=dict)  # e.g. clip_low, clip_high
    advantage: str = "grpo"  # the advantage estimator (`megapo objectives --kind advantage`)
    advantage_options: dict[str, Any] = field(default_factory=dict)  # the estimator's options (--formulas)
    loss_agg: str = "auto"  # auto: the objective's paper aggregation (`megapo objectives` lists each)
    kl_coef: float = bounded(0.0, ">= 0")  # weight of the KL to π_ref (0: no KL term)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (`megapo objectives --kind kl`)
    # π_ref of the KL terms (megapo/learner/reference.py): megatron (a frozen Megatron copy of the starting
    # weights under the learner's layout, replaying the routes the policy is trained under) | plain (megapo's
    # PyTorch model on rank 0; one process, routing_replay off) | auto: plain for a single-process CPU learner
    # with routing_replay off on a family that model runs, else megatron. The run's log names the one used.
    reference: str = "auto"
    entropy_coef: float = bounded(0.0, ">= 0")  # weight of the entropy bonus (0: none)
    mismatch: str = "none"  # rollout/learner mismatch correction: none or a correction name (megapo objectives)
    mismatch_options: dict[str, Any] = field(default_factory=dict)  # the correction's options
    # π_old of the objective's ratio. learner: recomputed by the learner before the update (its clip bounds
    # the move within one rollout batch; a correction re-weights samples the engine drew from other
    # weights). engine: the engine's log-probs of the weights that drew the sample (the clip bounds the move
    # from the sampling policy itself, so samples k versions old stop pushing once the policy has moved
    # past them). auto: engine in train.mode=async, learner in sync.
    old_policy: str = "auto"
    # off | r2 (replay the learner's own routes from the old-log-prob pass) | r3 (replay the engine's routes).
    # `bool` because YAML 1.1 reads a bare `off` as false.
    routing_replay: str | bool = "off"
    # GRPO-λ's companion (seed 004 B22): a correct response's advantage is clamped at >= 0, so a length term
    # cannot push a long correct answer below a wrong one (megapo.algorithms.length.clamp_correct_advantages)
    clamp_correct_adv: bool = False
    # stages after the estimator (megapo/algorithms/stages.py, `megapo objectives --kind advantage_stage`):
    # both | positive | negative: which sequence advantages are kept, each side scaled by pos_scale / neg_scale
    advantage_polarity: str = "both"
    pos_scale: float = bounded(1.0, ">= 0")  # factor on the positive sequence advantages
    neg_scale: float = bounded(1.0, ">= 0")  # factor on the negative sequence advantages
    # none | gtpo | grpo_s | advantage_reweighting | fipo: per-token advantages from π_old's per-token statistics
    # (takes the separate old-log-prob pass, with entropies for gtpo / grpo_s; fipo: with the reference's
    # log-probs, or the engine's with against=engine)
    token_advantage: str = "none"
    token_advantage_options: dict[str, Any] = field(default_factory=dict)  # the token advantage's options
    # token_select's options ({} = off; score, rho, weight, rho_end, anneal_steps): per-token loss weights,
    # 1 for the top-rho fraction of the batch's tokens by π_old entropy (or |A|·entropy), `weight` for the rest
    token_select: dict[str, Any] = field(default_factory=dict)
    # none | stapo | nat_prefix: per-token loss weights of a token mask (megapo/algorithms/stages.py), multiplied
    # with token_select's; stapo takes the old-log-prob pass with entropies
    token_mask: str = "none"
    token_mask_options: dict[str, Any] = field(default_factory=dict)  # the token mask's options
    # loss: the KL to the reference is a loss term (kl_coef · k1/k2/k3); future: FRPO's future-KL advantage
    # A_t - β·Σ_{s≥t}(log π_old - log π_ref) with β = kl_coef, and no KL term in the loss
    kl_mode: str = "loss"
    # D³S sample-level selection ({} = off; keep, keep_end, anneal_steps): per group, the rollouts that maximise
    # Var(A) keep their advantage, the others get 0
    sample_select: dict[str, Any] = field(default_factory=dict)
    # none | cumulative: DCPO's smoothed standardisation, each prompt's rewards against its running mean / std
    # over all steps so far (replaces grpo's group statistics; the statistics live in the checkpoint)
    advantage_smoothing: str = "none"
    # on-policy distillation: a frozen teacher's per-token reverse KL enters the advantage (megapo/trainer/distill.py)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def needs_reference(self) -> bool:
        """Whether a term uses π_ref's log-probs (sample.ref_logp): a KL term, or a token advantage reading
        them (fipo against=reference)."""
        return self.kl_coef > 0 or "ref_logp" in self.token_advantage_inputs()

    def token_advantage_inputs(self) -> tuple[str, ...]:
        """The other policies' per-token log-probs algorithm.token_advantage reads (stages.token_advantage_inputs);
        () for none, or for a name / options that validation refuses (naming the field)."""
        from megapo.algorithms.stages import token_advantage_inputs

        if self.token_advantage == "none":
            return ()
        try:
            return token_advantage_inputs(self.token_advantage, self.token_advantage_options)
        except (TypeError, ValueError):
            return ()

    def needs_old_stats(self) -> bool:
        """Whether a stage needs π_old's per-token statistics before the loss (the separate old-log-prob pass)."""
        return (self.token_advantage != "none" or bool(self.token_select) or self.token_mask == "stapo"
                or self.kl_mode == "future" or self.distill.enabled)

    def needs_old_entropy(self) -> bool:
        """Whether the old-log-prob pass keeps π_old's per-token entropy: for a stage, or for the objective's
        loss (sample.old_entropy; a fused on-policy step takes it from its own forward instead)."""
        from megapo.algorithms.loss import token_inputs
        from megapo.algorithms.stages import NEEDS_ENTROPY

        return (self.token_advantage in NEEDS_ENTROPY or bool(self.token_select) or self.token_mask == "stapo"
                or "old_entropy" in token_inputs(self.objective, self.objective_options))

    def __post_init__(self) -> None:
        if self.routing_replay is False:
            self.routing_replay = "off"


@dataclass
class RolloutConfig:
    """How responses are generated, and how new weights reach the engine."""

    # embedded (megapo's PyTorch model in the trainer's process) | vllm | sglang (megapo.engines.registry: what
    # each can do; megapo/trainer/engine_setup.py: how the trainer builds it)
    engine: str = "embedded"
    servers: list[str] = field(default_factory=list)  # host:port of running vLLM/SGLang servers
    # the elastic fleet: a file of host:port lines (# comments), read at the start and again at every weight sync;
    # servers added to it join the run (they serve once they hold the current weights), servers removed from it
    # leave (megapo/trainer/fleet.py); the run's servers are rollout.servers plus the file's
    servers_file: str = ""
    # the longest a weight sync waits: a server that does not finish it in time (dead, stuck) is dropped and the
    # sync completes for the others (a broadcast group is formed again without it); a sync that cannot finish by
    # then is an error. Broadcast groups time out each operation after a third of it.
    sync_timeout_s: float = bounded(600.0, "> 0")
    host: str = "127.0.0.1"  # the address a vLLM server megapo starts itself listens on (no rollout.servers)
    n_samples: int = bounded(8, ">= 1")  # responses per prompt (the group size)
    temperature: float = bounded(1.0, "> 0")  # sampling temperature
    top_p: float = bounded(1.0, "(0, 1]")  # nucleus sampling: the probability mass kept
    max_new_tokens: int = bounded(64, ">= 1")  # most tokens per response; a longer one is cut (truncated)
    # partial rollouts (train.mode=async): a weight update preempts the batch in flight, whose samples keep their
    # tokens and continue on the new weights (each token records its version: Sample.token_versions), instead of
    # the learner waiting for the batch (the fixed schedule of megapo.trainer.async_rollout)
    partial: bool = False
    # partial rollouts: the most weight versions one response may span; one that would span more starts again on
    # the newest weights
    partial_max_versions: int = bounded(2, ">= 2")
    # how new weights reach the engine: tensor (handed over in the process) | disk (safetensors the servers
    # reload) | broadcast (a collective group with vLLM's workers); which engine takes which: its capabilities
    weight_sync: str = "tensor"
    bucket_mb: int = bounded(512, ">= 1")  # weight sync sends the tensors in buckets of at most this many MB
    # broadcast: where the servers' workers meet the learner's stage roots (host: an address of the learner's
    # rank-0 node the servers can reach, set by the Slurm templates; port 0: a free one picked at start;
    # stage s uses port + s)
    sync_host: str = "127.0.0.1"
    sync_port: int = bounded(0, "[0, 65535]", "0: a free port")  # broadcast: the first stage root's port
    # compute dtype of the embedded engine and of a vLLM server megapo starts itself (rollout.engine=vllm, no
    # rollout.servers); auto: the learner's (train.precision) when it is bf16 or fp16; with an fp32 learner the
    # engine's own default: float32 for the embedded engine (its log-probs and routes match the learner's),
    # bfloat16 for vLLM. float32 makes a server's log-probs match the learner's to ~1e-6 (tests, mismatch
    # studies); a lower one makes a real train-inference mismatch for the embedded engine.
    dtype: str = "auto"
    # file holding the API key of the vLLM servers in rollout.servers (the file `megapo serve` was given or
    # printed; the Slurm template makes one per job); required with vLLM servers, mode 600
    api_key_file: str = ""
    # σ of N(0, σ²) noise the engine adds to every MoE router's logits before its top-k (softmax routers: before
    # the softmax; sigmoid routers: before the sigmoid), so the noise moves both the choice of experts and their
    # gates; the learner routes without it. Simulates kernel-level router nondeterminism (a bf16 GPU engine
    # routing tokens unlike the learner) as a controlled dose: router/disagree grows with it. The engine samples
    # from, and reports the log-probs and routes of, the experts it used; drawn from a generator seeded by
    # train.seed (kept in checkpoints); the held-out evaluation on the engine sees it too. Engines whose
    # capabilities say router_noise (embedded); MoE models only.
    router_noise: float = bounded(0.0, ">= 0", "0: off")

    def compute_dtype(self, precision: str = "fp32") -> str:
        """rollout.dtype with auto resolved for this engine and the learner's train.precision."""
        from megapo.engines.registry import capabilities  # lazy: the engines' module imports torch

        if self.dtype != "auto":
            return self.dtype
        return ENGINE_DTYPES[precision] if precision != "fp32" else capabilities(self.engine).default_dtype


@dataclass
class OverlongConfig:
    """DAPO's soft overlong penalty on responses near rollout.max_new_tokens."""

    enabled: bool = False  # subtract the penalty from the rewards of long responses
    buffer: int = bounded(16, ">= 1")  # tokens before max_new_tokens where the penalty starts
    penalty: float = bounded(1.0, ">= 0")  # the penalty at max_new_tokens, growing linearly over the buffer


@dataclass
class DataConfig:
    """The prompts, the reward, and the reward shaping before advantages."""

    # a task (megapo.tasks.registry): built-in (addition, addition_cot) or "module:function"; empty with train_files
    task: str = ""
    task_options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the task's function
    # rows of prompt and answer (no task), each entry a jsonl / json / parquet / arrow file, a folder of them, a
    # dataset saved with HF datasets' save_to_disk, or a hub dataset name org/name (offline: from the local cache);
    # all read through HF datasets and its cache
    train_files: list[str] = field(default_factory=list)
    train_split: str = "train"  # the split read from a dataset of several (a save_to_disk DatasetDict, the hub)
    # held-out rows in the same forms: checked when the config loads; the held-out evaluation reads only a
    # task's test split so far
    val_files: list[str] = field(default_factory=list)
    val_split: str = "test"  # the split read from val_files' datasets of several
    prompt_key: str = "prompt"  # the prompt's column in the data files
    answer_key: str = "answer"  # the answer's column (what the reward compares with)
    # a chat-messages column (a list of {role, content} turns) read instead of prompt_key: the prompt is the turns
    # before the last assistant turn, through the tokenizer's chat template with chat_template (else as text:
    # one user turn is its content, more are "role: content" lines ending "assistant:"); empty: prompt_key
    messages_key: str = ""
    num_proc: int = bounded(1, ">= 1")  # processes of datasets' map that check the rows (1: this process)
    chat_template: bool = False  # wrap each prompt in the tokenizer's chat template
    max_prompt_tokens: int = bounded(512, ">= 1")  # longer prompts are skipped (the log counts them)
    prompts_per_step: int = bounded(64, ">= 1")  # prompts per step, rollout.n_samples responses each
    # DAPO's dynamic sampling: groups whose rewards all agree (no signal) are dropped and refilled with new
    # prompts
    dynamic_sampling: bool = False
    max_sampling_rounds: int = bounded(4, ">= 1")  # dynamic sampling: rounds of refills before training on fewer groups
    reward: str = "auto"  # exact_match | math | "module:function" | auto: the task's own, else exact_match
    # the reward of a response cut at rollout.max_new_tokens (no end-of-sequence), whatever its text would
    # score (null: score its text like a finished one's)
    truncated_reward: float | None = 0.0
    # a reward call that takes longer fails (0: no limit, and the reward runs in the caller's thread)
    reward_timeout_s: float = bounded(60.0, ">= 0", "0: no limit")
    # a reward that raises, times out or returns no finite number: fail (stop, naming the reward and the
    # sample) | zero (score it 0 and count it in the metric reward/errors)
    reward_errors: str = "fail"
    # DAPO's soft overlong penalty; the same as length_reward=dapo_overlong (set one of the two)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # length control (megapo/algorithms/length.py; `megapo objectives --kind length_reward --formulas`): a
    # group-aware length reward applied after the verifier, before advantages (none | its name) and its options
    length_reward: str = "none"
    length_reward_options: dict[str, Any] = field(default_factory=dict)  # the length reward's options
    # keep some responses of each group for training (none | gfpo, `--kind group_filter`) and its options
    group_filter: str = "none"
    group_filter_options: dict[str, Any] = field(default_factory=dict)  # the group filter's options
    # the verifier's verdict the length methods read: a response is correct when its reward is at least this
    correct_threshold: float = 0.5


@dataclass
class EnvConfig:
    """Multi-turn rollouts with an environment (megapo/envs/): tool calls answered between policy turns."""

    # auto: the task's own environment when it has one (data.task=calculator), else single-turn | none |
    # a built-in (calculator) | "module:Class" of a user's environment (megapo.envs.base.Environment)
    name: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's class
    max_turns: int = bounded(4, ">= 1")  # policy turns per trajectory; one more ends it (finish max_turns)
    # tokens after the prompt per trajectory, policy turns and observations together (0: rollout.max_new_tokens
    # times max_turns); each turn is also cut at rollout.max_new_tokens
    max_total_tokens: int = bounded(0, ">= 0", "0: max_new_tokens x max_turns")


@dataclass
class TrainConfig:
    """The step loop: batches, sync or async, evaluation, checkpoints, logs."""

    steps: int = bounded(100, ">= 1")  # RL steps, one rollout batch each
    updates_per_rollout: int = bounded(1, ">= 1")  # passes over each rollout batch
    mini_batches: int = bounded(1, ">= 1")  # optimizer steps per pass
    micro_batch_tokens: int = bounded(4096, ">= 1")  # tokens per micro-batch: rows x row width
    # width of a packed row (megapo/learner/packing.py): 0 the batch's longest sequence; a sequence longer
    # than it gets a row of its own (1: one sequence per row)
    row_tokens: int = bounded(0, ">= 0", "0: the longest sequence")
    # samples of one prompt hold it once in a micro-batch, each response seeing it and itself (same log-probs and
    # gradients, fewer tokens): auto (where the samples' given routes agree on it), true (refuse routes that do
    # not), false. Rows then fill up to row_tokens, or (0) micro_batch_tokens
    share_prefix: bool | str = "auto"
    # sync: generate, then train, in turn | async: a thread generates the next batches while the learner
    # trains (train.staleness bounds how old their weights may be)
    mode: str = "sync"
    staleness: int = bounded(1, ">= 0")  # async: the newest rollouts may come from weights this many versions old
    # async with algorithm.old_policy=learner: the correction (π_old/μ weights, megapo objectives) used when
    # algorithm.mismatch is none -- stale rollouts are off-policy. With old_policy=engine (the async default)
    # the objective's clipped ratio π_θ/μ is the correction, and this must stay "auto" or "none".
    async_correction: str = "auto"
    seed: int = 0  # seed of the prompt order, the embedded engine's sampling, the learner and seeded stages
    # steps between held-out evaluations on data.task's test split (also before step 1 and after the last)
    eval_every: int = bounded(50, ">= 0", "0 disables")
    eval_prompts: int = bounded(1000, ">= 0")  # test problems per held-out evaluation (0: none)
    # under routing_replay=r3: every how many steps the learner takes one more forward pass with its own routing
    # for mismatch/k3_free and router/* (the other stability metrics come every step; megapo.replay.modes)
    stability_metrics_every: int = bounded(0, ">= 0", "0: on eval steps")
    ckpt_every: int = bounded(0, ">= 0", "0: only at the end")  # steps between checkpoints
    keep_last: int = bounded(2, ">= 1")  # checkpoints kept; older ones are removed
    output_dir: str = "runs/run"  # the run folder: checkpoints, metrics, config (megapo/trainer/run_dir.py)
    log: list[str] = field(default_factory=lambda: ["jsonl"])  # metric backends: jsonl | tensorboard | wandb
    # write samples.jsonl: every trained response (step, prompt id, sample index, token ids, decoded text,
    # verifier and shaped reward, weight version, finish reason)
    log_samples: bool = False
    # the learner's parameters and activations (megapo/learner/precision.py): fp32, or bf16 / fp16 with fp32 main
    # parameters, optimizer state and gradient reduction (fp16: a dynamic loss scale; overflowing steps skipped)
    precision: str = "fp32"
    fp8: str = "none"  # Transformer Engine FP8 GEMMs (GPU with TE, train.precision=bf16): none | e4m3 | hybrid
    fp8_recipe: str = "delayed"  # FP8 scaling recipe: delayed | tensorwise | blockwise | mxfp8

    def share_prefix_mode(self) -> str:
        """train.share_prefix as the learner's mode: auto | on | off."""
        return {True: "on", False: "off"}.get(self.share_prefix, self.share_prefix)

    def precision_spec(self) -> Precision:
        """The learner's Precision (megapo/learner/precision.py) from train.precision / fp8 / fp8_recipe."""
        return Precision(self.precision, self.fp8, self.fp8_recipe)


@dataclass
class RunConfig:
    """The config of `megapo train`: one section per part of the run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def env_factory(self):
        """env.name resolved (megapo.envs.registry): a factory of one environment per trajectory, or None for
        single-turn rollouts."""
        from megapo.envs.registry import env_factory
        from megapo.tasks.registry import get_task

        task = get_task(self.data.task, self.data.task_options) if self.data.task else None
        return env_factory(self.env.name, self.env.options, task)

    def response_tokens(self) -> int:
        """The most tokens after a prompt: rollout.max_new_tokens, or a multi-turn trajectory's budget."""
        if self.env_factory() is None:
            return self.rollout.max_new_tokens
        return self.env.max_total_tokens or self.rollout.max_new_tokens * self.env.max_turns

    def reference(self, hf: dict) -> str:
        """algorithm.reference with auto resolved for the model config.json `hf`: plain where its one full copy
        is cheap and gives what the policy is trained under (one learner process, no GPU, routing_replay off:
        the plain model routes freely, and runs the family), else megatron."""
        import torch

        a = self.algorithm
        if a.reference != "auto":
            return a.reference
        plain = (self.parallel.world_size == 1 and not torch.cuda.is_available() and a.routing_replay == "off"
                 and plain_model_error(hf) is None)
        return "plain" if plain else "megatron"

    def old_policy(self) -> str:
        """algorithm.old_policy with auto resolved: engine for async runs, learner for sync ones."""
        if self.algorithm.old_policy != "auto":
            return self.algorithm.old_policy
        return "engine" if self.train.mode == "async" else "learner"

    def async_correction(self) -> str:
        """train.async_correction with auto resolved: tis when async samples are weighed against the learner's
        log-probs, none when the objective's ratio is already against the engine's (or the run is sync)."""
        if self.train.mode != "async":
            return "none"
        if self.train.async_correction != "auto":
            return self.train.async_correction
        return "tis" if self.old_policy() == "learner" else "none"

    def loss_spec(self) -> LossSpec:
        """The run's LossSpec (megapo/algorithms/spec.py), what the learner's every train step takes: the objective,
        its options and aggregation; the correction algorithm.mismatch, else for stale async samples the resolved
        train.async_correction; the KL term with kl_mode=loss only (future puts the KL into the advantages; the
        `kl` metric then uses k3); the entropy bonus. A spec the library refuses: ConfigError naming the field."""
        from megapo.algorithms.spec import LossSpec, LossSpecError

        a = self.algorithm
        correction = a.mismatch if a.mismatch != "none" else self.async_correction()
        kl_term = bool(a.kl_coef) and a.kl_mode == "loss"
        try:
            return LossSpec(a.objective, a.loss_agg, a.objective_options,
                            correction=None if correction == "none" else correction,
                            correction_options=a.mismatch_options if a.mismatch != "none" else {},
                            kl_coef=a.kl_coef if kl_term else 0.0, kl_estimator=a.kl_estimator if kl_term else "k3",
                            entropy_coef=a.entropy_coef)
        except LossSpecError as exc:
            where = "algorithm.mismatch" if a.mismatch != "none" else "train.async_correction"
            field_name = {**LOSS_SPEC_FIELDS, "correction": where}[exc.field]
            raise ConfigError(field_name, str(exc).removeprefix("options: ")) from None

    def validate(self) -> None:
        """All cross-field rules; the first violated one raises ConfigError naming its field."""
        check_fields(self)  # finite numbers in their declared ranges (the loader checked them already)
        self.parallel.validate()
        self.optim.validate()
        self._validate_algorithm()
        self._validate_rollout()
        self._validate_train()
        self._validate_data()
        self._validate_sft()
        self._validate_env()
        self._validate_model()  # reads config.json / tokenizer file names: last, after the cheap checks
        self._validate_sources()  # reads the data files and the tokenizer, calls the reward once

    # --- sections -------------------------------------------------------------------------------

    def _validate_algorithm(self) -> None:
        a = self.algorithm
        for kind, name, field_name in (("objective", a.objective, "algorithm.objective"),
                                       ("advantage", a.advantage, "algorithm.advantage"),
                                       ("aggregation", a.loss_agg, "algorithm.loss_agg"),
                                       ("kl", a.kl_estimator, "algorithm.kl_estimator")):
            known = _registry_names(kind) + (["auto"] if kind == "aggregation" else [])
            if name not in known:
                raise ConfigError(field_name, f"unknown {kind} {name!r}; known: {', '.join(known)}")
        if a.mismatch != "none" and a.mismatch not in _registry_names("correction"):
            raise ConfigError("algorithm.mismatch", f"unknown correction {a.mismatch!r}; known: none, "
                              f"{', '.join(_registry_names('correction'))}")
        self.loss_spec()  # the loss's own checks (objective and correction options, ...), naming the config field
        _check_options("advantage", a.advantage, a.advantage_options, "algorithm.advantage_options")
        self._validate_stages()
        if a.mismatch == "none" and a.mismatch_options:
            raise ConfigError("algorithm.mismatch_options", "given but algorithm.mismatch is 'none'")
        if a.old_policy not in OLD_POLICIES:
            raise ConfigError("algorithm.old_policy", f"must be one of {', '.join(OLD_POLICIES)}, got {a.old_policy!r}")
        if a.routing_replay not in ROUTING_REPLAY:
            raise ConfigError("algorithm.routing_replay", f"must be off, r2 or r3, got {a.routing_replay!r}")
        self._validate_reference()

    def _validate_reference(self) -> None:
        from megapo.learner.reference import REFERENCES

        a = self.algorithm
        if a.reference not in REFERENCES:
            raise ConfigError("algorithm.reference", f"must be one of {', '.join(REFERENCES)}, got {a.reference!r}")
        if a.reference == "auto":
            return
        if not a.needs_reference():
            raise ConfigError("algorithm.reference", f"set to {a.reference}, but no term uses a reference "
                              "(algorithm.kl_coef is 0); leave it auto")
        if a.reference == "plain" and self.parallel.world_size > 1:
            raise ConfigError("algorithm.reference", "plain holds the whole model on rank 0, and this learner is "
                              f"split over tp*pp*dp = {self.parallel.world_size} processes; use megatron (or auto)")
        if a.reference == "plain" and a.routing_replay != "off":
            raise ConfigError("algorithm.reference", "plain routes freely, so it cannot replay the routes "
                              f"algorithm.routing_replay={a.routing_replay} trains the policy under; use megatron "
                              "(or auto)")

    def _validate_stages(self) -> None:
        from megapo.algorithms.stages import POLARITIES

        a = self.algorithm
        if a.advantage_polarity not in POLARITIES:
            raise ConfigError("algorithm.advantage_polarity", f"must be one of {', '.join(POLARITIES)}, "
                              f"got {a.advantage_polarity!r}")
        from megapo.algorithms.stages import NOT_TOKEN_ADVANTAGE

        known = [n for n in _registry_names("advantage_stage") if n not in NOT_TOKEN_ADVANTAGE]
        if a.token_advantage != "none":
            if a.token_advantage not in known:
                raise ConfigError("algorithm.token_advantage", f"unknown stage {a.token_advantage!r}; known: none, "
                                  f"{', '.join(known)}")
            _check_options("advantage_stage", a.token_advantage, a.token_advantage_options,
                           "algorithm.token_advantage_options")
            if "rollout_logp" in a.token_advantage_inputs() and self.old_policy() == "engine":
                raise ConfigError("algorithm.token_advantage_options", f"{a.token_advantage} against=engine takes "
                                  "the log-ratio π_old/μ, and with algorithm.old_policy=engine π_old is μ (always 0); "
                                  "use against=reference or old_policy=learner")
        elif a.token_advantage_options:
            raise ConfigError("algorithm.token_advantage_options", "given but algorithm.token_advantage is 'none'")
        if a.token_select:
            _check_options("token_weight", "token_select", a.token_select, "algorithm.token_select")
        self._validate_stage_fields()

    def _validate_stage_fields(self) -> None:
        """algorithm.token_mask(_options), kl_mode, sample_select, advantage_smoothing."""
        from megapo.algorithms.stages import KL_MODES, TOKEN_MASKS

        a = self.algorithm
        if a.token_mask != "none":
            if a.token_mask not in TOKEN_MASKS:
                raise ConfigError("algorithm.token_mask", f"unknown mask {a.token_mask!r}; known: none, "
                                  f"{', '.join(TOKEN_MASKS)}")
            _check_options("token_weight", a.token_mask, a.token_mask_options, "algorithm.token_mask_options")
        elif a.token_mask_options:
            raise ConfigError("algorithm.token_mask_options", "given but algorithm.token_mask is 'none'")
        if a.kl_mode not in KL_MODES:
            raise ConfigError("algorithm.kl_mode", f"must be one of {', '.join(KL_MODES)}, got {a.kl_mode!r}")
        if a.kl_mode == "future" and not a.kl_coef > 0:
            raise ConfigError("algorithm.kl_coef", "algorithm.kl_mode=future takes its β from kl_coef: must be > 0")
        if a.sample_select:
            _check_options("advantage_stage", "d3s_select", a.sample_select, "algorithm.sample_select")
        if a.advantage_smoothing not in ("none", "cumulative"):
            raise ConfigError("algorithm.advantage_smoothing", f"must be none or cumulative, got {a.advantage_smoothing!r}")
        if a.advantage_smoothing == "cumulative" and a.advantage != "grpo":
            raise ConfigError("algorithm.advantage_smoothing", "cumulative replaces grpo's per-group standardisation; "
                              f"algorithm.advantage is {a.advantage!r} (set grpo)")

    def _validate_rollout(self) -> None:
        from megapo.engines.registry import capabilities, engine_names, needs_servers

        r = self.rollout
        if r.engine not in engine_names():
            raise ConfigError("rollout.engine", f"unknown engine {r.engine!r}; choose from {', '.join(engine_names())}")
        caps = capabilities(r.engine)
        if r.router_noise > 0 and not caps.router_noise:
            raise ConfigError("rollout.router_noise", f"engine {r.engine!r} cannot add noise to its routers (the "
                              "embedded engine can); set it to 0")
        if r.servers_file:
            from megapo.trainer.fleet import read_servers_file

            if caps.in_process:
                raise ConfigError("rollout.servers_file", f"rollout.engine={r.engine} runs in the trainer's process; "
                                  "a fleet of servers needs a server engine (vllm, sglang)")
            if not (r.servers or read_servers_file(r.servers_file)):
                raise ConfigError("rollout.servers_file", f"{r.servers_file} lists no server and rollout.servers is "
                                  "empty: the run needs one to start")
        if needs_servers(r.engine) and not r.servers and not r.servers_file:
            raise ConfigError("rollout.servers", f"rollout.engine={r.engine} needs running servers (host:port); megapo "
                              "starts only vLLM servers itself")
        if not caps.in_process:
            for i, server in enumerate(r.servers):
                host, sep, port = server.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ConfigError(f"rollout.servers[{i}]", f"expected host:port, got {server!r}")
        self._validate_api_key_file()
        if r.n_samples < min_group(self.algorithm.advantage):
            raise ConfigError("rollout.n_samples", f"advantage {self.algorithm.advantage!r} compares samples within a "
                              f"group; it needs n_samples >= {min_group(self.algorithm.advantage)}, got {r.n_samples}")
        if r.weight_sync not in WEIGHT_SYNC:
            raise ConfigError("rollout.weight_sync", f"must be one of {', '.join(WEIGHT_SYNC)}, got {r.weight_sync!r}")
        if r.weight_sync not in caps.weight_syncs:
            raise ConfigError("rollout.weight_sync", f"engine {r.engine!r} supports {', '.join(caps.weight_syncs)}, "
                              f"not {r.weight_sync!r}")
        if r.dtype not in ("auto",) + SERVER_DTYPES:
            raise ConfigError("rollout.dtype", f"must be auto or one of {', '.join(SERVER_DTYPES)}, got {r.dtype!r}")
        if r.partial and self.train.mode != "async":
            raise ConfigError("rollout.partial", "partial rollouts continue generations across weight updates, which "
                              "happen during generation only with train.mode=async")
        if r.partial and not caps.partial:
            raise ConfigError("rollout.partial", f"engine {r.engine!r} cannot preempt and continue a batch yet "
                              "(the embedded and vllm engines can)")
        if self.algorithm.routing_replay == "r3":
            ok, why = caps.returns_routes()
            if not ok:
                raise ConfigError("algorithm.routing_replay", f"r3 replays the engine's routes, but {why}; use r2")

    def _validate_train(self) -> None:
        t = self.train
        if self.data.prompts_per_step % t.mini_batches:
            raise ConfigError("train.mini_batches", f"must divide data.prompts_per_step={self.data.prompts_per_step} "
                              "(a mini-batch holds whole groups)")
        seq_len = self.data.max_prompt_tokens + self.response_tokens()
        if t.micro_batch_tokens < seq_len:
            raise ConfigError("train.micro_batch_tokens", f"{t.micro_batch_tokens} cannot hold one sequence of up to "
                              f"max_prompt_tokens + the response budget = {seq_len} tokens")
        if t.row_tokens > t.micro_batch_tokens:
            raise ConfigError("train.row_tokens", f"{t.row_tokens} is wider than a micro-batch "
                              f"(train.micro_batch_tokens={t.micro_batch_tokens})")
        if t.share_prefix not in (True, False, "auto"):
            raise ConfigError("train.share_prefix", f"must be auto, true or false, got {t.share_prefix!r}")
        t.precision_spec().validate("train")
        t.precision_spec().check_hardware("train")
        if t.mode not in MODES:
            raise ConfigError("train.mode", f"must be sync or async, got {t.mode!r}")
        if t.async_correction not in ("auto", "none") and t.async_correction not in _registry_names("correction"):
            raise ConfigError("train.async_correction", f"unknown correction {t.async_correction!r}; known: auto, none, "
                              f"{', '.join(_registry_names('correction'))}")
        if self.old_policy() == "engine":
            if t.async_correction not in ("auto", "none"):
                raise ConfigError("train.async_correction", "with algorithm.old_policy=engine the objective's clipped "
                                  "ratio π_θ/μ already corrects for stale samples; use auto or none, or set "
                                  "algorithm.old_policy=learner")
            if self.algorithm.mismatch != "none":
                raise ConfigError("algorithm.mismatch", "with algorithm.old_policy=engine the objective's ratio is "
                                  "taken against the engine's log-probs, so π_old/μ is 1; use none, or set "
                                  "algorithm.old_policy=learner")
        if not t.output_dir:
            raise ConfigError("train.output_dir", "must be set")
        _check_creatable_dir(t.output_dir, "train.output_dir")
        for i, backend in enumerate(t.log):
            if backend not in LOG_BACKENDS:
                raise ConfigError(f"train.log[{i}]", f"unknown backend {backend!r}; choose from {', '.join(LOG_BACKENDS)}")

    def _validate_length(self) -> None:
        """data.length_reward / data.group_filter: known names and options, a dry run on one group of
        rollout.n_samples responses; a filter's possibly ragged groups refused where the stages need [P, n]."""
        from megapo.trainer.length_stage import check_length_config

        d, a = self.data, self.algorithm
        if d.overlong.enabled and d.length_reward != "none":
            raise ConfigError("data.length_reward", "data.overlong is dapo_overlong under its older spelling; set one")
        check_length_config(self)
        if d.group_filter != "none":
            from megapo.algorithms.registry import get

            ragged_ok = get("advantage", a.advantage).granularity == "group" and not a.sample_select \
                and a.advantage_smoothing != "cumulative"
            if not ragged_ok:
                raise ConfigError("data.group_filter", "a group filter may keep groups of different sizes; it needs a "
                                  f"group-level advantage (not {a.advantage!r}) and no algorithm.sample_select or "
                                  "advantage_smoothing")

    def _validate_data(self) -> None:
        from megapo.tasks.registry import reward_spec
        from megapo.trainer import rewards

        d = self.data
        if d.prompts_per_step % self.parallel.dp:
            raise ConfigError("data.prompts_per_step", f"{d.prompts_per_step} is not divisible by parallel.dp={self.parallel.dp}")
        if d.dynamic_sampling and self.rollout.n_samples < 2:
            raise ConfigError("data.dynamic_sampling", "drops groups whose samples agree; needs rollout.n_samples >= 2")
        if d.overlong.enabled and not 0 < d.overlong.buffer < self.rollout.max_new_tokens:
            raise ConfigError("data.overlong.buffer", f"must be in (0, rollout.max_new_tokens={self.rollout.max_new_tokens}), "
                              f"got {d.overlong.buffer}")
        self._validate_length()
        if d.task and d.train_files:
            raise ConfigError("data.task", "give either a task or train_files, not both")
        if d.task:
            from megapo.tasks.registry import get_task

            test_size = get_task(d.task, d.task_options).size("test")
            if self.train.eval_prompts > test_size:
                raise ConfigError("train.eval_prompts", f"the {d.task} test split has {test_size} problems, "
                                  f"got {self.train.eval_prompts}")
        elif d.task_options:
            raise ConfigError("data.task_options", "given but data.task is not set")
        elif not d.train_files:
            raise ConfigError("data.train_files", "no data: set data.task or data.train_files")
        if d.reward_errors not in rewards.REWARD_ERRORS:
            raise ConfigError("data.reward_errors", f"must be one of {', '.join(rewards.REWARD_ERRORS)}, "
                              f"got {d.reward_errors!r}")
        rewards.get_reward(reward_spec(d), "data.reward")

    def _validate_sources(self) -> None:
        """The data files' rows, whether a prompt fits (megapo.trainer.data.check_sources), and one call of
        the reward on the first training example."""
        from megapo.tasks.registry import reward_spec
        from megapo.trainer import data, rewards

        first = data.check_sources(self)
        rewards.check_reward(reward_spec(self.data), first, self.data.reward_timeout_s, "data.reward")

    def _validate_api_key_file(self) -> None:
        """vLLM servers (megapo serve) answer only requests with their key: the trainer needs the key file; a
        file that exists must be private (megapo serve creates a missing one)."""
        from megapo.engines.auth import read_key_file

        from megapo.engines.registry import capabilities

        r = self.rollout
        if capabilities(r.engine).api_key and (r.servers or r.servers_file) and not r.api_key_file:
            raise ConfigError("rollout.api_key_file", "is required with vLLM rollout.servers: megapo serve's servers "
                              "refuse requests without their key (the file megapo serve was given or printed)")
        if r.api_key_file and (r.servers or r.servers_file or Path(r.api_key_file).exists()):
            try:
                read_key_file(r.api_key_file, "rollout.api_key_file")
            except (OSError, ValueError) as err:
                raise ConfigError("rollout.api_key_file", str(err).removeprefix("rollout.api_key_file: ")) from None

    def _validate_env(self) -> None:
        """env.*: the environment builds with its options; what multi-turn rollouts do not support yet."""
        if self.env_factory() is None:
            return
        a = self.algorithm
        per_token = [name for name, on in (("algorithm.token_advantage", a.token_advantage != "none"),
                                           ("algorithm.token_select", bool(a.token_select)),
                                           ("algorithm.token_mask", a.token_mask != "none"),
                                           ("data.length_reward", self.data.length_reward != "none"),
                                           ("data.group_filter", self.data.group_filter != "none"),
                                           ("data.overlong.enabled", self.data.overlong.enabled)) if on]
        if per_token:  # their statistics would count the environment's tokens as the policy's
            raise ConfigError(per_token[0], "is not supported with multi-turn rollouts (an environment: env.name="
                              f"{self.env.name}) yet")
        if self.env.max_total_tokens and self.env.max_total_tokens < 2:
            raise ConfigError("env.max_total_tokens", "must leave room for a turn and its stop token (>= 2)")

    def _validate_sft(self) -> None:
        s = self.sft
        if not s.enabled:
            return
        if not self.data.task:
            raise ConfigError("sft.enabled", "the warm start trains on a task's demonstrations; set data.task")
        if self.rollout.servers or self.rollout.servers_file:  # the servers loaded model.path, not the warm start
            raise ConfigError("sft.enabled", "rollout.servers serve model.path; run the warm start first and point "
                              "model.path at its output (or leave rollout.servers empty)")

    def _validate_model(self) -> None:
        from megapo.layout import check_layout, num_experts, read_hf_config

        m = self.model
        if not m.path:
            raise ConfigError("model.path", "must be set (an HF folder, or where model.tiny writes one)")
        path = Path(m.path)
        if not (path / "config.json").is_file():
            if m.tiny is None:
                raise ConfigError("model.path", f"{m.path} has no config.json (and no model.tiny block to create one)")
            _check_creatable_dir(m.path, "model.path")
            hf = tiny_hf_config(m.tiny)  # the model will be created: check the layout against its shape
            where = "model.tiny"
        else:
            hf = read_hf_config(path, "model.path")
            where = str(path / "config.json")
            if not any((path / f).is_file() for f in TOKENIZER_FILES):
                raise ConfigError("model.path", f"{m.path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
            if self.data.chat_template and not _has_chat_template(path):
                raise ConfigError("data.chat_template", f"the tokenizer in {m.path} has no chat template")
        from megapo.engines.registry import capabilities

        spec = learner_spec(hf, where)
        self._check_torch_model(hf, where)
        check_layout(self.parallel, hf)
        self._validate_teacher()
        if capabilities(self.rollout.engine).starts_server and not (self.rollout.servers or self.rollout.servers_file):
            from megapo.engines.server import check_servable_here

            try:
                check_servable_here(hf)
            except ValueError as err:
                raise ConfigError("rollout.engine", str(err)) from None
        if self.rollout.router_noise > 0 and not num_experts(hf):
            raise ConfigError("rollout.router_noise", "router noise perturbs the experts' routers; this model is "
                              "dense (no experts)")
        if self.algorithm.routing_replay != "off" and not num_experts(hf):
            raise ConfigError("algorithm.routing_replay", "routing replay needs an MoE model; this one is dense")
        if self.algorithm.routing_replay != "off":
            from megapo.replay.routes import RouteShape

            try:
                RouteShape.from_spec(spec)
            except ValueError as err:
                raise ConfigError("algorithm.routing_replay", str(err)) from None
        if (path / "config.json").is_file():  # the safetensors hold exactly the tensors config.json describes
            from megapo.convert.inputs import check_hf_tensors
            from megapo.models.family import family_for

            check_hf_tensors(path, family_for(hf), spec, "model.path")  # headers only: names, shapes, truncation

    def _validate_teacher(self) -> None:
        """algorithm.distill: its folder, tokenizer and mode, and that the teacher fits the learner's layout."""
        from megapo.layout import check_layout, read_hf_config

        d = self.algorithm.distill
        d.validate(self.model.path)
        if d.enabled:
            try:
                check_layout(self.parallel, read_hf_config(d.teacher))
            except ConfigError as err:
                raise ConfigError("algorithm.distill.teacher", f"the teacher does not fit the learner's layout: "
                                                               f"{err}") from None

    def _check_torch_model(self, hf: dict, where: str) -> None:
        """The embedded engine and the plain KL reference run megapo's in-process PyTorch model, which knows
        fewer families than the learner (no llama): refuse here, not after the learner is built."""
        from megapo.engines.registry import capabilities

        plain_ref = self.algorithm.needs_reference() and self.reference(hf) == "plain"
        users = {"rollout.engine": capabilities(self.rollout.engine).in_process, "algorithm.reference": plain_ref}
        field_name = next((name for name, uses in users.items() if uses), None)
        why = plain_model_error(hf) if field_name is not None else None
        if why is not None:
            user = "the embedded engine" if field_name == "rollout.engine" else "the plain KL reference"
            raise ConfigError(field_name, f"{user} runs megapo's PyTorch model, which cannot run {where}: {why}")


def plain_model_error(hf: dict) -> str | None:
    """Why megapo's in-process PyTorch model (megapo.engines.torch_lm) cannot run config.json `hf`, or None."""
    from megapo.engines.torch_lm import TorchLMSpec

    try:
        TorchLMSpec.from_config(hf)
    except (ValueError, KeyError) as err:
        return err.args[0] if isinstance(err, ValueError) else f"it has no field {err}"
    return None


def _check_creatable_dir(path: str, field_name: str) -> None:
    """`path` is a folder, or one can be made there: no file in its place or above it."""
    p = Path(path)
    for existing in (p, *p.parents):
        if existing.exists():
            if not existing.is_dir():
                what = "is a file" if existing == p else f"lies under {existing}, which is a file"
                raise ConfigError(field_name, f"{path} {what}; it must be a folder")
            return


def learner_spec(hf: dict, where: str):
    """The learner's ModelSpec of `hf` (config.json at `where`), or ConfigError saying why the learner cannot
    train it: an unknown model_type, a missing field, or an MoE config under a dense family (e.g. llama)."""
    from megapo.layout import num_experts
    from megapo.models.family import family_for

    try:
        spec = family_for(hf).spec(hf)
    except ConfigError as err:
        raise ConfigError("model.path", f"{where}: {err.message}") from None
    except KeyError as err:
        raise ConfigError("model.path", f"{where}: model_type {hf.get('model_type')!r} needs field {err}") from None
    if num_experts(hf) and not spec.num_experts:
        raise ConfigError("model.path", f"{where}: model_type {hf.get('model_type')!r} is a dense family, but the config "
                          f"declares {num_experts(hf)} experts; an MoE model needs its MoE model_type "
                          "(qwen3_moe, mixtral)")
    return spec


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file():
        return True
    cfg = path / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def tiny_hf_config(t: TinyModelConfig) -> dict:
    """The config.json model.tiny will write (the model itself is written after validation)."""
    from megapo.models.tiny import build_config, tiny_families

    if t.family not in tiny_families():
        raise ConfigError("model.tiny.family", f"must be one of {', '.join(tiny_families())}, got {t.family!r}")
    if t.family != "qwen2" and t.topk > t.experts:
        raise ConfigError("model.tiny.topk", f"must be at most model.tiny.experts={t.experts}, got {t.topk}")
    return build_config(t.family, vocab_size=t.vocab, hidden=t.hidden, layers=t.layers, experts=t.experts,
                        topk=t.topk, heads=t.heads, kv_heads=t.kv_heads, head_dim=t.head_dim, ffn=t.ffn,
                        moe_ffn=t.moe_ffn, eos_id=0, pad_id=0).to_dict()  # token ids do not matter here

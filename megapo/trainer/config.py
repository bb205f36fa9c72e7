"""The run config of `megapo train`: RunConfig, its sections, and the rules that span sections.

    cfg = load_config(RunConfig, "megapo/configs/tiny_moe_addition.yaml", ["train.steps=10"])

Each section lives with the package that uses it, its rules beside it in its own `validate()`:

    model      megapo/models/config.py      ModelConfig, TinyModelConfig
    parallel   megapo/config.py             ParallelConfig (optim: OptimConfig)
    algorithm  megapo/algorithms/config.py  AlgorithmConfig, DistillConfig, ReplayMode
    rollout    megapo/engines/config.py     RolloutConfig
    env        megapo/envs/config.py        EnvConfig
    data, train, sft   here: the trainer's own (megapo/trainer/data.py, rewards.py, length_stage.py, sft.py)

RunConfig.validate runs each section's rules, then the rules that read more than one section, each written once
here. Every rule raises ConfigError naming the dotted field, before any process, file or tensor is made. Checks
that need the model folder (layout, tokenizer files) or the data files (empty file, malformed row) read only small
files: config.json, the tokenizer's file names, the jsonl rows or the parquet footer. The section classes are
importable from here too (`from megapo.trainer.config import AlgorithmConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megapo.algorithms.config import AlgorithmConfig, DistillConfig, ReplayMode, min_group, registry_names
from megapo.config import ConfigError, OptimConfig, ParallelConfig, bounded, check_creatable_dir, check_fields
from megapo.engines.config import RolloutConfig, plain_model_error
from megapo.envs.config import EnvConfig
from megapo.learner.precision import Precision
from megapo.models.config import TOKENIZER_FILES, ModelConfig, TinyModelConfig, has_chat_template, tiny_hf_config

if TYPE_CHECKING:
    from megapo.algorithms.spec import LossSpec

__all__ = ["AlgorithmConfig", "DataConfig", "DistillConfig", "EnvConfig", "ModelConfig", "OptimConfig",
           "LikelihoodRewardConfig", "OverlongConfig", "ParallelConfig", "ReplayMode", "RewardModelConfig",
           "RolloutConfig", "RunConfig", "SFTConfig", "TinyModelConfig", "TOKENIZER_FILES", "TrainConfig", "min_group",
           "tiny_hf_config"]

MODES = ("sync", "async")
CURRICULA = ("none", "semantic_entropy")  # data.curriculum (megapo.trainer.data.prompt_source)
LOG_BACKENDS = ("jsonl", "tensorboard", "wandb")

# LossSpec field -> the config field it is built from (RunConfig.loss_spec; "correction" depends on the run)
LOSS_SPEC_FIELDS = {"objective": "algorithm.objective", "loss_agg": "algorithm.loss_agg",
                    "objective_options": "algorithm.objective_options", "correction_options": "algorithm.mismatch_options",
                    "kl_coef": "algorithm.kl_coef", "kl_estimator": "algorithm.kl_estimator",
                    "entropy_coef": "algorithm.entropy_coef", "distill_topk": "algorithm.distill.teachers"}


# ----------------------------------------------------------------------------- the trainer's sections


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
class OverlongConfig:
    """DAPO's soft overlong penalty on responses near rollout.max_new_tokens."""

    enabled: bool = False  # subtract the penalty from the rewards of long responses
    buffer: int = bounded(16, ">= 1")  # tokens before max_new_tokens where the penalty starts
    penalty: float = bounded(1.0, ">= 0")  # the penalty at max_new_tokens, growing linearly over the buffer


@dataclass
class RewardModelConfig:
    """data.reward_model: a reward model's score added to each sample's reward (megapo/trainer/reward_model.py)."""

    # an HF *ForSequenceClassification folder (one label, e.g. `megapo tiny-model --head score` or `megapo
    # rm-train`) scored at each sequence's last token by a frozen Megatron model under the learner's layout and
    # precision; path and url empty: no reward model
    path: str = ""
    # or a scorer service (http:// or https://) that rank 0 POSTs each step's token ids to, under data.reward_timeout_s
    # and data.reward_errors (the protocol: docs/CONTRACTS.md, "Remote reward model"); give path or url
    url: str = ""
    # a file holding the scorer's API key, sent as the engine servers' header (rollout.api_key_file's); empty: none
    api_key_file: str = ""
    # its score times this is added to the reward before the advantages (data.reward still applies: for the
    # reward model alone, give a data.reward of 0 for every response, a "module:function" returning 0.0); with
    # dense, the weight of its process advantage in each token's advantage instead
    coef: float = 1.0
    # dense rewards (megapo/algorithms/process_rewards.py: PRIME-style returns-to-go of the score's increments,
    # whitened over each group's tokens, added to the per-token advantage): off | step (a reward per step, steps
    # ending where the decoded response completes step_delimiter) | token (a reward per token); needs path
    dense: bool | str = "off"
    step_delimiter: str = "\n"  # dense=step: the text that ends a step (the last step ends at the response's end)

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.url)

    def dense_mode(self) -> str:
        """data.reward_model.dense as a name: YAML reads a bare `off` as false."""
        return "off" if self.dense is False else self.dense

    def check_dense(self) -> None:
        """dense: a known mode, with a delimiter for steps, for a model run in the learner (a url's scorer returns
        one score per sequence)."""
        from megapo.algorithms.process_rewards import DENSE_MODES

        mode = self.dense_mode()
        if mode not in DENSE_MODES:
            raise ConfigError("data.reward_model.dense", f"must be one of {', '.join(DENSE_MODES)}, got {self.dense!r}")
        if mode == "off":
            return
        if mode == "step" and not (isinstance(self.step_delimiter, str) and self.step_delimiter):
            raise ConfigError("data.reward_model.step_delimiter", "dense=step cuts the response where its text "
                              f"holds this delimiter: must be a non-empty string, got {self.step_delimiter!r}")
        if self.url:
            raise ConfigError("data.reward_model.dense", "a scorer at data.reward_model.url returns one score per "
                              "sequence (docs/CONTRACTS.md); dense rewards need a model run in the learner "
                              "(data.reward_model.path)")
        if not self.path:
            raise ConfigError("data.reward_model.dense", f"dense={mode} needs a reward model: set "
                              "data.reward_model.path")

    def validate(self, policy_hf: dict | None) -> None:
        """One source: a url (check_url), or a folder that is a one-label sequence-classification checkpoint of a
        registered family reading the policy's token ids (`policy_hf`: the policy's config.json, None when
        unknown)."""
        self.check_dense()
        if self.url or self.api_key_file:
            self.check_url()
        if not self.path or self.url:
            return
        from megapo.layout import read_hf_config
        from megapo.learner.score import _family, check_score_folder

        where, folder = "data.reward_model.path", Path(self.path)
        if not (folder / "config.json").is_file():
            raise ConfigError(where, f"{folder} is not an HF model folder (no config.json)")
        hf = read_hf_config(folder, where)
        check_score_folder(folder, hf, _family(hf, where), where)
        if policy_hf is not None and hf.get("vocab_size") != policy_hf.get("vocab_size"):
            raise ConfigError(where, f"the reward model's vocab_size is {hf.get('vocab_size')}, the policy's "
                                     f"{policy_hf.get('vocab_size')}: it reads the policy's token ids")

    def check_url(self) -> None:
        """The url alone (not with path), http(s)://host; a key file only with it, private, holding a key."""
        from urllib.parse import urlsplit

        from megapo.engines.auth import read_key_file

        if not self.url:
            raise ConfigError("data.reward_model.api_key_file", "given but data.reward_model.url is not set")
        if self.path:
            raise ConfigError("data.reward_model.url", "give data.reward_model.path (a model run in the learner) or "
                                                       "url (a scorer service), not both")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError("data.reward_model.url", f"must look like http(s)://HOST[:PORT][/PATH], got {self.url!r}")
        if self.api_key_file:
            try:
                read_key_file(self.api_key_file, "data.reward_model.api_key_file")
            except (OSError, ValueError) as err:
                raise ConfigError("data.reward_model.api_key_file",
                                  str(err).removeprefix("data.reward_model.api_key_file: ")) from None


@dataclass
class LikelihoodRewardConfig:
    """data.likelihood_reward: the log-probability of the reference answer after each response's chain of thought as
    its reward (megapo/trainer/likelihood_reward.py: r <- verifier_coef · r + coef · L, one more learner forward)."""

    coef: float = bounded(0.0, ">= 0", "0: off")  # the weight of L (the answer's log-probability) in the reward; 0: off
    mode: str = "sum"  # sum: L = log π(a* | x, z), the paper's | mean: L per answer token
    # the weight of the reward before (the verifier's, shaped); 0: the likelihood alone, as the paper trains
    verifier_coef: float = bounded(0.0, ">= 0")
    # the text after which a response's answer starts (its last occurrence); the response is cut there and the
    # reference answer's tokens appended; empty: no marker
    answer_marker: str = ""
    # a response without the marker: end (the whole response, end-of-sequence dropped, then the marker, is the
    # chain of thought) | start (it is all answer: the reference answer follows the prompt)
    absent: str = "end"

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    def validate(self) -> None:
        """Known mode and absent; verifier_coef only with coef; start needs a marker to cut at."""
        from megapo.trainer.likelihood_reward import ABSENT, MODES

        for name, value, known in (("mode", self.mode, MODES), ("absent", self.absent, ABSENT)):
            if value not in known:
                raise ConfigError(f"data.likelihood_reward.{name}", f"must be one of {', '.join(known)}, got {value!r}")
        if not self.enabled and self.verifier_coef != 0.0:
            raise ConfigError("data.likelihood_reward.verifier_coef", "given but data.likelihood_reward.coef is 0 "
                              "(the likelihood reward is off)")
        if not isinstance(self.answer_marker, str):
            raise ConfigError("data.likelihood_reward.answer_marker", f"must be a string, got {self.answer_marker!r}")
        if self.absent == "start" and not self.answer_marker:
            raise ConfigError("data.likelihood_reward.absent", "start makes a response without the marker all answer; "
                              "with no data.likelihood_reward.answer_marker the reward would not depend on the "
                              "response: set a marker or absent=end")


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
    # the prompt order: none (a seeded shuffle per epoch) | semantic_entropy (SENT's curriculum, arXiv:2512.04359:
    # each epoch from low to high semantic entropy of the prompts' answers in the previous epoch's rollouts)
    curriculum: str = "none"
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
    # a reward model's score added to the verifier's reward before the advantages (path and url empty: none)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # the log-probability of the reference answer after each response's chain of thought as (part of) its reward
    likelihood_reward: LikelihoodRewardConfig = field(default_factory=LikelihoodRewardConfig)


    def validate(self) -> None:
        """The rules inside the section: one source of prompts, a known reward and error policy, one spelling
        of the overlong penalty."""
        from megapo.tasks.registry import reward_spec
        from megapo.trainer import rewards

        if self.overlong.enabled and self.length_reward != "none":
            raise ConfigError("data.length_reward", "data.overlong is dapo_overlong under its older spelling; set one")
        if self.task and self.train_files:
            raise ConfigError("data.task", "give either a task or train_files, not both")
        if not self.task and self.task_options:
            raise ConfigError("data.task_options", "given but data.task is not set")
        if not self.task and not self.train_files:
            raise ConfigError("data.train_files", "no data: set data.task or data.train_files")
        if self.curriculum not in CURRICULA:
            raise ConfigError("data.curriculum", f"must be one of {', '.join(CURRICULA)}, got {self.curriculum!r}")
        if self.reward_errors not in rewards.REWARD_ERRORS:
            raise ConfigError("data.reward_errors", f"must be one of {', '.join(rewards.REWARD_ERRORS)}, "
                              f"got {self.reward_errors!r}")
        self.reward_model.check_dense()
        self.likelihood_reward.validate()
        rewards.get_reward(reward_spec(self), "data.reward")


def check_length_methods(d: DataConfig, n: int, budget: int) -> None:
    """data.length_reward / data.group_filter name known methods whose options they accept, and each runs on one
    group of n (rollout.n_samples) responses of up to `budget` tokens (a fresh instance: a filter keeping more
    than the group, or a method that needs a difficulty the task has not, fails here, naming the field)."""
    import torch

    from megapo.algorithms.length import ScoredGroup, build_group_filter, build_length_reward, check_kept, check_shaped

    rewards = torch.tensor([float(i % 2) for i in range(n)], dtype=torch.float64)
    group = ScoredGroup("config-check", 1, rewards, rewards >= d.correct_threshold,
                        torch.arange(1, n + 1, dtype=torch.int64).clamp(max=budget), torch.zeros(n, dtype=torch.bool))
    for kind, name, options in (("length_reward", d.length_reward, d.length_reward_options),
                                ("group_filter", d.group_filter, d.group_filter_options)):
        if name == "none":
            if options:
                raise ConfigError(f"data.{kind}_options", f"given but data.{kind} is none")
            continue
        build = build_length_reward if kind == "length_reward" else build_group_filter
        try:
            method = build(name, options, budget)
        except (ValueError, TypeError) as exc:
            field_name = f"data.{kind}" if str(exc).startswith(f"data.{kind}") else f"data.{kind}_options"
            why = str(exc).removeprefix(f"data.{kind}: ").removeprefix("options: ")
            option, _, rest = why.partition(": ")
            if field_name.endswith("_options") and rest and _names_option_field(kind, name, option):
                raise ConfigError(f"{field_name}.{option}", f"{name}: {rest}") from None
            raise ConfigError(field_name, why) from None
        try:
            method.check_group_size(n)
            if kind == "length_reward":
                from megapo.algorithms.step_length import one_step_each

                checked = one_step_each(group) if method.step_delimiter() is not None else group  # no text here
                check_shaped([checked], method.shape([checked], 1), f"data.{kind}")
            else:
                check_kept([group], method.select([group], 1), f"data.{kind}")
        except ValueError as exc:
            raise ConfigError(f"data.{kind}_options", f"{name} on a group of rollout.n_samples={n}: {exc}") from None


def _names_option_field(kind: str, name: str, option: str) -> bool:
    """An options class that says so (option_field) has its refusals name data.<kind>_options.<option>."""
    from megapo.algorithms.registry import get

    entry = get(kind, name)
    return bool(getattr(entry.options, "option_field", False)) and option in entry.option_names()


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


    def validate(self) -> None:
        """The rules inside the section; the first violated one raises ConfigError naming its field."""
        if self.row_tokens > self.micro_batch_tokens:
            raise ConfigError("train.row_tokens", f"{self.row_tokens} is wider than a micro-batch "
                              f"(train.micro_batch_tokens={self.micro_batch_tokens})")
        if self.share_prefix not in (True, False, "auto"):
            raise ConfigError("train.share_prefix", f"must be auto, true or false, got {self.share_prefix!r}")
        self.precision_spec().validate("train")
        self.precision_spec().check_hardware("train")
        if self.mode not in MODES:
            raise ConfigError("train.mode", f"must be sync or async, got {self.mode!r}")
        known = registry_names("correction")
        if self.async_correction not in ("auto", "none", *known):
            raise ConfigError("train.async_correction", f"unknown correction {self.async_correction!r}; known: auto, "
                              f"none, {', '.join(known)}")
        if not self.output_dir:
            raise ConfigError("train.output_dir", "must be set")
        check_creatable_dir(self.output_dir, "train.output_dir")
        for i, backend in enumerate(self.log):
            if backend not in LOG_BACKENDS:
                raise ConfigError(f"train.log[{i}]", f"unknown backend {backend!r}; choose from {', '.join(LOG_BACKENDS)}")


# ----------------------------------------------------------------------------- the run


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
        train.async_correction; the KL term unless the stage future_kl puts the KL into the advantages (the
        `kl` metric then uses k3); the entropy bonus. A spec the library refuses: ConfigError naming the field."""
        from megapo.algorithms.spec import LossSpec, LossSpecError

        a = self.algorithm
        correction = a.mismatch if a.mismatch != "none" else self.async_correction()
        kl_term = bool(a.kl_coef) and not a.has_stage("future_kl")
        try:
            return LossSpec(a.objective, a.loss_agg, a.objective_options,
                            correction=None if correction == "none" else correction,
                            correction_options=a.mismatch_options if a.mismatch != "none" else {},
                            kl_coef=a.kl_coef if kl_term else 0.0, kl_estimator=a.kl_estimator if kl_term else "k3",
                            entropy_coef=a.entropy_coef, distill_topk=a.distill.topk_coefs())
        except LossSpecError as exc:
            where = "algorithm.mismatch" if a.mismatch != "none" else "train.async_correction"
            field_name = {**LOSS_SPEC_FIELDS, "correction": where}[exc.field]
            raise ConfigError(field_name, str(exc).removeprefix("options: ")) from None

    def validate(self) -> None:
        """Each section's own rules, then the rules that span sections (each written once, here); the first violated
        one raises ConfigError naming its field."""
        check_fields(self)  # finite numbers in their declared ranges (the loader checked them already)
        self.parallel.validate()
        self.optim.validate()
        self._validate_algorithm()
        self._validate_rollout()
        self._validate_train()
        self._validate_data()
        _check_sft(self)
        _check_env(self)
        _check_model(self)  # reads config.json / tokenizer file names: last, after the cheap checks
        _check_sources(self)  # reads the data files and the tokenizer, calls the reward once

    # one group per section: its own rules, then the ones that read it together with other sections

    def _validate_algorithm(self) -> None:
        self.algorithm.validate()
        self.loss_spec()  # the loss's own checks (objective and correction options, ...), naming the config field
        _check_stage_policy(self)
        _check_contrast(self)
        _check_hdpo(self)
        _check_anytime(self)
        _check_dast_simpo(self)
        _check_soup(self)
        _check_reference(self)

    def _validate_rollout(self) -> None:
        self.rollout.validate()
        _check_rollout(self)

    def _validate_train(self) -> None:
        _check_batches(self)
        self.train.validate()
        _check_old_policy(self)

    def _validate_data(self) -> None:
        self.data.validate()
        _check_data(self)
        _check_reward_components(self)


# ----------------------------------------------------------------------------- rules that span sections


def _check_stage_policy(cfg: RunConfig) -> None:
    """A stage against the engine's log-probs (future_drift against=engine), or a self-distillation stage against
    the learner's self-teacher, needs π_old other than the engine's (algorithm.old_policy, resolved by train.mode)."""
    if cfg.old_policy() != "engine":
        return
    for i, s in enumerate(cfg.algorithm.pipeline()):
        if "rollout_logp" in s.inputs:
            raise ConfigError(f"algorithm.stages[{i}]", f"{s.name} against=engine takes the log-ratio π_old/μ, and "
                              "with algorithm.old_policy=engine π_old is μ (always 0); use against=reference or "
                              "old_policy=learner")
        # the self-teacher is the learner's forward: its gap to μ would hold numerics (credit compares two of its own)
        if {"self_teacher_logp", "old_logp"} <= set(s.inputs):
            raise ConfigError(f"algorithm.stages[{i}]", f"{s.name} compares the learner's self-teacher log-probs with "
                              "π_old's, and with algorithm.old_policy=engine π_old is the engine's μ (the gap would "
                              "hold the engine-learner mismatch); set algorithm.old_policy=learner")


def _check_contrast(cfg: RunConfig) -> None:
    """credit's baseline averages over `contrast` other prompts of the step's batch: at most data.prompts_per_step − 1
    of them exist."""
    for i, s in enumerate(cfg.algorithm.pipeline()):
        k = getattr(s.options, "contrast", None) if "contrast_teacher_logp" in s.inputs else None
        if k is not None and k > cfg.data.prompts_per_step - 1:
            raise ConfigError(f"algorithm.stages[{i}].contrast", f"{s.name} contrasts each response with {k} other "
                              f"prompts of the batch, which holds data.prompts_per_step={cfg.data.prompts_per_step} "
                              f"(at most {cfg.data.prompts_per_step - 1} others)")


def _check_hdpo(cfg: RunConfig) -> None:
    """Stage hdpo trains its privileged rollouts behind the original prompt with π_old the learner's recomputed
    there (megapo/trainer/privileged.py): not with π_old the engine's (its log-probs are of the hinted prompt), nor
    with a critic's GAE advantages in place of the estimator's (the stage replaces the privileged samples')."""
    where = [i for i, s in enumerate(cfg.algorithm.pipeline()) if s.name == "hdpo"]
    if not where:
        return
    if cfg.old_policy() == "engine":
        raise ConfigError(f"algorithm.stages[{where[0]}]", "hdpo's privileged responses were drawn behind the "
                          "prompt with the reference answer, so the engine's log-probs are not π_old behind the "
                          "original prompt; set algorithm.old_policy=learner")
    if cfg.algorithm.advantage == "gae":
        raise ConfigError("algorithm.advantage", "gae's critic values the privileged responses of hdpo "
                          f"(algorithm.stages[{where[0]}]) as the policy's own; use a group estimator (grpo, ...)")


def _check_soup(cfg: RunConfig) -> None:
    """Stage soup's refusals (megapo/trainer/soup.py: mix, room for a prefix, sync, single-turn, stage order)."""
    from megapo.trainer.soup import check_soup

    check_soup(cfg)


def _check_anytime(cfg: RunConfig) -> None:
    """Stage anytime's refusals (megapo/trainer/anytime.py: its trigger, budgets, sync rollouts, estimator)."""
    from megapo.trainer.anytime_config import check_anytime

    check_anytime(cfg)


def _check_dast_simpo(cfg: RunConfig) -> None:
    """Stage dast_simpo's refusals (megapo/algorithms/dast_preference.py: the dast length reward, the aggregation)."""
    from megapo.algorithms.dast_preference import check_run_config

    check_run_config(cfg)


def _check_old_policy(cfg: RunConfig) -> None:
    """With π_old the engine's (algorithm.old_policy, resolved by train.mode) no correction may re-weight π_old/μ."""
    if cfg.old_policy() != "engine":
        return
    if cfg.train.async_correction not in ("auto", "none"):
        raise ConfigError("train.async_correction", "with algorithm.old_policy=engine the objective's clipped "
                          "ratio π_θ/μ already corrects for stale samples; use auto or none, or set "
                          "algorithm.old_policy=learner")
    if cfg.algorithm.mismatch != "none":
        raise ConfigError("algorithm.mismatch", "with algorithm.old_policy=engine the objective's ratio is "
                          "taken against the engine's log-probs, so π_old/μ is 1; use none, or set "
                          "algorithm.old_policy=learner")


def _check_reference(cfg: RunConfig) -> None:
    """algorithm.reference: a known one (the names live with the learner, which megapo.algorithms may not
    import), used by a term, and fit for the layout and routing replay."""
    from megapo.learner.reference import REFERENCES

    a = cfg.algorithm
    if a.reference not in REFERENCES:
        raise ConfigError("algorithm.reference", f"must be one of {', '.join(REFERENCES)}, got {a.reference!r}")
    if a.reference == "auto":
        return
    if not a.needs_reference():
        raise ConfigError("algorithm.reference", f"set to {a.reference}, but no term uses a reference "
                          "(algorithm.kl_coef is 0); leave it auto")
    if a.reference == "plain" and cfg.parallel.world_size > 1:
        raise ConfigError("algorithm.reference", "plain holds the whole model on rank 0, and this learner is "
                          f"split over tp*pp*dp = {cfg.parallel.world_size} processes; use megatron (or auto)")
    if a.reference == "plain" and a.routing_replay != ReplayMode.OFF:
        raise ConfigError("algorithm.reference", "plain routes freely, so it cannot replay the routes "
                          f"algorithm.routing_replay={a.routing_replay.value} trains the policy under; use megatron "
                          "(or auto)")


def _check_rollout(cfg: RunConfig) -> None:
    """The group size the advantage needs, partial rollouts only in async runs, HAPO's adaptive temperature only in
    sync ones, r3 only from an engine that returns routes."""
    from megapo.engines.registry import capabilities

    r, a = cfg.rollout, cfg.algorithm
    if r.n_samples < min_group(a.advantage):
        raise ConfigError("rollout.n_samples", f"advantage {a.advantage!r} compares samples within a group; it "
                          f"needs n_samples >= {min_group(a.advantage)}, got {r.n_samples}")
    if r.partial and cfg.train.mode != "async":
        raise ConfigError("rollout.partial", "partial rollouts continue generations across weight updates, which "
                          "happen during generation only with train.mode=async")
    if r.adaptive_temperature > 0 and cfg.train.mode != "sync":
        raise ConfigError("rollout.adaptive_temperature", "the temperature follows the last train batch's entropy "
                          "statistics, which an async producer generating ahead does not have yet; use "
                          "train.mode=sync")
    if a.routing_replay == ReplayMode.R3:
        ok, why = capabilities(r.engine).returns_routes()
        if not ok:
            raise ConfigError("algorithm.routing_replay", f"r3 replays the engine's routes, but {why}; use r2")


def _check_batches(cfg: RunConfig) -> None:
    """A mini-batch holds whole groups; a micro-batch holds one whole sequence."""
    t, d = cfg.train, cfg.data
    if d.prompts_per_step % t.mini_batches:
        raise ConfigError("train.mini_batches", f"must divide data.prompts_per_step={d.prompts_per_step} "
                          "(a mini-batch holds whole groups)")
    seq_len = d.max_prompt_tokens + cfg.response_tokens()
    if t.micro_batch_tokens < seq_len:
        raise ConfigError("train.micro_batch_tokens", f"{t.micro_batch_tokens} cannot hold one sequence of up to "
                          f"max_prompt_tokens + the response budget = {seq_len} tokens")


def _check_reward_components(cfg: RunConfig) -> None:
    """A stage reading reward_components (gdpo, mrtpo) needs data.task with several named rewards (Task.components,
    megapo.tasks.components): one reward has nothing to decouple or reassign."""
    where = [i for i, s in enumerate(cfg.algorithm.pipeline()) if "reward_components" in s.inputs]
    if not where:
        return
    from megapo.tasks.registry import get_task

    name = cfg.algorithm.pipeline()[where[0]].name
    verifier = get_task(cfg.data.task, cfg.data.task_options).components if cfg.data.task else None
    count = len(verifier.names) if verifier is not None else 1
    if count < 2:
        raise ConfigError("data.task", f"stage {name} (algorithm.stages[{where[0]}]) reads reward_components, and "
                          f"{'task ' + repr(cfg.data.task) if cfg.data.task else 'data.train_files'} gives one reward; "
                          "use a task whose verifier has several named rewards (Task.components, e.g. addition_parts)")


def _check_data(cfg: RunConfig) -> None:
    """The prompts against the layout and the group size, the length methods on one group, the held-out split."""
    d, r = cfg.data, cfg.rollout
    if d.prompts_per_step % cfg.parallel.dp:
        raise ConfigError("data.prompts_per_step", f"{d.prompts_per_step} is not divisible by parallel.dp={cfg.parallel.dp}")
    if d.dynamic_sampling and r.n_samples < 2:
        raise ConfigError("data.dynamic_sampling", "drops groups whose samples agree; needs rollout.n_samples >= 2")
    if d.overlong.enabled and not 0 < d.overlong.buffer < r.max_new_tokens:
        raise ConfigError("data.overlong.buffer", f"must be in (0, rollout.max_new_tokens={r.max_new_tokens}), "
                          f"got {d.overlong.buffer}")
    _check_prompt_order(cfg)
    check_length_methods(d, r.n_samples, r.max_new_tokens)
    _check_group_filter(cfg)
    from megapo.algorithms.duet import check_duet_config

    check_duet_config(cfg)  # duet's budget, sync rollouts, single-turn (megapo/algorithms/duet.py)
    _check_dense_rewards(cfg)
    if d.task:
        from megapo.tasks.registry import get_task

        test_size = get_task(d.task, d.task_options).size("test")
        if cfg.train.eval_prompts > test_size:
            raise ConfigError("train.eval_prompts", f"the {d.task} test split has {test_size} problems, "
                              f"got {cfg.train.eval_prompts}")


def _check_prompt_order(cfg: RunConfig) -> None:
    """SPO's prioritised sampling and the semantic-entropy curriculum order the prompts from what the trainer
    measured (the value tracker, the answers): one at a time, and in sync mode, where a draw follows the previous
    step's update (async rollouts draw ahead of it: the order would depend on timing)."""
    a = cfg.algorithm
    prioritized = a.advantage == "spo" and bool(a.advantage_options.get("prioritized_sampling"))
    if prioritized and cfg.data.curriculum != "none":
        raise ConfigError("data.curriculum", "algorithm.advantage_options.prioritized_sampling orders the prompts "
                          "already; set one of the two")
    if cfg.train.mode == "async":
        if prioritized:
            raise ConfigError("algorithm.advantage_options.prioritized_sampling", "draws from the value tracker as "
                              "the last update left it; needs train.mode=sync")
        if cfg.data.curriculum != "none":
            raise ConfigError("data.curriculum", "orders each epoch from the rollouts measured before it; needs "
                              "train.mode=sync")


def _check_group_filter(cfg: RunConfig) -> None:
    """A group filter may keep groups of different sizes: refused where the stages need [P, n]."""
    from megapo.algorithms.registry import get

    from megapo.algorithms.pipeline import entry

    d, a = cfg.data, cfg.algorithm
    if d.group_filter == "none":
        return
    if getattr(get("group_filter", d.group_filter).fn, "keeps_whole_groups", False):
        _check_whole_group_filter(cfg)
        return
    if get("advantage", a.advantage).granularity != "group":
        raise ConfigError("data.group_filter", "a group filter may keep groups of different sizes; it needs a "
                          f"group-level advantage (not {a.advantage!r})")
    for i, s in enumerate(a.pipeline()):
        if entry(s.name).granularity == "group":  # it reads the [P, n] rows of equal groups
            raise ConfigError("data.group_filter", "a group filter may keep groups of different sizes; the stage "
                              f"{s.name} (algorithm.stages[{i}]) needs groups of rollout.n_samples each")


def _check_whole_group_filter(cfg: RunConfig) -> None:
    """A filter that keeps whole groups or drops them (decs_curriculum) keeps groups of rollout.n_samples each; it
    does the dynamic sampling itself (DAPO's would drop the all-correct groups it puts back), and the answer it
    reads is cut where stage decs cuts its own."""
    from megapo.algorithms.registry import get

    d = cfg.data
    if d.dynamic_sampling:
        raise ConfigError("data.dynamic_sampling", f"data.group_filter {d.group_filter} does the dynamic sampling "
                          "itself and puts all-correct groups back, which dynamic sampling would drop: set false")
    delimiter = getattr(get("group_filter", d.group_filter).make_options(dict(d.group_filter_options)),
                        "step_delimiter", None)
    for s in cfg.algorithm.pipeline():
        mine = getattr(s.options, "step_delimiter", None)
        if "first_correct" in s.inputs and None not in (mine, delimiter) and mine != delimiter:
            raise ConfigError("data.group_filter_options.step_delimiter", f"{d.group_filter} cuts steps at "
                              f"{delimiter!r}, stage {s.name} at {mine!r}: the same answer must be read by both")


def _check_dense_rewards(cfg: RunConfig) -> None:
    """Dense rewards (data.reward_model.dense) make the advantage per token: refused where the objective reads one
    advantage per trajectory (haepo: its Plackett-Luce weight times the trajectory's likelihood ratio, which would
    average the process credit away)."""
    from megapo.algorithms.plackett_luce import STAGE

    if cfg.data.reward_model.dense_mode() == "off":
        return
    if cfg.algorithm.objective == "haepo":
        raise ConfigError("data.reward_model.dense", f"objective haepo reads one advantage per trajectory (stage "
                          f"{STAGE}'s weights); dense rewards give one per token: set data.reward_model.dense=off "
                          "or another algorithm.objective")


def _check_sft(cfg: RunConfig) -> None:
    if not cfg.sft.enabled:
        return
    if not cfg.data.task:
        raise ConfigError("sft.enabled", "the warm start trains on a task's demonstrations; set data.task")
    if cfg.rollout.has_servers():  # the servers loaded model.path, not the warm-started copy the learner starts from
        raise ConfigError("sft.enabled", "rollout.servers serve model.path; run the warm start first and point "
                          "model.path at its output (or leave rollout.servers empty)")


def _check_env(cfg: RunConfig) -> None:
    """env.*: the environment builds with its options; what multi-turn rollouts do not support yet."""
    if cfg.env_factory() is None:
        return
    a, d = cfg.algorithm, cfg.data
    token_stages = [f"algorithm.stages[{i}]" for i, s in enumerate(a.pipeline()) if s.kind == "token"]
    per_token = token_stages + [name for name, on in (("data.length_reward", d.length_reward != "none"),
                                                      ("data.group_filter", d.group_filter != "none"),
                                                      ("data.reward_model.dense", d.reward_model.dense_mode() != "off"),
                                                      ("data.overlong.enabled", d.overlong.enabled),
                                                      # the cut would read the environment's tokens as the policy's
                                                      ("data.likelihood_reward.coef", d.likelihood_reward.enabled))
                                if on]
    if per_token:  # their statistics would count the environment's tokens as the policy's
        raise ConfigError(per_token[0], "is not supported with multi-turn rollouts (an environment: env.name="
                          f"{cfg.env.name}) yet")
    cfg.env.validate()


def _check_model(cfg: RunConfig) -> None:
    """The model (megapo.models.config) against the data's chat template, the layout, the engine, the reference,
    the teacher and routing replay; then its safetensors' headers against its config.json."""
    from megapo.layout import check_layout

    m = cfg.model
    hf, where, spec = m.validate()
    if m.exists() and cfg.data.chat_template and not has_chat_template(m.path):
        raise ConfigError("data.chat_template", f"the tokenizer in {m.path} has no chat template")
    _check_torch_model(cfg, hf, where)
    check_layout(cfg.parallel, hf)
    _check_second_models(cfg, hf)
    _check_servable(cfg, hf)
    _check_moe(cfg, hf, spec)
    _check_attention_entropy(cfg, spec)
    if m.exists():  # the safetensors hold exactly the tensors config.json describes
        from megapo.convert.inputs import check_hf_tensors
        from megapo.models.family import family_for

        check_hf_tensors(Path(m.path), family_for(hf), spec, "model.path")  # headers only: names, shapes, truncation


def _check_torch_model(cfg: RunConfig, hf: dict, where: str) -> None:
    """The embedded engine and the plain KL reference run megapo's in-process PyTorch model, which knows
    fewer families than the learner (no llama): refuse here, not after the learner is built."""
    from megapo.engines.registry import capabilities

    plain_ref = cfg.algorithm.needs_reference() and cfg.reference(hf) == "plain"
    users = {"rollout.engine": capabilities(cfg.rollout.engine).in_process, "algorithm.reference": plain_ref}
    field_name = next((name for name, uses in users.items() if uses), None)
    why = plain_model_error(hf) if field_name is not None else None
    if why is not None:
        user = "the embedded engine" if field_name == "rollout.engine" else "the plain KL reference"
        raise ConfigError(field_name, f"{user} runs megapo's PyTorch model, which cannot run {where}: {why}")


def _check_second_models(cfg: RunConfig, hf: dict) -> None:
    """The teachers (algorithm.distill), the critic and the reward model (data.reward_model): each section's own rules
    (folder, tokenizer, mode), then that each teacher and the reward model fit the learner's layout."""
    a = cfg.algorithm
    a.distill.validate(cfg.model.path)
    a.critic.validate(a.advantage, cfg.model.path)
    cfg.data.reward_model.validate(hf)
    for teacher, field_name in zip(a.distill.all_teachers(), a.distill.path_fields()):  # each its own model
        _check_fits_layout(cfg, teacher.path, field_name, "the teacher")
    if cfg.data.reward_model.path:  # a url's scorer runs elsewhere
        _check_fits_layout(cfg, cfg.data.reward_model.path, "data.reward_model.path", "the reward model")


def _check_fits_layout(cfg: RunConfig, model_dir: str, field_name: str, role: str) -> None:
    """A second model under the learner's layout: check_layout on its config.json, the error naming `field_name`."""
    from megapo.layout import check_layout, read_hf_config

    try:
        check_layout(cfg.parallel, read_hf_config(model_dir))
    except ConfigError as err:
        raise ConfigError(field_name, f"{role} does not fit the learner's layout: {err}") from None


def _check_servable(cfg: RunConfig, hf: dict) -> None:
    """A server megapo starts itself (no rollout.servers) can serve this model on this machine."""
    from megapo.engines.registry import capabilities

    if capabilities(cfg.rollout.engine).starts_server and not cfg.rollout.has_servers():
        from megapo.engines.server import check_servable_here

        try:
            check_servable_here(hf)
        except ValueError as err:
            raise ConfigError("rollout.engine", str(err)) from None


def _check_attention_entropy(cfg: RunConfig, spec) -> None:
    """A stage that reads the attention entropies (old_attention_entropy) names a layer of this model whose attention
    the recording path can read here (megapo/learner/attention_entropy.py: no TE fused attention, MLA, sinks or
    sliding window)."""
    from megapo.learner.attention_entropy import attention_kind_error, layer_error
    from megapo.learner.backend import detect_backend

    for i, s in enumerate(cfg.algorithm.pipeline()):
        if "old_attention_entropy" not in s.inputs:
            continue
        bad_layer = layer_error(spec, s.options.layer)
        if bad_layer is not None:
            raise ConfigError(f"algorithm.stages[{i}].layer", f"{s.name}: {bad_layer}")
        why = attention_kind_error(spec, s.options.layer, detect_backend().use_te)
        if why is not None:
            raise ConfigError(f"algorithm.stages[{i}]", f"{s.name} reads the attention entropies, which cannot be "
                              f"read here: {why}")


def _check_moe(cfg: RunConfig, hf: dict, spec) -> None:
    """Router noise and routing replay need experts; the routes' shape must be one the replay can hold."""
    from megapo.layout import num_experts

    if cfg.rollout.router_noise > 0 and not num_experts(hf):
        raise ConfigError("rollout.router_noise", "router noise perturbs the experts' routers; this model is "
                          "dense (no experts)")
    if cfg.algorithm.routing_replay == ReplayMode.OFF:
        return
    if not num_experts(hf):
        raise ConfigError("algorithm.routing_replay", "routing replay needs an MoE model; this one is dense")
    from megapo.replay.routes import RouteShape

    try:
        RouteShape.from_spec(spec)
    except ValueError as err:
        raise ConfigError("algorithm.routing_replay", str(err)) from None


def _check_sources(cfg: RunConfig) -> None:
    """The data files' rows, whether a prompt fits (megapo.trainer.data.check_sources), and one call of the reward
    on the first training example."""
    from megapo.tasks.registry import reward_spec
    from megapo.trainer import data, rewards

    first = data.check_sources(cfg)
    rewards.check_reward(reward_spec(cfg.data), first, cfg.data.reward_timeout_s, "data.reward")

"""The `algorithm` section of the run config (AlgorithmConfig, its `distill` block) and the rules inside it.

Names come from megapo.algorithms' registry (objectives, advantages, corrections, aggregations, KL estimators,
stages); each rule raises ConfigError naming the dotted field. Rules that read other sections (the loss's
correction for async runs, the reference against the layout, routing replay against the model and the engine)
are RunConfig's (megapo/trainer/config.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from megapo.config import ConfigError, bounded, check_fields

# Which log-probs the objective's ratio π_θ/π_old takes as π_old (AlgorithmConfig.old_policy).
OLD_POLICIES = ("auto", "learner", "engine")
DISTILL_MODES = ("reverse_kl", "topk_forward_kl")
# the files a teacher shares with its student (check_same_tokenizer)
TEACHER_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json")


class ReplayMode(str, Enum):
    """algorithm.routing_replay (megapo/replay/modes.py runs them): off | r2 (the learner's own routes from the
    old-log-prob pass) | r3 (the engine's routes)."""

    OFF = "off"
    R2 = "r2"
    R3 = "r3"


def registry_names(kind: str) -> list[str]:
    """The registered names of `kind` a config field may name ("entropy" is a bonus, not a KL estimator)."""
    from megapo.algorithms.registry import entries

    names = [e.name for e in entries(kind)]
    return [n for n in names if n != "entropy"] if kind == "kl" else names


def check_options(kind: str, name: str, options: dict, field_name: str) -> None:
    """The registry entry `name` of `kind` accepts `options`; ConfigError naming `field_name` if not. Then the
    options' own config-time rule, where its dataclass has one (`config_check()`: what a run's config must give
    although the function itself is defined without it, e.g. sspo's sentence_end_ids); its ValueError
    "OPTION: why" names `field_name`.OPTION."""
    from megapo.algorithms.registry import get

    entry = get(kind, name)
    try:
        built = entry.make_options(dict(options))
    except (ValueError, TypeError) as exc:
        raise ConfigError(field_name, str(exc).removeprefix("options: ")) from None
    rule = getattr(built, "config_check", None)
    if rule is None:
        return
    try:
        rule()
    except ValueError as exc:
        option, _, why = str(exc).partition(": ")
        if option in entry.option_names() and why:
            raise ConfigError(f"{field_name}.{option}", why) from None
        raise ConfigError(field_name, str(exc)) from None


def min_group(estimator: str) -> int:
    """The fewest samples per prompt advantage `estimator` is defined for (its registry entry says; GAE over a
    critic's values needs no group)."""
    from megapo.algorithms.registry import get

    return 1 if estimator == GAE else get("advantage", estimator).min_group


GAE = "gae"  # algorithm.advantage: per-token GAE over algorithm.critic's values (megapo/trainer/critic_step.py)
CRITIC_POLICY = "policy"  # algorithm.critic.path: the policy's own starting weights, a zero value head


@dataclass
class CriticConfig:
    """algorithm.critic: PPO's value model (megapo/learner/critic.py), trained each step on GAE returns
    (megapo/trainer/critic_step.py); with it algorithm.advantage is gae."""

    # HF folder of the value model: a *ForSequenceClassification (its score head) or a causal LM of a registered
    # family (value head from zeros); `policy`: the policy's own starting weights; empty: no critic
    path: str = ""
    lr: float = bounded(1e-5, "> 0")  # the critic's learning rate, from step 1 (other settings: optim's)
    warmup_steps: int = bounded(0, ">= 0")  # first RL steps that train only the critic (the policy waits)
    value_clip: float = bounded(0.2, ">= 0", "0: unclipped")  # ε of PPO's clipped value loss
    gamma: float = bounded(1.0, "[0, 1]")  # discount γ of the returns
    lam_policy: float = bounded(0.95, "[0, 1]")  # GAE λ of the policy's advantages
    lam_critic: float = bounded(1.0, "[0, 1]")  # GAE λ of the critic's targets (VAPO's decoupled λ; 1: Monte-Carlo)
    # VAPO's length-adaptive λ_policy = 1 - 1 / (α · response length), replacing lam_policy
    adaptive_alpha: float = bounded(0.0, ">= 0", "0: off")

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def validate(self, advantage: str, policy_dir: str, prefix: str = "algorithm.critic") -> None:
        """gae and a critic go together; the folder exists, of a registered family with the policy's vocabulary."""
        if advantage == GAE and not self.enabled:
            raise ConfigError("algorithm.advantage", f"gae needs a critic's values: set {prefix}.path (an HF folder, "
                                                     f"or {CRITIC_POLICY} for the policy's own weights)")
        if self.enabled and advantage != GAE:
            raise ConfigError(f"{prefix}.path", f"a critic gives GAE advantages: set algorithm.advantage=gae (got "
                                                f"{advantage!r})")
        if not self.enabled or self.path == CRITIC_POLICY:
            return
        folder = Path(self.path)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{prefix}.path", f"{folder} is not an HF model folder (no config.json)")
        from megapo.layout import read_hf_config
        from megapo.models.family import family_for

        try:
            family_for(read_hf_config(folder))
        except ValueError as exc:
            raise ConfigError(f"{prefix}.path", str(exc)) from None
        policy = Path(policy_dir)
        if (policy / "config.json").is_file():
            vocab = [json.loads((d / "config.json").read_text()).get("vocab_size") for d in (folder, policy)]
            if vocab[0] != vocab[1]:
                raise ConfigError(f"{prefix}.path", f"the critic's vocab_size is {vocab[0]}, the policy's {vocab[1]}: "
                                                    "it reads the policy's token ids")


@dataclass
class TeacherConfig:
    """algorithm.distill.teachers[j]: one teacher and the weight of its reverse KL."""

    path: str = ""  # HF folder of the teacher (any registered family, the student's tokenizer)
    coef: float = bounded(1.0, ">= 0")  # β_j: weight of this teacher's per-token reverse KL in the advantage


@dataclass
class DistillConfig:
    """algorithm.distill: on-policy distillation from one or several teachers (megapo/trainer/distill.py)."""

    # one teacher: HF folder (any registered family, the student's tokenizer), weighed by coef; the same as
    # teachers: [{path: teacher, coef: coef}]. Empty (and no teachers): off
    teacher: str = ""
    coef: float = bounded(1.0, ">= 0")  # β of `teacher`: weight of its per-token reverse KL in the advantage
    # several teachers, each with its weight: A_t - Σ_j β_j (log π_old - log π_Tj), [{path: DIR, coef: β_j}, ...];
    # instead of teacher/coef, not with them (each entry carries its own coef)
    teachers: list[TeacherConfig] = field(default_factory=list)
    # reverse_kl: A_t - β (log π_old - log π_T) on the student's samples, per teacher (an advantage term);
    # topk_forward_kl: the loss term β Σ_t Σ_{v ∈ top-k of π_T} p_T(v) (log p_T(v) - log π_θ(v)) per teacher, p_T not
    # renormalised over the k ids (megapo/algorithms/topk_distill.py)
    mode: str = "reverse_kl"
    k: int = bounded(32, ">= 1")  # topk_forward_kl: the teacher's top-k token ids per position (issue 31: verl's 32)

    @property
    def enabled(self) -> bool:
        return bool(self.all_teachers())

    def all_teachers(self) -> list[TeacherConfig]:
        """Every teacher in order: `teachers`, or the single `teacher` with `coef` as one entry."""
        if self.teachers:
            return list(self.teachers)
        return [TeacherConfig(self.teacher, self.coef)] if self.teacher else []

    def path_fields(self, prefix: str = "algorithm.distill") -> list[str]:
        """The dotted field that names each teacher's folder, in all_teachers() order (for errors)."""
        if self.teachers:
            return [f"{prefix}.teachers[{j}].path" for j in range(len(self.teachers))]
        return [f"{prefix}.teacher"] if self.teacher else []

    def validate(self, student_dir: str, prefix: str = "algorithm.distill") -> None:
        """The mode, one way of naming the teachers, and each teacher's folder (a config.json megapo reads, the
        student's tokenizer: vocabulary size and tokenizer files); ConfigError naming the field."""
        if self.mode not in DISTILL_MODES:
            raise ConfigError(f"{prefix}.mode", f"must be one of {', '.join(DISTILL_MODES)}, got {self.mode!r}")
        self._check_one_form(prefix)
        self._check_k(student_dir, prefix)
        for j, t in enumerate(self.teachers):  # (the loader checked these; a config built in Python is held to it)
            check_fields(t, f"{prefix}.teachers[{j}]")
        for t, name in zip(self.all_teachers(), self.path_fields(prefix)):
            check_teacher_folder(t.path, student_dir, name)

    def topk_coefs(self) -> tuple[float, ...]:
        """β_j of every teacher when the mode is topk_forward_kl (LossSpec.distill_topk: a loss term), else ()."""
        return tuple(t.coef for t in self.all_teachers()) if self.mode == "topk_forward_kl" else ()

    def _check_k(self, student_dir: str, prefix: str) -> None:
        """k in [1, the student's vocab_size] (its config.json when it exists), and set only for topk_forward_kl."""
        if self.mode != "topk_forward_kl":
            if self.k != type(self).k:
                raise ConfigError(f"{prefix}.k", f"is the top-k of mode topk_forward_kl; mode is {self.mode!r}")
            return
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ConfigError(f"{prefix}.k", f"must be an integer >= 1, got {self.k!r}")
        config = Path(student_dir) / "config.json"
        vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
        if vocab is not None and self.k > vocab:
            raise ConfigError(f"{prefix}.k", f"must be <= the vocabulary size {vocab}, got {self.k}")

    def _check_one_form(self, prefix: str) -> None:
        """teacher/coef or teachers, not both: a coef beside teachers would weigh nothing."""
        if not self.teachers:
            return
        if self.teacher:
            raise ConfigError(f"{prefix}.teachers", f"give the teachers either as {prefix}.teacher (one, weighed by "
                                                    f"coef) or as {prefix}.teachers, not both")
        if self.coef != type(self).coef:
            raise ConfigError(f"{prefix}.coef", f"weighs {prefix}.teacher only; with {prefix}.teachers each entry "
                                                "carries its own coef")


def check_teacher_folder(path: str, student_dir: str, field_name: str) -> None:
    """A teacher folder: an HF model folder of a registered family with the student's tokenizer."""
    teacher = Path(path)
    if not path:
        raise ConfigError(field_name, "must name the teacher's HF folder")
    if not (teacher / "config.json").is_file():
        raise ConfigError(field_name, f"{teacher} is not an HF model folder (no config.json)")
    from megapo.layout import read_hf_config
    from megapo.models.family import family_for

    try:
        family_for(read_hf_config(teacher))
    except ValueError as exc:
        raise ConfigError(field_name, str(exc)) from None
    student = Path(student_dir)
    if (student / "config.json").is_file():  # (a tiny student written at start-up is checked when it exists)
        check_same_tokenizer(teacher, student, field_name)


def check_same_tokenizer(teacher: Path, student: Path, field: str) -> None:
    """The teacher scores the student's token ids: the same vocabulary size and the same tokenizer files."""
    vocab = [json.loads((d / "config.json").read_text()).get("vocab_size") for d in (teacher, student)]
    if vocab[0] != vocab[1]:
        raise ConfigError(field, f"the teacher's vocab_size is {vocab[0]}, the student's {vocab[1]}: their token ids "
                                 "differ (a teacher needs the student's tokenizer)")
    for name in TEACHER_TOKENIZER_FILES:
        mine, theirs = teacher / name, student / name
        if mine.is_file() != theirs.is_file() or (mine.is_file() and _content(mine) != _content(theirs)):
            raise ConfigError(field, f"{name} differs between the teacher ({teacher}) and the student ({student}): a "
                                     "teacher needs the student's tokenizer")


# what tokenizer.save_pretrained records about where it was loaded from: a teacher trained from the student's
# folder (megapo sft) gains these, with the same token ids
LOAD_TIME_KEYS = ("is_local", "local_files_only", "name_or_path", "_commit_hash")


def _content(path: Path) -> str:
    """A tokenizer file's digest; tokenizer_config.json's without LOAD_TIME_KEYS, keys sorted."""
    data = path.read_bytes()
    if path.name == "tokenizer_config.json":
        config = {k: v for k, v in json.loads(data).items() if k not in LOAD_TIME_KEYS}
        data = json.dumps(config, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


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
    # YAML 1.1 reads a bare `off` as false, which means off too.
    routing_replay: ReplayMode = ReplayMode.OFF
    # the stages between the estimator and the loss, in the order they run (megapo/algorithms/pipeline.py,
    # `megapo objectives --stages`): [{name: <stage>, <its options>}, ...]; sequence stages (per group, on the
    # estimator's advantages: polarity, d3s_select, cumulative_std, clamp_correct) before token stages (on the train
    # batch after the old-log-prob pass: gtpo, grpo_s, advantage_reweighting, future_drift, future_kl, token_select,
    # stapo, nat_prefix, ...; self-distillation: opid, caspo, intro, credit, srpo, hdpo; entropy credit: erpo,
    # aepo; haepo's plackett_luce). The loop computes only the inputs some stage reads (π_old's entropy, π_ref, the self-teacher's
    # log-probs, ...).
    stages: list[dict[str, Any]] = field(default_factory=list)
    # on-policy distillation: frozen teachers' weighted per-token reverse KLs enter the advantage
    # (megapo/trainer/distill.py)
    distill: DistillConfig = field(default_factory=DistillConfig)
    # PPO's critic: a trained value model whose GAE advantages replace the estimator's (advantage: gae)
    critic: CriticConfig = field(default_factory=CriticConfig)
    # the stage fields before algorithm.stages (issue 32): each names the entry that replaces it
    MOVED: ClassVar[dict[str, str]] = {
        "advantage_polarity": "algorithm.stages: [{name: polarity, polarity: positive | negative, ...}]",
        "pos_scale": "algorithm.stages: [{name: polarity, pos_scale: ...}]",
        "neg_scale": "algorithm.stages: [{name: polarity, neg_scale: ...}]",
        "sample_select": "algorithm.stages: [{name: d3s_select, keep: ...}]",
        "advantage_smoothing": "algorithm.stages: [{name: cumulative_std}] (cumulative), first in the list",
        "clamp_correct_adv": "algorithm.stages: [{name: clamp_correct}]",
        "token_advantage": "algorithm.stages: [{name: gtpo | grpo_s | advantage_reweighting | future_drift, ...}]",
        "token_advantage_options": "the options in the stage's entry: algorithm.stages: [{name: gtpo, alpha1: ...}]",
        "kl_mode": "algorithm.stages: [{name: future_kl}] (future; β = algorithm.kl_coef)",
        "token_select": "algorithm.stages: [{name: token_select, rho: ...}]",
        "token_mask": "algorithm.stages: [{name: stapo | nat_prefix, ...}]",
        "token_mask_options": "the options in the stage's entry: algorithm.stages: [{name: stapo, prob_max: ...}]",
    }

    def __post_init__(self) -> None:
        # the loader hands the YAML value over as is: false (a bare `off`) and the mode names become the enum; any
        # other value stays for validate() to refuse, naming the field
        if self.routing_replay is False:
            self.routing_replay = ReplayMode.OFF
        elif isinstance(self.routing_replay, str) and self.routing_replay in {m.value for m in ReplayMode}:
            self.routing_replay = ReplayMode(self.routing_replay)

    def pipeline(self) -> list:
        """algorithm.stages parsed (pipeline.Stage, in order); ConfigError naming the entry that is wrong."""
        from megapo.algorithms.pipeline import parse_stages

        return parse_stages(self.stages)

    def stage_inputs(self) -> set[str]:
        """What the stages read (pipeline.INPUTS): the loop computes these for them."""
        from megapo.algorithms.pipeline import inputs_of

        return inputs_of(self.pipeline())

    def has_stage(self, name: str) -> bool:
        return any(s.name == name for s in self.pipeline())

    def needs_reference(self) -> bool:
        """Whether a term uses π_ref's log-probs (sample.ref_logp): a KL term (in the loss, or stage future_kl), a
        stage reading them (future_drift against=reference), or an objective that reads them (its options'
        reference_inputs: dgpo)."""
        return (self.kl_coef > 0 or "ref_logp" in self.stage_inputs()
                or "ref_logp" in self.objective_reference_inputs())

    def objective_reference_inputs(self) -> tuple[str, ...]:
        """The other policies' per-token log-probs algorithm.objective reads (its options class declares them)."""
        from megapo.algorithms.registry import entries

        entry = next((e for e in entries("objective") if e.name == self.objective), None)
        return tuple(getattr(entry.options, "reference_inputs", ())) if entry is not None else ()

    def self_teacher(self):
        """What the self-teacher pass computes for the self-distillation stages (self_distill.TeacherSpec: context,
        template, entropy, contrast), None when no stage reads its inputs (then it is not run)."""
        from megapo.algorithms.self_distill import teacher_spec

        return teacher_spec(self.pipeline())

    def needs_old_stats(self) -> bool:
        """Whether π_old's per-token statistics are needed before the loss (the separate old-log-prob pass): a
        stage reads them, or the teacher's reverse KL does (topk_forward_kl is a loss term: it does not)."""
        reverse_kl = self.distill.enabled and self.distill.mode == "reverse_kl"
        return bool(self.stage_inputs() & {"old_logp", "old_entropy"}) or reverse_kl

    def needs_old_entropy(self) -> bool:
        """Whether the old-log-prob pass keeps π_old's per-token entropy: for a stage, or for the objective's
        loss (sample.old_entropy; a fused on-policy step takes it from its own forward instead)."""
        from megapo.algorithms.loss import token_inputs

        objective = token_inputs(self.objective, self.objective_options)
        return "old_entropy" in self.stage_inputs() or bool({"old_entropy", "entropy_score"} & set(objective))

    def computed_inputs(self) -> set[str]:
        """The stage inputs this section's run computes (pipeline.INPUTS): all of them, but no per-sample advantage
        under gae (the critic's GAE advantages are per token)."""
        from megapo.algorithms.pipeline import INPUTS

        return set(INPUTS) - ({"sequence_advantage"} if self.advantage == GAE else set())

    # --- the rules inside the section ------------------------------------------------------------

    def validate(self) -> None:
        """The names and options of this section; the first violated rule raises ConfigError naming its field."""
        self._check_names()
        check_options("objective", self.objective, self.objective_options, "algorithm.objective_options")
        if self.advantage == GAE:  # its options are algorithm.critic's
            if self.advantage_options:
                raise ConfigError("algorithm.advantage_options", "gae takes its options from algorithm.critic")
        else:
            check_options("advantage", self.advantage, self.advantage_options, "algorithm.advantage_options")
        self._check_stages()
        if self.mismatch == "none" and self.mismatch_options:
            raise ConfigError("algorithm.mismatch_options", "given but algorithm.mismatch is 'none'")
        if self.old_policy not in OLD_POLICIES:
            raise ConfigError("algorithm.old_policy", f"must be one of {', '.join(OLD_POLICIES)}, "
                              f"got {self.old_policy!r}")
        if not isinstance(self.routing_replay, ReplayMode):
            raise ConfigError("algorithm.routing_replay", f"must be off, r2 or r3, got {self.routing_replay!r}")

    def _check_names(self) -> None:
        """objective, advantage, loss_agg, kl_estimator and mismatch name registered entries."""
        for kind, name, field_name in (("objective", self.objective, "algorithm.objective"),
                                       ("advantage", self.advantage, "algorithm.advantage"),
                                       ("aggregation", self.loss_agg, "algorithm.loss_agg"),
                                       ("kl", self.kl_estimator, "algorithm.kl_estimator")):
            known = registry_names(kind) + (["auto"] if kind == "aggregation" else [GAE] if kind == "advantage"
                                            else [])
            if name not in known:
                raise ConfigError(field_name, f"unknown {kind} {name!r}; known: {', '.join(known)}")
        if self.mismatch != "none" and self.mismatch not in registry_names("correction"):
            raise ConfigError("algorithm.mismatch", f"unknown correction {self.mismatch!r}; known: none, "
                              f"{', '.join(registry_names('correction'))}")

    def _check_stages(self) -> None:
        """algorithm.stages: known names, options, order, inputs this run computes; future_kl's β and
        cumulative_std's estimator."""
        from megapo.algorithms.pipeline import check_inputs

        stages = self.pipeline()
        check_inputs(stages, self.computed_inputs())
        for i, s in enumerate(stages):
            if s.name == "future_kl" and not self.kl_coef > 0:
                raise ConfigError("algorithm.kl_coef", f"stage future_kl (algorithm.stages[{i}]) takes its β from "
                                  "kl_coef: must be > 0")
            if s.name == "cumulative_std" and self.advantage != "grpo":
                raise ConfigError(f"algorithm.stages[{i}]", "cumulative_std replaces grpo's per-group "
                                  f"standardisation; algorithm.advantage is {self.advantage!r} (set grpo)")
        _check_self_teacher_contexts(stages)
        _check_haepo(self, stages)
        _check_nat_cut(self, stages)


def _check_haepo(a: "AlgorithmConfig", stages: list) -> None:
    """HAEPO's two pieces come together (megapo/algorithms/plackett_luce.py): objective haepo reads the stage
    plackett_luce's per-trajectory weights, which no other objective reads as advantages; its entropy regularisation
    is algorithm.entropy_coef."""
    from megapo.algorithms.plackett_luce import STAGE

    where = [i for i, s in enumerate(stages) if s.name == STAGE]
    if a.objective == "haepo" and not where:
        raise ConfigError("algorithm.stages", f"objective haepo reads the Plackett-Luce trajectory weights of stage "
                          f"{STAGE}: add {{name: {STAGE}}}")
    if where and a.objective != "haepo":
        raise ConfigError(f"algorithm.stages[{where[0]}]", f"{STAGE} gives HAEPO's trajectory weights, which only "
                          f"objective haepo reads; algorithm.objective is {a.objective!r}")
    if a.objective == "haepo" and not a.entropy_coef > 0:
        raise ConfigError("algorithm.entropy_coef", "haepo's entropy regularisation: must be > 0")


def _check_nat_cut(a: "AlgorithmConfig", stages: list) -> None:
    """nat_prefix's cut drops the tokens after it only where the loss at the kept ones stays exact
    (megapo/algorithms/nat_cut.py)."""
    from megapo.algorithms.nat_cut import cut_refusal

    for i, s in enumerate(stages):
        why = cut_refusal(a.objective, a.loss_agg, a.objective_options) if s.name == "nat_prefix" and s.options.cut \
            else None
        if why:
            raise ConfigError(f"algorithm.stages[{i}].cut", why)


def _check_self_teacher_contexts(stages: list) -> None:
    """The self-distillation stages share one context (one self-teacher pass serves them): ConfigError naming
    algorithm.stages[i].<option> of the first that differs."""
    from megapo.algorithms.self_distill import check_contexts

    try:
        check_contexts(stages)
    except ValueError as exc:
        index, option, why = str(exc).split(": ", 2)
        raise ConfigError(f"algorithm.stages[{index}].{option}", why) from None

"""Self-distillation stages: the policy is its own teacher under a changed context.

On-policy distillation from a teacher (megapo/trainer/distill.py) scores the student's tokens with another model.
Here the teacher is the same policy π_old with a context c in its prompt (the task's reference answer, or the
group's best response): the self-teacher input

    log π_old(y_t | x ⊕ c, y_<t)        (self_teacher_logp; megapo/trainer/self_teacher.py computes it)

is one more learner forward of every sampled response behind the re-encoded prompt x ⊕ c, taken only when a
stage here is listed in algorithm.stages. Its difference from π_old's own log-prob log π_old(y_t | x, y_<t)
(sample.old_logp) says how much knowing c makes the sampled token likelier. Five stages use it:

    opid    A_t ← A_t + β·(log π(y_t|x⊕c) − log π_old(y_t|x))        token self-distillation advantage
    caspo   opid's formula, c = the group's best response by default (the model's own reasoning as reference)
    intro   w_t ∝ min(π(y_t|x⊕c)/π_old(y_t|x), w_max), mean 1 per response   token importance weights
    credit  A_t ← A_t + β·(log π(y_t|x_i⊕c_i) − mean_k log π(y_t|x_k⊕c_i))   batch-contrastive token reward
    srpo    correct: A_t kept; failed: A_t = β·w_t·(log π(y_t|x⊕c) − log π_old(y_t|x)), w_t = exp(−H_T,t/τ)

HDPO (hdpo) is the sixth, with its own samples instead of the self-teacher pass: for a prompt whose samples all failed
(a "cliff" prompt) the engine draws responses behind x ⊕ c (c = the reference answer; megapo/trainer/privileged.py),
keeps the correct ones and trains them behind x:

    hdpo    privileged sample: A_t = λ (the NLL of the privileged response under x, weight λ); others: A_t kept

Each works on one sample's response-token tensors (float64); the stage functions below are the formulas,
`self_distill_advantages` at the end runs one over a train batch. credit's baseline reads other prompts of the train
batch: the trainer computes it once on the whole batch, before any mini-, micro-batch or DP split.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from megapo.algorithms.options import check_choice, check_number
from megapo.algorithms.registry import get, register
from megapo.algorithms.token_tensors import per_token_advantages, per_token_values

CONTEXTS = ("reference_answer", "best_sample")
# assumption (ours): the hint goes before the prompt, so a raw-text prompt still ends where the response begins
# (a completion model continues "123+456=" with the answer), and with a chat template both sit in the user turn
DEFAULT_TEMPLATE = "Hint: a correct answer is {hint}\n{prompt}"
# the self-teacher inputs (pipeline.INPUTS): what megapo/trainer/self_teacher.py computes when a stage reads one
TEACHER_INPUTS = ("self_teacher_logp", "self_teacher_entropy", "contrast_teacher_logp")


def _check_template(template) -> None:
    """A str.format template holding {prompt} and {hint} and no other field."""
    if not isinstance(template, str):
        raise ValueError(f"template: must be a string with {{prompt}} and {{hint}}, got {template!r}")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(f"template: not a format string ({exc}): {template!r}") from None
    if fields != {"prompt", "hint"}:
        raise ValueError(f"template: must hold {{prompt}} and {{hint}} and no other field, got fields "
                         f"{sorted(fields)} in {template!r}")


@dataclass
class SelfTeacherOptions:
    """The context every self-distillation stage gives its self-teacher: context=reference_answer puts the task's
    reference answer (Example.answer) in `template`'s {hint}, best_sample the group's highest-reward response
    (decoded; the first of a tie; that response itself is then scored with its own text in the prompt).
    assumption: the template, "Hint: a correct answer is {hint}" on a line before the prompt by default, is ours;
    the papers' contexts (environment feedback, hindsight skills, a reference solution) are task-specific."""

    context: str = "reference_answer"
    template: str = DEFAULT_TEMPLATE
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_choice("context", self.context, CONTEXTS)
        _check_template(self.template)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("self_teacher_logp",)


def _check_beta(beta) -> None:
    check_number("beta", beta, low=0)


@dataclass
class OpidOptions(SelfTeacherOptions):
    beta: float = 0.1  # weight of the self-distillation advantage (default ours)

    def __post_init__(self):
        super().__post_init__()
        _check_beta(self.beta)


@dataclass
class CaspoOptions(OpidOptions):
    """opid's options with CASPO's reference by default: the group's best response (the model's own reasoning)."""

    context: str = "best_sample"


@dataclass
class HdpoOptions:
    """HDPO's privileged rollouts (megapo/trainer/privileged.py draws them, rank 0) and their weight. The context is
    always the reference answer (HDPO's ground truth) in `template`'s {hint}. The stage sets the privileged samples'
    advantage where it stands in algorithm.stages: token stages listed before it do not reach them, ones after it
    act on λ."""

    lam: float = 0.1  # λ: the privileged responses' advantage, the distillation term's weight (default ours)
    max_privileged: int = 4  # responses drawn behind x ⊕ c per cliff prompt; the correct ones are kept (ours)
    template: str = DEFAULT_TEMPLATE
    option_field: ClassVar[bool] = True  # its refusals name algorithm.stages[i].<option> (pipeline._parse_one)

    def __post_init__(self):
        check_number("lam", self.lam, above=0)
        check_number("max_privileged", self.max_privileged, low=1, integer=True)
        _check_template(self.template)


@dataclass
class IntroOptions(SelfTeacherOptions):
    max_weight: float = 5.0  # the importance ratio's cap before renormalising (truncated importance weight; ours)
    normalize: str = "sequence"  # sequence: the weights' mean over a response is 1; none: the capped ratio

    def __post_init__(self):
        super().__post_init__()
        check_number("max_weight", self.max_weight, above=0)
        check_choice("normalize", self.normalize, ("sequence", "none"))


@dataclass
class CreditOptions(SelfTeacherOptions):
    beta: float = 0.1  # weight of the contrastive token reward (default ours)
    contrast: int = 1  # K: other prompts of the batch the baseline averages over (K more forwards of the batch)

    def __post_init__(self):
        super().__post_init__()
        _check_beta(self.beta)
        check_number("contrast", self.contrast, low=1, integer=True)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("self_teacher_logp", "contrast_teacher_logp")


@dataclass
class SrpoOptions(SelfTeacherOptions):
    beta: float = 1.0  # weight of the distillation advantage on failed samples (1: the plain reverse-KL gradient)
    entropy_temperature: float | None = 1.0  # τ of w_t = exp(−H_T,t/τ); null: no entropy weighting (w_t = 1)

    def __post_init__(self):
        super().__post_init__()
        _check_beta(self.beta)
        if self.entropy_temperature is not None:
            check_number("entropy_temperature", self.entropy_temperature, above=0)

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return ("self_teacher_logp",) + (("self_teacher_entropy",) if self.entropy_temperature is not None else ())


# ----------------------------------------------------------------------------- the formulas, one response each


@register(
    "opid", "advantage_stage", "token",
    "OPID: On-Policy Skill Distillation (old-policy rescoring under a skill-augmented context); here the context"
    " is the reference answer or the group's best response, not skills extracted from trajectories",
    OpidOptions,
)
def opid(adv: Tensor, student: Tensor, teacher: Tensor, o: OpidOptions) -> Tensor:
    """A'_t = A_t + β·(log π_old(y_t | x ⊕ c, y_<t) − log π_old(y_t | x, y_<t)): the old policy re-scores its own
    sampled response with the context c injected (the self-teacher input) and the log-probability shift is a
    token-level self-distillation advantage added to the outcome advantage A_t (a sequence advantage repeated
    per token, or an earlier token stage's). assumption: c is the task's reference answer (context=
    reference_answer) or the group's highest-reward response (best_sample) in `template`, where OPID injects
    hindsight skills (episode- or step-level) distilled from completed trajectories; the shift is not clipped."""
    return adv + o.beta * (teacher - student)


@register(
    "caspo", "advantage_stage", "token",
    "CASPO: Consequence-Aware Safety Policy Optimization (OOD-MMSafe: Advancing MLLM Safety from Harmful Intent to "
    "Hidden Consequences): token-level self-distillation rewards with the model's intrinsic reasoning as a dynamic "
    "reference",
    CaspoOptions,
)
def caspo(adv: Tensor, student: Tensor, teacher: Tensor, o: CaspoOptions) -> Tensor:
    """A'_t = A_t + β·(log π_old(y_t | x ⊕ r, y_<t) − log π_old(y_t | x, y_<t)), r = the group's highest-reward
    response (context=best_sample, the default): the token-level self-distillation reward of a reference that is
    the current policy itself reading its own best reasoning, so the reference moves with the policy (dynamic)
    where a KL reference is frozen. The same formula and code path as opid; it differs in the default context (opid:
    the reference answer) and in its paper. assumption: the abstract gives no formula; the reward is opid's
    sampled-token log-ratio added to the outcome advantage with weight β (default 0.1, ours), and "the model's
    intrinsic reasoning" is the group's best sampled response (the paper's safety reasoning about consequences is
    task-specific; context=reference_answer or a template carry other references). arXiv 2603.09706."""
    return opid(adv, student, teacher, o)


@register(
    "hdpo", "advantage_stage", "sequence",
    "HDPO: Hybrid Distillation Policy Optimization via Privileged Self-Distillation (privileged rollouts with the "
    "ground truth in context on all-fail 'cliff' prompts, the correct ones distilled into the same model, weight λ)",
    HdpoOptions,
)
def hdpo(adv: Tensor, privileged: bool, o: HdpoOptions) -> Tensor:
    """privileged sample: A'_t = λ on every token; any other sample: A'_t = A_t. A privileged sample is a correct
    response y drawn by the engine behind x ⊕ c (c = the reference answer in `template`) for a prompt x all of
    whose samples failed, trained behind x itself with π_old(y_t | x, y_<t) recomputed by the learner. With the
    ratio π_θ/π_old = 1 at the first update the objective's gradient on its tokens is −λ·∇log π_θ(y_t | x, y_<t):
    λ times the gradient of L_distill = Σ_t KL(π(·|x ⊕ c, y_<t) ‖ π_θ(·|x, y_<t)) estimated at the token the
    privileged teacher sampled (y_t ~ π(·|x ⊕ c, y_<t), so E[log π(y_t|x⊕c) − log π_θ(y_t|x)] is that KL and its
    θ-gradient is the NLL's). L = L_RL + λ·L_distill with the privileged tokens in the objective's normaliser.
    assumption: HDPO distils the privileged teacher's full token distribution; here its sampled-token estimate (the
    NLL of the kept responses), inside the run's clipped objective (the clip bounds later updates on them);
    λ = 0.1 and max_privileged = 4 are ours. arXiv 2603.23871."""
    return torch.full_like(adv, o.lam) if privileged else adv


@register(
    "intro", "token_weight", "sequence",
    "InTRO: In-Token Rationality Optimization (token-wise importance weights from the information discrepancy "
    "between the policy and its answer-conditioned counterpart)",
    IntroOptions,
)
def intro(student: Tensor, teacher: Tensor, o: IntroOptions) -> Tensor:
    """w_t = L·ŵ_t/Σ_s ŵ_s (normalize=sequence; ŵ_t with normalize=none), ŵ_t = min(exp(log π_old(y_t | x ⊕ c, y_<t)
    − log π_old(y_t | x, y_<t)), max_weight): the importance ratio of the answer-conditioned policy (c = the
    reference answer) to the generative one at each sampled token, a correction factor that up-weights tokens the
    answer makes likelier; L the response's tokens. The weight is detached and multiplies the objective's
    per-token loss (token_weight), advantages unchanged. assumption: the abstract names the weights' source, not
    their form: the plain ratio, truncated at max_weight (default 5, ours) and renormalised to mean 1 per
    response so a sequence's total weight is unchanged; applied to the outcome objective's loss instead of
    InTRO's own rationale-likelihood objective, on every response (a failed one's blame then also goes most to the
    tokens the answer supports; list intro after polarity=positive to weight the correct responses only)."""
    ratio = torch.clamp(torch.exp(teacher - student), max=o.max_weight)
    if o.normalize == "none" or ratio.numel() == 0:
        return ratio
    return ratio * (ratio.numel() / ratio.sum())


@register(
    "credit", "advantage_stage", "batch",
    "CREDIT: Contrastive REward from DIsTillation (self-distillation token reward with a batch-contrastive "
    "baseline isolating the input-specific component)",
    CreditOptions,
)
def credit(adv: Tensor, teacher: Tensor, contrast: Tensor, o: CreditOptions) -> Tensor:
    """A'_t = A_t + β·r_t, r_t = log π_old(y_t | x_i ⊕ c_i, y_<t) − (1/K)·Σ_{k=1..K} log π_old(y_t | x_{j_k} ⊕ c_i,
    y_<t): the self-teacher's log-probability decomposed along the input axis, its input-generic part (how likely the
    response stays with the same context c_i under an unrelated prompt x_j of the batch) taken out, so a response
    that only copies the hint earns nothing; Σ_t r_t is a teacher-side surrogate for the contrastive pointwise
    mutual information. j_k = the prompt of group (g + k) mod P, g sample i's group, P the train batch's groups,
    K = min(contrast, P − 1) (0: r = 0) — K more forwards of the batch, on the whole train batch once (before any
    mini-, micro-batch or DP split). assumption: the contrast keeps the sample's own context c_i and swaps the
    prompt (the abstract's decomposition along the input axis); the reward is added to the outcome advantage A_t
    with weight β (default 0.1, ours)."""
    return adv + o.beta * (teacher - contrast)


@register(
    "srpo", "advantage_stage", "token",
    "SRPO: Sample-Routed Policy Optimization (correct samples to GRPO, failed samples to SDPO's self-distillation, "
    "entropy-aware weighting of the distillation targets)",
    SrpoOptions,
)
def srpo(adv: Tensor, student: Tensor, teacher: Tensor, teacher_entropy: Tensor | None, correct: bool,
         o: SrpoOptions) -> Tensor:
    """correct sample: A'_t = A_t (the estimator's reward-aligned advantage); failed sample: A'_t = β·w_t·(log
    π_old(y_t | x ⊕ c, y_<t) − log π_old(y_t | x, y_<t)), the per-token reverse-KL advantage toward the
    feedback-conditioned self-teacher (c = the reference answer), w_t = exp(−H_T,t/τ) with H_T,t the self-teacher's
    entropy at the token (1 with entropy_temperature null), so uncertain targets are suppressed and confident ones
    kept. Correct = the verifier's verdict (reward >= data.correct_threshold). assumption: SDPO's logit-level
    (full-vocabulary) correction is taken at the sampled token, as on-policy distillation's reverse-KL estimate;
    the entropy weight's form exp(−H/τ), τ = 1 by default, is ours (the abstract does not give it)."""
    if correct:
        return adv
    weight = torch.ones_like(teacher) if teacher_entropy is None else torch.exp(-teacher_entropy /
                                                                                o.entropy_temperature)
    return o.beta * weight * (teacher - student)


STAGES = ("opid", "caspo", "intro", "credit", "srpo", "hdpo")
KIND = {"opid": "advantage_stage", "caspo": "advantage_stage", "intro": "token_weight", "credit": "advantage_stage",
        "srpo": "advantage_stage", "hdpo": "advantage_stage"}


# ----------------------------------------------------------------------------- one stage over a train batch


@dataclass(frozen=True)
class TeacherInputs:
    """The self-teacher's values per sample, one per response token (megapo/trainer/self_teacher.py); entropy and
    contrast None where no stage reads them."""

    logp: list
    entropy: list | None = None
    contrast: list | None = None
    contrast_inputs: int = 0  # K actually used by the contrast (min(contrast, groups − 1))


def self_distill_advantages(name: str, *, lengths: list[int], advantages: list, teacher: TeacherInputs | None,
                            old_logp: list | None = None, correct: list | None = None, privileged: list | None = None,
                            **options) -> list[Tensor]:
    """Stage `name` (STAGES) on a train batch of responses of `lengths` tokens: `advantages` per sample (a number, or
    one per response token), the self-teacher's values `teacher` (all but hdpo), π_old's `old_logp` per response
    token (opid, caspo, intro, srpo), the verifier's `correct` per sample (srpo), whether each sample is a privileged
    rollout `privileged` (hdpo). Returns per-token advantages (opid, caspo, credit, srpo, hdpo) or weights (intro),
    one float64 tensor per sample."""
    if name not in STAGES:
        raise ValueError(f"stage: unknown self-distillation stage {name!r}; choose from {', '.join(STAGES)}")
    entry = get(KIND[name], name, argument="stage")
    o = entry.make_options(options)
    lengths = [int(n) for n in lengths]
    if name == "hdpo":
        return hdpo_advantages(per_token_advantages(advantages, lengths), privileged, o)
    logp = per_token_values("self_teacher_logp", teacher.logp, lengths)
    adv = per_token_advantages(advantages, lengths)
    if name == "credit":
        if teacher.contrast_inputs == 0:  # a batch of one prompt: no other input to contrast with
            return adv
        contrast = per_token_values("contrast_teacher_logp", teacher.contrast, lengths)
        return [credit(a, t, c, o) for a, t, c in zip(adv, logp, contrast)]
    student = per_token_values("old_logp", old_logp, lengths)
    if name == "intro":
        return [intro(s, t, o) for s, t in zip(student, logp)]
    if name in ("opid", "caspo"):
        fn = opid if name == "opid" else caspo
        return [fn(a, s, t, o) for a, s, t in zip(adv, student, logp)]
    if correct is None or len(correct) != len(lengths):
        raise ValueError(f"correct: srpo needs the verifier's verdict of each of the {len(lengths)} samples")
    entropy = (per_token_values("self_teacher_entropy", teacher.entropy, lengths) if o.entropy_temperature is not None
               else [None] * len(lengths))
    return [srpo(a, s, t, h, bool(c), o) for a, s, t, h, c in zip(adv, student, logp, entropy, correct)]


def hdpo_advantages(adv: list[Tensor], privileged: list | None, o: HdpoOptions) -> list[Tensor]:
    """hdpo on each sample's per-token advantages; `privileged` one flag per sample."""
    if privileged is None or len(privileged) != len(adv):
        raise ValueError(f"privileged: hdpo needs a privileged-rollout flag for each of the {len(adv)} samples")
    return [hdpo(a, bool(p), o) for a, p in zip(adv, privileged)]


# ----------------------------------------------------------------------------- what the trainer computes


@dataclass(frozen=True)
class TeacherSpec:
    """What the self-teacher pass computes for the listed stages: one context (context, template) for all of
    them, the entropy when a stage reads it, `contrast` other prompts per sample (0: none)."""

    context: str
    template: str
    entropy: bool
    contrast: int


def teacher_spec(stages: list) -> TeacherSpec | None:
    """The self-teacher pass the stages (pipeline.Stage, in order) ask for; None when none reads its inputs. The
    first such stage's context and template (check_contexts has refused stages that disagree)."""
    readers = [s for s in stages if set(s.inputs) & set(TEACHER_INPUTS)]
    if not readers:
        return None
    first = readers[0].options
    inputs = {name for s in readers for name in s.inputs}
    contrast = max((s.options.contrast for s in readers if "contrast_teacher_logp" in s.inputs), default=0)
    return TeacherSpec(first.context, first.template, "self_teacher_entropy" in inputs, contrast)


def check_contexts(stages: list) -> None:
    """The stages that read the self-teacher share one context and template (one extra forward serves them all);
    ValueError 'index: option: why' for the first that does not (AlgorithmConfig names the field)."""
    readers = [(i, s) for i, s in enumerate(stages) if set(s.inputs) & set(TEACHER_INPUTS)]
    for i, s in readers[1:]:
        j, first = readers[0]
        for option in ("context", "template"):
            mine, theirs = getattr(s.options, option), getattr(first.options, option)
            if mine != theirs:
                raise ValueError(f"{i}: {option}: {s.name} gives {mine!r} but {first.name} (algorithm.stages[{j}]) "
                                 f"{theirs!r}; the self-teacher pass computes one context for every stage")


def hint_text(template: str, prompt: str, hint: str) -> str:
    """The prompt with its context: `template` filled (str.format: braces in the prompt or hint stay as they are)."""
    return template.format(prompt=prompt, hint=hint)


"""algorithm.stages: the declared pipeline of stages between the advantage estimator and the loss.

    algorithm:
      stages:
        - {name: polarity, polarity: negative, neg_scale: 0.5}   # sequence: per group, after the estimator
        - {name: gtpo}                                           # token: after the old-log-prob pass
        - {name: token_select, rho: 0.2}

A stage runs where its kind says: a `sequence` stage on the estimator's one advantage per sample, group by group
(or on all groups' [P, n] rows at once), a `token` stage on the whole train batch after the old-log-prob pass
(so its batch-global statistics do not depend on mini-, micro-batches or DP ranks). The list runs in its order,
the sequence stages first. Each stage is declared once, in STAGES: its kind, its registry entry (paper, options
dataclass and formula, megapo/algorithms/stages.py) and the INPUTS it reads beyond the advantages; the loop
computes an input only when a stage, the objective or the KL term asks for it (AlgorithmConfig.needs_*).

A token stage's runner, `run(batch, stage, ctx)`, returns `(advantages, metrics)`: advantages None where it leaves
sample.advantage alone, else per sample of the batch, in order, a 1-D floating tensor with one value per response
token (megapo's are float64). run_token_stages is the one writer of sample.advantage: it checks the count and
every length (a ValueError naming the stage) and sets `values.tolist()`. Other fields a runner changes (token_weight
through _multiply_weights, kl_weight, soup's old_logp) it still sets itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from megapo.algorithms import attention_entropy
from megapo.algorithms import a3po
from megapo.algorithms import anytime
from megapo.algorithms import blockwise
from megapo.algorithms import dast_preference
from megapo.algorithms import discriminative
from megapo.algorithms import distribution_centric
from megapo.algorithms import entropy_credit
from megapo.algorithms import hidden_reward
from megapo.algorithms import information
from megapo.algorithms import lopti
from megapo.algorithms import multi_reward
from megapo.algorithms import plackett_luce
from megapo.algorithms import otb
from megapo.algorithms import self_distill
from megapo.algorithms import semantic_entropy
from megapo.algorithms import soup
from megapo.algorithms import stages as st
from megapo.algorithms import token_credit
from megapo.algorithms import token_length
from megapo.algorithms.length import clamp_correct_advantages
from megapo.algorithms.registry import Entry, get
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError

KINDS = ("sequence", "token")
# what a stage may read, and who computes it (megapo/trainer/update.py)
INPUTS = {
    "sequence_advantage": "the estimator's one advantage per sample, which gae does not give (its critic's are "
                          "per token)",
    "old_logp": "π_old's per-token log-probs (the separate old-log-prob pass)",
    "old_entropy": "π_old's per-token entropy (the old-log-prob pass keeps it)",
    "ref_logp": "π_ref's per-token log-probs (the reference, algorithm.reference)",
    "rollout_logp": "the engine's per-token log-probs μ",
    "correct": "the verifier's verdicts (reward >= data.correct_threshold)",
    "prompt_stats": "each prompt's running reward statistics (kept in the checkpoint)",
    "step": "the trainer step",
    "seed": "train.seed",
    "response_tokens": "the response token ids (sample.tokens after prompt_len; always at hand)",
    # the self-distillation stages' (megapo/algorithms/self_distill.py), from one more learner forward of the batch
    # behind prompts with a context (megapo/trainer/self_teacher.py)
    "self_teacher_logp": "π_old's log-probs of each response token with a context (a hint) in the prompt",
    "self_teacher_entropy": "the self-teacher's entropy at each response token (the same forward)",
    "contrast_teacher_logp": "the self-teacher's log-probs of each response behind other prompts of the batch with "
                             "the same hint, averaged (credit's baseline: `contrast` more forwards)",
    # hdpo's: which samples are privileged rollouts (megapo/trainer/privileged.py draws them on all-fail prompts)
    "privileged": "whether each sample is a privileged rollout (a correct response drawn with the reference answer "
                  "in its prompt, trained behind the original prompt)",
    # bae's (megapo/algorithms/blockwise.py): per response its token blocks and the stage's block_reward function's
    # per-block rewards (blockwise.block_inputs; the trainer's update.block_rewards)
    # OTB's (megapo/algorithms/otb.py)
    "old_sum_p2": "Σ_v π_old(v)² at each response token (one more learner forward, Learner.response_sum_p2: with "
                  "old_logp, OTB's Logit-Gradient Proxy)",
    "reward": "each sample's reward, the one the estimator reads (OTB's return at every token)",
    # DelTA's (megapo/algorithms/discriminative.py)
    "old_hidden": "the LM head's input (the final hidden state) at each response token under π_old (one more learner "
                  "forward, Learner.response_hidden: DelTA's token-gradient proxy (1 − π_old(y))·h)",
    # THR's (megapo/algorithms/hidden_reward.py), with old_hidden: both from one forward where a stage reads both
    # (Learner.response_hidden_logp_at)
    # the attention-entropy reweighting's (megapo/algorithms/attention_entropy.py)
    "old_attention_entropy": "the entropy of one layer's head-averaged attention at each response token under π_old "
                             "(one more learner forward, Learner.response_attention_entropy)",
    "old_vocab_logp": "π_old's log-probs of every token id that occurs in the batch's responses, at each response "
                      "token (one more learner forward, Learner.response_logp_at: THR's prediction errors e_y − π_old)",
    "block_rewards": "each response token's block (cut at the stage's delimiters) and each response's block rewards",
    # Distribution-Centric Policy Optimization's (megapo/algorithms/distribution_centric.py)
    "old_tempered_logp": "log softmax(z_old/T) at each response token, T the stage's target temperature from the "
                         "batch's entropy (one more learner forward, Learner.response_tempered_logp)",
    # DECS's (megapo/algorithms/token_length.py): post_answer's a_i, from the task's checker on each step's prefix
    "first_correct": "per correct response, the token count through the first step whose prefix the task's answer "
                     "checker scores >= data.correct_threshold (-1: none, or an incorrect response)",
    # IAPO's (megapo/algorithms/information.py)
    "answer_information": "log π_old(a* | x, y_≤t) − log π_old(a* | x, y_<t) at each response token, a* the reference "
                          "answer (one more learner forward of every prefix followed by a*)",
    # SPAE's (megapo/algorithms/information.py)
    "answer_steps": "π_old's log-probs and next-token entropies of a*'s tokens after the prompt and after each step, "
                    "a* the reference answer (one more learner forward of each step's prefix followed by a*)",
    # GDPO's and MRTPO's (megapo/algorithms/multi_reward.py; megapo/trainer/multi_reward.py computes them)
    "reward_components": "each sample's reward components and their verifier information, from the task's verifier "
                         "(Task.components: a task with several named rewards)",
    "old_js_distance": "per reward component, the Jensen-Shannon distance between π_old's next-token distributions "
                       "with and without its verifier information in the prompt, at each response token (one more "
                       "learner pass, the response forwarded once beside its variant per component, "
                       "Learner.response_js_distances)",
    # AnytimeReasoner's (megapo/algorithms/anytime.py): from the budget rewards and summaries rank 0 drew
    # (megapo/trainer/anytime.py)
    "anytime": "per sample its per-token advantage: a thinking's BRPO advantage of each budget segment, a summary's "
               "reward less its baseline (from the summaries drawn after each response cut at the step's budgets)",
    # SOUP's (megapo/algorithms/soup.py): which response tokens are a historical policy's prefix
    # (megapo/trainer/soup.py draws the mixed samples)
    "soup_prefix": "per sample, the number of its first response tokens drawn by a historical policy (a stored "
                   "response's prefix; the continuation is on-policy)",
}


@dataclass(frozen=True)
class GroupRows:
    """What a sequence stage reads besides the advantages, for the rows of its [P, n] input: each group's rewards,
    prompt text and verdicts (the loop fills these two only where a stage reads prompt_stats / correct; verdicts
    None where not scored), the trainer step and the running per-prompt statistics."""

    rewards: Tensor
    prompts: list[str]
    correct: Tensor | None
    step: int
    prompt_stats: Any = None


@dataclass(frozen=True)
class TokenContext:
    """What a token stage reads besides the train batch."""

    group_size: int  # samples of a prompt, contiguous in the batch (rollout.n_samples)
    step: int  # the trainer step (schedules; nat_prefix's draw with the seed)
    seed: int  # train.seed
    kl_coef: float  # future_kl's β (algorithm.kl_coef)
    self_teacher: Any = None  # self_distill.TeacherInputs: the self-teacher pass's values (None: no stage reads them)
    correct: list | None = None  # the verifier's verdict per sample (srpo routes on it)
    privileged: list | None = None  # per sample: a privileged rollout of hdpo (megapo/trainer/privileged.py)
    blocks: Any = None  # blockwise.BlockInputs: the input block_rewards (bae)
    sum_p2: list | None = None  # per sample, Σ_v π_old(v)² at each response token (otb)
    hidden: list | None = None  # per sample, the LM head's input [response tokens, hidden] under π_old (delta, thr)
    attention_entropy: list | None = None  # per sample, one layer's attention entropy at each response token
    vocab: list | None = None  # the token ids vocab_logp's columns are (thr)
    vocab_logp: list | None = None  # per sample, [response tokens, len(vocab)] log π_old at those ids (thr)
    rewards: list | None = None  # per sample, its reward (otb's return)
    tempered_logp: list | None = None  # per sample, log π^T_old at each response token (distribution_centric)
    first_correct: list | None = None  # per sample, the answer's end a_i, -1: none (decs)
    answer_information: list | None = None  # per sample, each response token's information about a* (iapo)
    answer_steps: list | None = None  # per sample, an information.AnswerProbe at the prompt and each step (spae)
    components: Any = None  # multi_reward.ComponentRewards: each sample's reward components (gdpo, mrtpo)
    js_distance: list | None = None  # per sample, [components, response tokens] JS distances (mrtpo)
    max_new_tokens: int = 0  # rollout.max_new_tokens, decs's L_max
    anytime: list | None = None  # per sample, stage anytime's per-token advantages (megapo/trainer/anytime.py)
    soup_prefix: list | None = None  # per sample, stage soup's historical prefix length (megapo/trainer/soup.py)
    nat_cut: Any = None  # nat_cut.PrefixCut: the step's one draw of nat_prefix's cuts (None: the stage draws them)


@dataclass(frozen=True)
class StageDecl:
    kind: str  # sequence | token
    registry_kind: str  # its registry entry's kind (advantage_stage | token_weight): paper, options, formula
    inputs: tuple[str, ...]  # read beyond the advantages (INPUTS); an options class adds its `token_inputs`
    # sequence: (adv [P, n], stage, GroupRows) -> adv; token: (batch, stage, TokenContext) -> TokenResult
    run: Callable[..., Any]


@dataclass(frozen=True)
class Stage:
    """One entry of algorithm.stages, its options checked."""

    name: str
    given: dict  # the options as written
    options: Any  # the registry entry's options dataclass built from them (None: a stage without options)
    decl: StageDecl

    @property
    def kind(self) -> str:
        return self.decl.kind

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.decl.inputs + tuple(getattr(self.options, "token_inputs", ()))


# ----------------------------------------------------------------------------- sequence stages: [P, n] -> [P, n]


def _polarity(adv: Tensor, s: Stage, rows: GroupRows) -> Tensor:
    return st.polarity(adv, s.options)


def _d3s_select(adv: Tensor, s: Stage, rows: GroupRows) -> Tensor:
    return st.d3s_select(adv, s.options, rows.step)


def _cumulative_std(adv: Tensor, s: Stage, rows: GroupRows) -> Tensor:
    if rows.prompt_stats is None:
        raise ValueError("prompt_stats: stage cumulative_std needs the running per-prompt statistics")
    return st.cumulative_advantages(rows.rewards, rows.prompts, rows.prompt_stats, **s.given)


def _clamp_correct(adv: Tensor, s: Stage, rows: GroupRows) -> Tensor:
    if rows.correct is None:
        raise ValueError("correct: stage clamp_correct needs the verifier's verdicts (the length stage)")
    return clamp_correct_advantages(adv, rows.correct)


# ----------------------------------------------------------------------------- token stages: on the whole batch

# a token stage's runner returns (per sample its token advantages, or None: sample.advantage left alone; its metrics)
TokenResult = tuple[list[Tensor] | None, dict]


def _multiply_weights(batch: list[TrainSample], weights: list[Tensor]) -> None:
    for sample, w in zip(batch, weights):
        before = sample.token_weight
        sample.token_weight = (w if before is None else w * torch.tensor(before, dtype=w.dtype)).tolist()


def _token_advantage(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    adv = torch.tensor([x.advantage for x in batch], dtype=torch.float64)
    return st.token_advantages(
        s.name, adv, [x.old_logp for x in batch], [x.old_entropy for x in batch], group_size=ctx.group_size,
        rollout_logp=[x.rollout_logp for x in batch], ref_logp=[x.ref_logp for x in batch], **s.given), {}


def _future_kl(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    return st.future_kl_advantages([x.advantage for x in batch], [x.old_logp for x in batch],
                                   [x.ref_logp for x in batch], beta=ctx.kl_coef), {}


def _token_select(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    weights = st.token_select_weights([x.advantage for x in batch], [x.old_entropy for x in batch], step=ctx.step,
                                      **s.given)
    _multiply_weights(batch, weights)
    return None, {"token_select/kept_frac": float(torch.cat(weights).eq(1).double().mean())}


def _token_mask(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    if s.name == "nat_prefix" and ctx.nat_cut is not None:  # the trainer's one draw of the step (nat_cut.draw_cut)
        _multiply_weights(batch, ctx.nat_cut.weights([len(x.tokens) - x.prompt_len for x in batch]))
        return None, {"nat_prefix/kept_frac": ctx.nat_cut.kept_frac()}
    masks = st.token_mask_weights(s.name, lengths=[len(x.tokens) - x.prompt_len for x in batch],
                                  advantages=[x.advantage for x in batch],
                                  old_logp=[x.old_logp for x in batch] if "old_logp" in s.inputs else None,
                                  entropy=[x.old_entropy for x in batch], seed=ctx.seed, step=ctx.step, **s.given)
    _multiply_weights(batch, masks)
    return None, {f"{s.name}/kept_frac": float(torch.cat(masks).gt(0).double().mean())}


def _group_credit(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """A stage on group statistics (token_credit.GROUP_TOKEN_STAGES), group by group: per-token advantages
    (advantage_stage) or weights multiplying sample.token_weight (token_weight)."""
    reads = s.inputs
    values = token_credit.group_token_stage(
        s.name, [x.tokens[x.prompt_len:] for x in batch], group_size=ctx.group_size,
        advantages=[x.advantage for x in batch] if "sequence_advantage" in reads else None,
        old_logp=[x.old_logp for x in batch] if "old_logp" in reads else None,
        entropy=[x.old_entropy for x in batch] if "old_entropy" in reads else None, **s.given)
    if s.decl.registry_kind == "token_weight":
        _multiply_weights(batch, values)
        return None, ({f"{s.name}/weight_mean": float(torch.cat(values).mean())} if values else {})
    return values, {}


def _self_distill(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """A self-distillation stage (megapo/algorithms/self_distill.py) on the whole train batch: per-token advantages,
    or weights multiplying sample.token_weight (intro)."""
    if ctx.self_teacher is None:
        raise ValueError(f"self_teacher_logp: stage {s.name} needs the self-teacher pass "
                         "(megapo/trainer/self_teacher.py)")
    values = self_distill.self_distill_advantages(s.name, lengths=[len(x.tokens) - x.prompt_len for x in batch],
                                advantages=[x.advantage for x in batch], teacher=ctx.self_teacher,
                                old_logp=[x.old_logp for x in batch], correct=ctx.correct, **s.given)
    if s.decl.registry_kind == "token_weight":
        _multiply_weights(batch, values)
        flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
        return None, {f"{s.name}/weight_max": float(flat.max()) if flat.numel() else 0.0}
    before = [torch.as_tensor(x.advantage, dtype=torch.float64).reshape(-1).expand(len(v))
              for x, v in zip(batch, values)]
    shift = torch.cat([v - b for v, b in zip(values, before)]) if values else torch.zeros(0, dtype=torch.float64)
    out = {f"{s.name}/adv_shift": float(shift.abs().mean()) if shift.numel() else 0.0}  # mean |A' − A| per token
    if s.name == "credit":
        out["credit/contrast_inputs"] = float(ctx.self_teacher.contrast_inputs)
    return values, out


def _hdpo(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """HDPO (megapo/algorithms/self_distill.py): the privileged rollouts' advantage λ per token, the others' kept."""
    values = self_distill.self_distill_advantages("hdpo", lengths=[len(x.tokens) - x.prompt_len for x in batch],
                                                  advantages=[x.advantage for x in batch], teacher=None,
                                                  privileged=ctx.privileged, **s.given)
    return values, {"hdpo/privileged_samples": float(sum(bool(p) for p in ctx.privileged))}


def _otb(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """OTB (megapo/algorithms/otb.py): A_{i,t} = R_i − B*_t, the group's energy-weighted per-token baseline in place
    of the estimator's advantage; otb/baseline_mean, the mean baseline over the batch's tokens."""
    if ctx.sum_p2 is None or ctx.rewards is None:
        raise ValueError(f"old_sum_p2: stage {s.name} needs Σ_v π_old(v)² and the rewards (update.advantage_stages)")
    returns = [torch.full((len(x.tokens) - x.prompt_len,), float(r), dtype=torch.float64)
               for x, r in zip(batch, ctx.rewards)]
    values = otb.otb_advantages(returns, [torch.as_tensor(x.old_logp, dtype=torch.float64) for x in batch],
                                [torch.as_tensor(v, dtype=torch.float64) for v in ctx.sum_p2], ctx.group_size,
                                s.options)
    base = torch.cat([g - v for g, v in zip(returns, values)]) if values else torch.zeros(0, dtype=torch.float64)
    return values, {"otb/baseline_mean": float(base.mean()) if base.numel() else 0.0}


def _delta(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """DelTA (megapo/algorithms/discriminative.py): each token's advantage times its discriminative weight."""
    if ctx.hidden is None:
        raise ValueError(f"old_hidden: stage {s.name} needs the LM head's input at the response tokens "
                         "(update.advantage_stages)")
    adv = token_credit.sequence_advantages(s.name, [x.advantage for x in batch])
    weights, metrics = discriminative.delta_weights(
        adv, [torch.as_tensor(x.old_logp, dtype=torch.float64) for x in batch], ctx.hidden,
        [x.loss_mask for x in batch], s.options)
    return [a * w for a, w in zip(adv, weights)], metrics


def _thr(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """THR (megapo/algorithms/hidden_reward.py): each dominant token's advantage scaled by the sign of its hidden
    reward."""
    if ctx.hidden is None or ctx.vocab_logp is None:
        raise ValueError(f"old_vocab_logp: stage {s.name} needs the LM head's input and π_old over the response "
                         "vocabulary (update.advantage_stages)")
    adv = token_credit.sequence_advantages(s.name, [x.advantage for x in batch])
    values, metrics = hidden_reward.thr_advantages(
        [x.tokens[x.prompt_len:] for x in batch], adv, ctx.vocab_logp, ctx.vocab, ctx.hidden, ctx.group_size,
        [x.loss_mask for x in batch], s.options)
    return values, metrics


def _attention_entropy(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """The attention-entropy reweighting (megapo/algorithms/attention_entropy.py): each token's advantage (the
    sample's one, or a previous stage's per-token ones) times its entropy-rank weight at this trainer step."""
    if ctx.attention_entropy is None:
        raise ValueError(f"old_attention_entropy: stage {s.name} needs the attention entropies at the response tokens "
                         "(update.advantage_stages)")
    weights, metrics = attention_entropy.attention_entropy_weights(
        ctx.attention_entropy, [x.prompt_len for x in batch], [x.loss_mask for x in batch], ctx.step, s.options)
    return [torch.as_tensor(x.advantage, dtype=torch.float64) * w for x, w in zip(batch, weights)], metrics


def _low_entropy_kl(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """SENT's low-entropy-token KL (megapo/algorithms/semantic_entropy.py): per-token KL coefficients into
    sample.kl_weight, which the loss multiplies each token's |log π_θ − log π_old| by; low_entropy_kl/coef_mean,
    their mean over the batch's tokens, and low_entropy_kl/frac, the share of tokens with a non-zero one."""
    coef = semantic_entropy.low_entropy_kl_weights(
        [x.old_entropy for x in batch], [x.old_logp for x in batch], [x.advantage for x in batch], s.options,
        masks=[x.loss_mask for x in batch] if all(x.loss_mask is not None for x in batch) else None)
    for sample, c in zip(batch, coef):
        sample.kl_weight = c.tolist()
    flat = torch.cat(coef) if coef else torch.zeros(0, dtype=torch.float64)
    return None, {"low_entropy_kl/coef_mean": float(flat.mean()) if flat.numel() else 0.0,
                  "low_entropy_kl/frac": float(flat.gt(0).double().mean()) if flat.numel() else 0.0}


def _entropy_credit(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """An entropy-credit stage (megapo/algorithms/entropy_credit.py: erpo, aepo) on the whole train batch: per-token
    advantages."""
    reads = s.inputs
    values = entropy_credit.entropy_credit_advantages(
        s.name, advantages=[x.advantage for x in batch], entropy=[x.old_entropy for x in batch],
        group_size=ctx.group_size, correct=ctx.correct if "correct" in reads else None,
        old_logp=[x.old_logp for x in batch] if "old_logp" in reads else None,
        ref_logp=[x.ref_logp for x in batch] if "ref_logp" in reads else None, **s.given)
    before = [torch.as_tensor(x.advantage, dtype=torch.float64).reshape(-1).expand(len(v))
              for x, v in zip(batch, values)]
    shift = torch.cat([v - b for v, b in zip(values, before)]) if values else torch.zeros(0, dtype=torch.float64)
    # mean |A' − A| per token
    return values, {f"{s.name}/adv_shift": float(shift.abs().mean()) if shift.numel() else 0.0}


def _soup(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """SOUP (megapo/algorithms/soup.py): π_old := μ on the mixed samples' historical prefixes (soup.run_soup_stage
    sets sample.old_logp); the advantages left alone."""
    return None, soup.run_soup_stage(batch, s, ctx)


def _lopti(batch: list[TrainSample], s: Stage, ctx: TokenContext) -> TokenResult:
    """Lopti (megapo/algorithms/lopti.py): marks nothing on the samples; the update loop splits each update into its
    low- and high-probability steps from sample.old_logp (megapo.trainer.update.policy_updates). lopti/low_frac, the
    share of the batch's policy tokens with π_old(y_t) < η."""
    masks = lopti.low_prob_masks([x.old_logp for x in batch], s.options.eta)
    loss_masks = [x.loss_mask for x in batch]
    policy = loss_masks if any(m is not None for m in loss_masks) else None
    return None, {"lopti/low_frac": lopti.low_fraction(masks, policy)}


_PER_SAMPLE = ("sequence_advantage", "old_logp")
_GROUP_TOKENS = ("sequence_advantage", "response_tokens")
STAGES: dict[str, StageDecl] = {
    "cumulative_std": StageDecl("sequence", "advantage_stage", ("prompt_stats",), _cumulative_std),
    "d3s_select": StageDecl("sequence", "advantage_stage", ("sequence_advantage", "step"), _d3s_select),
    "polarity": StageDecl("sequence", "advantage_stage", ("sequence_advantage",), _polarity),
    "clamp_correct": StageDecl("sequence", "advantage_stage", ("sequence_advantage", "correct"), _clamp_correct),
    "gtpo": StageDecl("token", "advantage_stage", (*_PER_SAMPLE, "old_entropy"), _token_advantage),
    "grpo_s": StageDecl("token", "advantage_stage", (*_PER_SAMPLE, "old_entropy"), _token_advantage),
    "advantage_reweighting": StageDecl("token", "advantage_stage", _PER_SAMPLE, _token_advantage),
    "future_drift": StageDecl("token", "advantage_stage", _PER_SAMPLE, _token_advantage),  # + ref_logp | rollout_logp
    "fipo": StageDecl("token", "advantage_stage", _PER_SAMPLE, _token_advantage),  # renamed: its options refuse
    "future_kl": StageDecl("token", "advantage_stage", ("old_logp", "ref_logp"), _future_kl),
    "token_select": StageDecl("token", "token_weight", ("old_entropy", "step"), _token_select),
    "stapo": StageDecl("token", "token_weight", ("old_logp", "old_entropy"), _token_mask),
    "nat_prefix": StageDecl("token", "token_weight", ("seed", "step"), _token_mask),
    "nat_uniform": StageDecl("token", "token_weight", ("seed", "step"), _token_mask),
    "tempo": StageDecl("token", "advantage_stage", _GROUP_TOKENS, _group_credit),
    "ktae": StageDecl("token", "advantage_stage", _GROUP_TOKENS, _group_credit),
    "gtpo_trajectory": StageDecl("token", "advantage_stage", _GROUP_TOKENS, _group_credit),  # + old_entropy: filter
    "tw_grpo": StageDecl("token", "token_weight", ("old_logp",), _group_credit),
    # self-distillation; the self-teacher inputs each reads come from its options' token_inputs
    "opid": StageDecl("token", "advantage_stage", ("old_logp",), _self_distill),
    "caspo": StageDecl("token", "advantage_stage", ("old_logp",), _self_distill),  # opid's path, its own reference
    # HDPO: its own samples (privileged rollouts); old_logp: their π_old is the learner's behind the original prompt
    # (the separate old-log-prob pass), which also stands in for their engine log-prob μ (update.privileged_mu)
    "hdpo": StageDecl("token", "advantage_stage", ("old_logp", "privileged"), _hdpo),
    "intro": StageDecl("token", "token_weight", ("old_logp",), _self_distill),
    "credit": StageDecl("token", "advantage_stage", (), _self_distill),
    "srpo": StageDecl("token", "advantage_stage", ("old_logp", "correct"), _self_distill),
    # HAEPO's Plackett-Luce trajectory weights (megapo/algorithms/plackett_luce.py; objective haepo)
    "plackett_luce": StageDecl("token", "advantage_stage", _PER_SAMPLE, plackett_luce.run_stage),
    # entropy credit (megapo/algorithms/entropy_credit.py); aepo's KL term adds old_logp, ref_logp (token_inputs)
    "erpo": StageDecl("token", "advantage_stage", ("sequence_advantage", "old_entropy"), _entropy_credit),
    "aepo": StageDecl("token", "advantage_stage", ("sequence_advantage", "old_entropy", "correct"), _entropy_credit),
    # Blockwise Advantage Estimation (megapo/algorithms/blockwise.py): per-block advantages on their blocks' tokens
    "otb": StageDecl("token", "advantage_stage", ("old_logp", "old_sum_p2", "reward"), _otb),
    "bae": StageDecl("token", "advantage_stage", ("response_tokens", "block_rewards"), blockwise.run_bae_stage),
    # DelTA (megapo/algorithms/discriminative.py): advantages reweighted by the side-wise token-gradient discriminator
    "delta": StageDecl("token", "advantage_stage", ("sequence_advantage", "old_logp", "old_hidden"), _delta),
    # THR (megapo/algorithms/hidden_reward.py): advantages reweighted by the sign of each token's hidden reward
    # attention-entropy reweighting (megapo/algorithms/attention_entropy.py): advantages times entropy-rank weights
    "attention_entropy": StageDecl("token", "advantage_stage", ("old_attention_entropy", "step"),
                                   _attention_entropy),
    "thr": StageDecl("token", "advantage_stage", ("sequence_advantage", "response_tokens", "old_hidden",
                                                  "old_vocab_logp"), _thr),
    # SENT's KL on the low-entropy tokens (megapo/algorithms/semantic_entropy.py): coefficients into sample.kl_weight
    "low_entropy_kl": StageDecl("token", "token_weight", ("old_logp", "old_entropy"), _low_entropy_kl),
    # Distribution-Centric Policy Optimization (megapo/algorithms/distribution_centric.py; not the dynamic-clipping
    # DCPO of ppo's clip_mode dynamic and cumulative_std): a REINFORCE term toward π_old at a target temperature
    "distribution_centric": StageDecl("token", "advantage_stage", ("old_logp", "correct", "old_tempered_logp"),
                                      distribution_centric.run_dc_stage),
    # token-level length control (megapo/algorithms/token_length.py): their advantages replace the estimator's
    "decs": StageDecl("token", "advantage_stage", ("reward", "correct", "first_correct"),
                      token_length.run_decs_stage),
    "bingo": StageDecl("token", "advantage_stage", ("old_logp", "reward", "correct", "step"),
                       token_length.run_bingo_stage),
    # DAST's budget preference optimisation (megapo/algorithms/dast_preference.py): on-policy SimPO pairs from the
    # dast length reward's shaped rewards, their π_old gradient coefficients added to the advantages
    "dast_simpo": StageDecl("token", "advantage_stage", ("old_logp", "reward", "correct"),
                            dast_preference.run_dast_simpo_stage),
    # IAPO (megapo/algorithms/information.py): each token's information about the answer shifts its advantage
    "iapo": StageDecl("token", "advantage_stage", ("answer_information",), information.run_iapo_stage),
    # SPAE (megapo/algorithms/information.py): each step's potential from the answer's likelihood after it
    "spae": StageDecl("token", "advantage_stage", ("answer_steps",), information.run_spae_stage),
    # GDPO (megapo/algorithms/multi_reward.py): each reward component normalised in its group on its own
    "gdpo": StageDecl("token", "advantage_stage", ("reward_components",), multi_reward.run_gdpo_stage),
    # MRTPO: each reward's GDPO advantage over the tokens its verifier information moves (JS distance)
    "mrtpo": StageDecl("token", "advantage_stage", ("reward_components", "old_js_distance"),
                       multi_reward.run_mrtpo_stage),
    # Lopti (megapo/algorithms/lopti.py): each update as two optimizer steps, the low-probability tokens' first
    "lopti": StageDecl("token", "token_weight", ("old_logp",), _lopti),
    # AnytimeReasoner (megapo/algorithms/anytime.py): BRPO on the thinking's budget segments, the summaries' own
    "anytime": StageDecl("token", "advantage_stage", ("anytime",), anytime.run_anytime_stage),
    # SOUP (megapo/algorithms/soup.py): π_old := μ (sample.rollout_logp, always at hand) on the historical prefixes
    # of the mixed samples; with old_policy=engine π_old is μ already and the stage changes nothing
    "soup": StageDecl("token", "token_weight", ("old_logp", "soup_prefix"), _soup),
    # A3PO (megapo/algorithms/a3po.py): a positive response's rare tokens and a negative one's confident tokens scaled
    "a3po": StageDecl("token", "advantage_stage", ("sequence_advantage", "old_logp", "step"), a3po.run_a3po_stage),
}


def entry(name: str) -> Entry:
    """The registry entry of stage `name`: its paper, options and formula."""
    return get(STAGES[name].registry_kind, name)


# ----------------------------------------------------------------------------- the list, checked


def parse_stages(items: list, field: str = "algorithm.stages") -> list[Stage]:
    """The entries of `field` as Stages, in order; ConfigError naming `field[i]` (or `field[i].name`) for an entry
    that is no mapping with a known name and options its stage accepts, and for a sequence stage after a token
    stage."""
    if not isinstance(items, list):
        raise ConfigError(field, f"expected a list of {{name: ..., <options>}}, got {items!r}")
    out = [_parse_one(item, f"{field}[{i}]") for i, item in enumerate(items)]
    _check_order(out, field)
    return out


def _parse_one(item, where: str) -> Stage:
    if not isinstance(item, dict) or "name" not in item:
        raise ConfigError(where, f"expected a mapping {{name: <stage>, <options>}}, got {item!r}")
    name = item["name"]
    if name not in STAGES:
        raise ConfigError(f"{where}.name", f"unknown stage {name!r}; known: {', '.join(STAGES)}")
    given = {k: v for k, v in item.items() if k != "name"}
    try:
        options = entry(name).make_options(dict(given))
    except (ValueError, TypeError) as exc:
        why = str(exc).removeprefix("options: ")
        option, _, rest = why.partition(": ")
        # an options class that says so has its refusals name the option's field (the older stages name the entry)
        if getattr(entry(name).options, "option_field", False) and option in entry(name).option_names() and rest:
            raise ConfigError(f"{where}.{option}", f"{name}: {rest}") from None
        raise ConfigError(where, f"{name}: {why}") from None
    return Stage(name, given, options, STAGES[name])


def _check_order(stages: list[Stage], field: str) -> None:
    """Sequence stages before token stages; cumulative_std, which computes the advantages from the rewards in
    place of the estimator, first."""
    for i, s in enumerate(stages):
        if s.kind == "sequence" and any(t.kind == "token" for t in stages[:i]):
            first = next(j for j, t in enumerate(stages) if t.kind == "token")
            raise ConfigError(f"{field}[{i}]", f"{s.name} is a sequence stage (it runs per group, before the "
                              f"old-log-prob pass) listed after the token stage {stages[first].name} at "
                              f"{field}[{first}]: list the sequence stages first")
        if s.name == "lopti" and any(t.name == "lopti" for t in stages[:i]):
            raise ConfigError(f"{field}[{i}]", "lopti is listed twice: it splits each update once (one eta)")
        if s.name == "cumulative_std" and i > 0:
            raise ConfigError(f"{field}[{i}]", "cumulative_std computes the advantages from the rewards in place of "
                              "the estimator's: it must be the first stage")


def check_inputs(stages: list[Stage], computed: set[str], field: str = "algorithm.stages") -> None:
    """Every input a stage reads is one the run computes; else ConfigError naming the stage's entry."""
    for i, s in enumerate(stages):
        missing = [name for name in s.inputs if name not in computed]
        if missing:
            raise ConfigError(f"{field}[{i}]", f"{s.name} reads {missing[0]} ({INPUTS[missing[0]]}), which this run "
                              "does not compute")


def inputs_of(stages: list[Stage]) -> set[str]:
    """The union of the stages' inputs: what the loop has to compute for them."""
    return {name for s in stages for name in s.inputs}


# ----------------------------------------------------------------------------- running them


def run_sequence_stages(stages: list[Stage], adv: Tensor, rows: GroupRows) -> Tensor:
    """The sequence stages, in order, on [P, n] advantages (a group per row, `rows` describing them)."""
    for s in stages:
        if s.kind == "sequence":
            adv = s.decl.run(adv, s, rows)
    return adv


def run_token_stages(stages: list[Stage], batch: list[TrainSample], ctx: TokenContext) -> dict:
    """The token stages, in order, on the whole train batch: the per-token advantages a runner returns become
    sample.advantage (_set_advantages), a token weight multiplies sample.token_weight. Returns their metrics."""
    metrics: dict[str, float] = {}
    for s in stages:
        if s.kind == "token":
            advantages, out = s.decl.run(batch, s, ctx)
            if advantages is not None:
                _set_advantages(batch, advantages, s.name)
            metrics.update(out)
    return metrics


def _set_advantages(batch: list[TrainSample], advantages: list, stage: str) -> None:
    """sample.advantage := advantages[i].tolist() for every sample, after checking that there is one 1-D floating
    tensor per sample with one value per response token; else ValueError naming the stage and the sample. The
    token stages' one writer of sample.advantage (the runners return theirs)."""
    if len(advantages) != len(batch):
        raise ValueError(f"advantage: stage {stage} returned {len(advantages)} per-sample advantages for a batch of "
                         f"{len(batch)} samples")
    for i, (sample, values) in enumerate(zip(batch, advantages)):
        if not (isinstance(values, Tensor) and values.dim() == 1 and values.is_floating_point()):
            raise ValueError(f"advantage: stage {stage} returned {type(values).__name__} "
                             f"{getattr(values, 'shape', '')} for sample {i}; expected a 1-D floating tensor")
        n = _response_length(sample)
        if n is not None and values.numel() != n:
            raise ValueError(f"advantage: stage {stage} returned {values.numel()} advantages for sample {i}, whose "
                             f"response has {n} tokens")
    for sample, values in zip(batch, advantages):
        sample.advantage = values.tolist()


def _response_length(sample: TrainSample) -> int | None:
    """The sample's response tokens; a plain dict of a test or tool without `tokens` has them as its old_logp's
    (None: neither, nothing to check against)."""
    if sample.tokens is not None:
        return len(sample.tokens) - sample.prompt_len
    return None if sample.old_logp is None else len(sample.old_logp)

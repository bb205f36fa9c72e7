"""Every rank's side of a step: the groups' advantages, π_old (the old-log-prob pass, with R2 recording and
R3 replaying routes), π_ref, the per-token stages, then the optimizer steps on mini-batches.

    advantages (megapo.algorithms) ─► learner old log-probs (none when on-policy: then the train forward
    gives π_old and the routing metrics) ─► reference log-probs when a KL term needs them
    ─► token stages (per-token advantages, weights, masks) ─► learner.train_step per mini-batch
With a critic (algorithm.critic), its GAE advantages replace the estimator's before the token stages.
"""

from __future__ import annotations

import torch

from megapo.algorithms.config import GAE
from megapo.algorithms.spec import LossSpec
from megapo.dist import broadcast_object
from megapo.envs.base import Trajectory
from megapo.learner.reference import Reference
from megapo.learner.protocol import Learner, OnPolicyLearner
from megapo.algorithms.sample import TrainSample, as_train_samples
from megapo.trainer.config import RunConfig
from megapo.trainer.metrics import StepTimer
from megapo.trainer.rollout import Group


def train_samples(groups: list[Group], cfg: RunConfig, step: int = 1, prompt_stats=None) -> list[TrainSample]:
    """Learner train samples (megapo.algorithms.sample) with per-sequence advantages from the configured estimator
    and the sequence stages of algorithm.stages (`group_advantages`: at trainer step `step`, cumulative_std's
    running statistics `prompt_stats`, stages.PromptRewardStats, updated here); `old_logp` is filled in by the
    old-log-prob pass (`old_logprob_pass`), the token stages after it (`token_stages`)."""
    from megapo.algorithms.trust_region import sentence_end_flags

    if cfg.algorithm.advantage == GAE:  # per token, from the critic's values (critic_advantages, later in the step)
        adv = [[0.0] * len(g.samples) for g in groups]
    else:
        adv = [a_g.tolist() for a_g in group_advantages(groups, cfg, step, prompt_stats)]
    sentence_ends = _sentence_end_ids(cfg)  # the objective splits responses into sentences (sspo)
    replay = cfg.algorithm.routing_replay == "r3"
    weighted = any(g.weights is not None for g in groups)  # duet's importance weights: then every sample has one
    return [TrainSample(
        tokens=list(s.prompt_ids) + list(s.output_ids), prompt_len=len(s.prompt_ids), advantage=adv[gi][si],
        # hdpo's privileged samples: the engine's log-probs are of the hinted prompt, not μ (privileged_mu sets it)
        rollout_logp=None if g.privileged else list(s.logprobs),
        loss_mask=list(s.loss_mask) if isinstance(s, Trajectory) else None,  # observations are context only
        sentence_end=sentence_end_flags(s.output_ids, sentence_ends) if sentence_ends is not None else None,
        routes=s.routes if replay else None,
        # for router/disagree (megapo.replay.modes.stability_metrics), against the learner's routes of every MoE
        # layer: not where the routes are a pipeline stage's columns only (g.route_layers; rank 0 has them all)
        engine_routes=s.routes if g.route_layers is None else None,
        token_weight=[g.weights[si] if g.weights is not None else 1.0] * len(s.output_ids) if weighted else None)
        for gi, g in enumerate(groups) for si, s in enumerate(g.samples)]


def group_advantages(groups: list[Group], cfg: RunConfig, step: int, prompt_stats=None) -> list[torch.Tensor]:
    """One advantage per sample, per group: the configured estimator, then the sequence stages of algorithm.stages
    (megapo.algorithms.pipeline) in order. Groups of different sizes (a group filter kept k_i of each) go through
    the estimator and the stages one group at a time (RunConfig refuses the batch-level estimators and the
    [P, n] stages with ragged groups)."""
    from megapo.algorithms import compute_advantages
    from megapo.algorithms.pipeline import run_sequence_stages

    a, stages = cfg.algorithm, cfg.algorithm.pipeline()
    if any(_added(g) for g in groups):  # hdpo's privileged, anytime's summary groups: no estimator (their stage's)
        regular = [g for g in groups if not _added(g)]
        adv = iter(group_advantages(regular, cfg, step, prompt_stats) if regular else [])
        return [torch.zeros(len(g.samples), dtype=torch.float64) if _added(g) else next(adv) for g in groups]

    if a.advantage == "spo":  # SPO: the persistent value tracker `prompt_stats` (value_tracker.ValueTracker), no groups
        from megapo.algorithms.stages import prompt_key
        from megapo.algorithms.value_tracker import spo_advantages

        adv = spo_advantages([g.rewards for g in groups], [prompt_key(g.example.prompt) for g in groups], prompt_stats,
                             step, **a.advantage_options)
        return [run_sequence_stages(stages, x[None, :], _rows([g], stages, step, None))[0] for x, g in zip(adv, groups)]
    def advantages(part: list[Group]) -> torch.Tensor:
        full = compute_advantages(a.advantage, _rewards(part), lengths=_lengths(part), **a.advantage_options)
        return run_sequence_stages(stages, full, _rows(part, stages, step, prompt_stats))

    if len({len(g.samples) for g in groups}) > 1:
        return [advantages([g])[0] for g in groups]
    return list(advantages(groups))


def _added(g) -> bool:
    """A group the step added beside the sampled ones (Group.extra; a stand-in group with privileged only: that)."""
    return getattr(g, "extra", g.privileged)


def _rewards(groups: list[Group]) -> torch.Tensor:
    return torch.tensor([g.rewards for g in groups], dtype=torch.float64)


def _lengths(groups: list[Group]) -> torch.Tensor:
    """[P, n] response lengths (the token-weighted estimators read them)."""
    return torch.tensor([[len(s.output_ids) for s in g.samples] for g in groups])


def _rows(groups: list[Group], stages: list, step: int, prompt_stats):
    """What the sequence stages read about these groups (pipeline.GroupRows): the prompts and the verdicts only
    where a stage reads them (prompt_stats, correct)."""
    from megapo.algorithms.pipeline import GroupRows, inputs_of

    wanted = inputs_of(stages)
    prompts = [g.example.prompt for g in groups] if "prompt_stats" in wanted else []
    scored = "correct" in wanted and all(g.correct is not None for g in groups)
    return GroupRows(_rewards(groups), prompts, torch.tensor([g.correct for g in groups]) if scored else None, step,
                     prompt_stats)


def _sentence_end_ids(cfg: RunConfig) -> list[int] | None:
    """The objective's sentence-ending token ids when its loss reads sample.sentence_end, else None."""
    from megapo.algorithms.loss import token_inputs

    a = cfg.algorithm
    return list(a.objective_options["sentence_end_ids"]) if "sentence_end" in token_inputs(
        a.objective, a.objective_options) else None


def old_logprob_pass(learner: Learner, batch: list[TrainSample], cfg: RunConfig, measure_free_kl: bool = False,
                     free_logps: list | None = None, stale_prefix: list[int] | None = None) -> dict:
    """Set each sample's `old_logp` from the learner (collective). Under r2 the pass records the
    learner's routes and under r3 replays the engine's; either way sample.routes then holds the
    routes every train_step on this batch replays (megapo.replay.modes). Returns the pass's metrics and
    the stability metrics (modes.stability_metrics; under r3 the free-routing ones from `free_logps`, the
    samples' "own_routes" then set by modes.free_routing). `measure_free_kl` adds the engine-vs-learner
    k3 KL with and without replay (under r3 without `free_logps`, one extra forward pass). `stale_prefix` (stage
    soup, per sample): its first response tokens a historical policy drew, whose μ is that policy's: the
    engine-vs-learner metrics (mismatch/*, replay/kl_*) leave them out, soup/prefix_k3 measures them
    (megapo/trainer/soup.py)."""
    from megapo.replay.modes import mismatch_kl, old_logprobs, stability_metrics
    from megapo.trainer.soup import prefix_mismatch, prefix_split

    batch = as_train_samples(batch)
    mode = cfg.algorithm.routing_replay
    logps, metrics = old_logprobs(learner, batch, mode, with_entropy=keeps_old_entropy(cfg))
    for sample, lp in zip(batch, logps):
        sample.old_logp = lp.tolist()
    free = logps if mode != "r3" else free_logps  # off / r2: this pass routed freely
    mu = [i for i, s in enumerate(batch) if s.rollout_logp is not None]  # hdpo's privileged samples have no μ
    # the tokens this step's engine sampled: not soup's historical prefixes (their μ is an older policy's)
    seen = batch if stale_prefix is None else prefix_split(batch, stale_prefix, prefix=False)
    metrics.update(stability_metrics([seen[i] for i in mu], [logps[i] for i in mu],
                                     None if free is None else [free[i] for i in mu]))
    if stale_prefix is not None:
        metrics.update(prefix_mismatch([batch[i] for i in mu], [logps[i] for i in mu], [stale_prefix[i] for i in mu]))
    if measure_free_kl and mode != "off" and all(s.rollout_logp is not None for s in batch):
        metrics.update(mismatch_kl(learner, seen, logps, free_logps=free))
    return metrics


def policy_updates(learner: Learner, batch: list[TrainSample], bounds: list[tuple[int, int]], cfg: RunConfig,
                   loss: LossSpec) -> tuple[dict, dict]:
    """The optimizer steps on one rollout batch: train.updates_per_rollout passes over the mini-batches `bounds`
    (mini_batch_bounds), learner.train_step on each. Returns (the last step's metrics, lopti/* metrics).

    With stage lopti (megapo/algorithms/lopti.py) each step is two: the low-probability tokens' (π_old(y_t) < η,
    from sample.old_logp) under token weights w ⊙ low, then the others' under w ⊙ (1 − low), w the samples' own
    token_weight (1 without); normaliser unchanged, so the halves' losses add up to the unsplit one. scope=rollout
    runs every low step before every high step (the paper's code), scope=mini_batch alternates per mini-batch. The
    KL and entropy terms go with the high step only (lopti.py's Assumption), and a half with no token in a
    mini-batch takes no step. Metrics: lopti/low_loss, lopti/high_loss (each half's last step's loss, the high one
    with the KL / entropy terms), lopti/low_steps, lopti/high_steps (the optimizer steps each half took)."""
    stage = next((s for s in cfg.algorithm.pipeline() if s.name == "lopti"), None)
    passes = range(cfg.train.updates_per_rollout)
    if stage is None:
        last: dict = {}
        for _ in passes:
            for lo, hi in bounds:
                last = learner.train_step(batch[lo:hi], loss)
        return last, {}
    import dataclasses

    from megapo.algorithms.lopti import low_prob_masks, split_weights
    from megapo.algorithms.sample import MappingSample

    batch = as_train_samples(batch)
    low = low_prob_masks([s.old_logp for s in batch], stage.options.eta)
    weights = split_weights(low, [s.token_weight for s in batch])  # (low half, high half), per sample
    policy = [torch.ones(m.numel(), dtype=torch.bool) if s.loss_mask is None
              else torch.as_tensor(s.loss_mask).reshape(-1).bool() for s, m in zip(batch, low)]
    specs = (dataclasses.replace(loss, kl_coef=0.0, entropy_coef=0.0), loss)  # KL / entropy: the high step's

    def with_weight(sample, w):
        if isinstance(sample, MappingSample):
            return MappingSample({**sample.data, "token_weight": w})
        return dataclasses.replace(sample, token_weight=w)

    last, out = {}, {"lopti/low_steps": 0, "lopti/high_steps": 0}

    def step(half: int, lo: int, hi: int) -> None:
        nonlocal last
        name = ("low", "high")[half]
        side = [m if half == 0 else ~m for m in low[lo:hi]]
        if not any(bool((s & p).any()) for s, p in zip(side, policy[lo:hi])):
            return  # no token of this half here: no step (Adam would still move the weights)
        last = learner.train_step([with_weight(s, w) for s, w in zip(batch[lo:hi], weights[half][lo:hi])],
                                  specs[half])
        out[f"lopti/{name}_loss"] = last.get("loss", 0.0)
        out[f"lopti/{name}_steps"] += 1

    if stage.options.scope == "rollout":
        for half in (0, 1):
            for _ in passes:
                for lo, hi in bounds:
                    step(half, lo, hi)
    else:
        for _ in passes:
            for lo, hi in bounds:
                step(0, lo, hi)
                step(1, lo, hi)
    return last, out


def on_policy(cfg: RunConfig, learner: Learner) -> bool:
    """Whether π_old is the policy being trained (one update on one mini-batch, π_old from the learner): the
    train forward then is the old-log-prob pass too (megapo.replay.modes.on_policy_step). A learner that is no
    OnPolicyLearner (megapo.learner.protocol: declares no train_step_on_policy) gets the separate pass, and so
    does a stage that needs π_old's per-token statistics before the loss (a token stage reading old_logp or
    old_entropy, AlgorithmConfig.needs_old_stats), and an objective reading low_prob (lp_reg's batch-global quantile
    of π_old, set_low_prob) or entropy_score (ppo clip_mode hapo, set_entropy_scores), and stage lopti (two optimizer steps per mini-batch: the second needs π_old from
    before the first, the separate pass's)."""
    return (cfg.train.updates_per_rollout == 1 and cfg.train.mini_batches == 1 and cfg.old_policy() == "learner"
            and not cfg.algorithm.needs_old_stats() and not reads_low_prob(cfg)
            and not reads_token_input(cfg, "entropy_score")
            and not cfg.algorithm.has_stage("lopti")
            and isinstance(learner, OnPolicyLearner))


def reads_low_prob(cfg: RunConfig | LossSpec) -> bool:
    """Whether the objective (algorithm.objective, or a LossSpec's) reads the per-token input low_prob (lp_reg)."""
    return reads_token_input(cfg, "low_prob")


def reads_token_input(cfg: RunConfig | LossSpec, name: str) -> bool:
    """Whether the objective (algorithm.objective, or a LossSpec's) reads the per-token input `name`."""
    from megapo.algorithms.loss import token_inputs

    spec = cfg if isinstance(cfg, LossSpec) else cfg.algorithm
    return name in token_inputs(spec.objective, spec.objective_options)


def set_entropy_scores(batch: list[TrainSample], loss: LossSpec) -> dict:
    """ppo clip_mode hapo's per-token input: sample.entropy_score = objectives.hapo_entropy_scores of π_old's entropy
    (sample.old_entropy, the old-log-prob pass's) over the whole train batch, on every rank the same, before the
    mini-batch split. Metric hapo/high_entropy_frac: the share of policy tokens scored above the pivot."""
    from megapo.algorithms.objectives import hapo_entropy_scores

    batch = as_train_samples(batch)
    if any(s.old_entropy is None for s in batch):
        raise ValueError("old_entropy: clip_mode hapo scores π_old's entropy; the old-log-prob pass kept none")
    scores = hapo_entropy_scores([s.old_entropy for s in batch], [s.loss_mask for s in batch],
                                 loss.objective_config().entropy_pivot)
    for sample, h in zip(batch, scores):
        sample.entropy_score = h.tolist()
    flat = torch.cat(scores) if scores else torch.zeros(0, dtype=torch.float64)
    return {"hapo/high_entropy_frac": float((flat > 0).double().mean()) if flat.numel() else 0.0}


def set_low_prob(batch: list[TrainSample], loss: LossSpec) -> dict:
    """lp_reg's per-token input: sample.low_prob = objectives.low_prob_flags over the whole train batch (π_old, the
    per-token advantages after every stage, the policy tokens), on every rank the same, before the mini-batch split,
    so the quantile does not depend on mini-, micro-batches or DP ranks; ρ₋ / ρ₊ from `loss` (the run's LossSpec).
    Metric lp_reg/low_prob_frac: the selected share of the batch's response tokens."""
    from megapo.algorithms.objectives import low_prob_flags

    batch = as_train_samples(batch)
    o = loss.objective_config()
    masks = [s.loss_mask for s in batch]
    flags = low_prob_flags([s.old_logp for s in batch], [s.advantage for s in batch],
                           masks if any(m is not None for m in masks) else None, o.neg_fraction, o.pos_fraction)
    for sample, f in zip(batch, flags):
        sample.low_prob = f.tolist()
    flat = torch.cat(flags) if flags else torch.zeros(0, dtype=torch.float64)
    return {"lp_reg/low_prob_frac": float(flat.mean()) if flat.numel() else 0.0}


def token_stages(batch: list[TrainSample], cfg: RunConfig, step: int, **inputs) -> dict:
    """The token stages of algorithm.stages after the old-log-prob pass, in order, on the whole train batch at once
    (megapo.algorithms.pipeline: per-token advantages into sample.advantage, weights into sample.token_weight,
    which the learner multiplies the per-token loss by). π_old = sample.old_logp, its entropy sample.old_entropy;
    nat_prefix draws from (train.seed, `step`), so a resumed run cuts as the unstopped one. `inputs`: the
    pipeline.TokenContext fields the loop computed where a stage reads them (advantage_stages): self_teacher (the
    self-teacher pass's values), correct (each sample's verdict), privileged (hdpo's), blocks (bae's block rewards),
    sum_p2 and rewards (otb's), hidden (delta's and thr's), attention_entropy (attention_entropy's), vocab and vocab_logp (thr's), first_correct (decs's; rollout.max_new_tokens is always passed, decs's L_max),
    answer_information (iapo's), answer_steps (spae's), anytime (stage anytime's per-token advantages), components
    (gdpo's and mrtpo's reward components) and js_distance (mrtpo's)."""
    from megapo.algorithms.pipeline import TokenContext, run_token_stages

    a = cfg.algorithm
    ctx = TokenContext(group_size=cfg.rollout.n_samples, step=step, seed=cfg.train.seed, kl_coef=a.kl_coef,
                       max_new_tokens=cfg.rollout.max_new_tokens, **inputs)
    return run_token_stages(a.pipeline(), as_train_samples(batch), ctx)


def self_teacher_inputs(learner: Learner, batch: list[TrainSample], groups: list[Group], cfg: RunConfig,
                        tokenizer, spec) -> object:
    """The self-distillation stages' self-teacher values (megapo/trainer/self_teacher.py: one more learner forward
    of the batch behind prompts with a context, collective, routing freely), as `spec`
    (cfg.algorithm.self_teacher()) asks. `tokenizer` re-encodes the prompts as the run encodes them
    (data.chat_template)."""
    if tokenizer is None:
        raise ValueError("tokenizer: the self-distillation stages re-encode each prompt with its context; "
                         "update_policy needs the run's tokenizer")
    from megapo.trainer.data import encode_example
    from megapo.trainer.self_teacher import self_teacher_pass

    return self_teacher_pass(learner, batch, groups, spec,
                             encode=lambda ex: encode_example(tokenizer, ex, cfg.data.chat_template),
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def verdicts(groups: list[Group], cfg: RunConfig) -> list[bool]:
    """Each sample's verifier verdict in batch order (Group.verdicts)."""
    return [v for g in groups for v in g.verdicts(cfg.data.correct_threshold)]


def privileged_mu(batch: list[TrainSample]) -> None:
    """μ of hdpo's privileged samples (rollout_logp None: the engine drew them behind the hinted prompt, so no
    engine log-prob behind the original one exists) := π_old behind the original prompt (sample.old_logp): as if
    drawn on-policy, so a mismatch correction weighs them 1. After the old-log-prob pass, before any train step."""
    for s in as_train_samples(batch):
        if s.rollout_logp is None and s.old_logp is not None:
            s.rollout_logp = list(s.old_logp)


def model_rewards(reward_model, groups: list[Group], cfg: RunConfig, tokenizer, metrics: dict):
    """data.reward_model (collective): coef · its score added to each sample's reward in `groups`; with
    data.reward_model.dense, every prefix's score from the same one forward instead, returned for
    add_process_advantages after the token stages (None otherwise). Its metrics go into `metrics`."""
    from megapo.trainer.reward_model import add_model_rewards, dense_model_rewards

    rm = cfg.data.reward_model
    if rm.dense_mode() == "off":
        metrics.update(add_model_rewards(reward_model, groups, rm.coef))
        return None
    dense, dense_metrics = dense_model_rewards(reward_model, groups, rm.dense_mode(), rm.step_delimiter, tokenizer)
    metrics.update(dense_metrics)
    return dense


def likelihood_rewards(learner: Learner, groups: list[Group], cfg: RunConfig, tokenizer) -> dict:
    """data.likelihood_reward (collective: one more learner forward, routing freely): each sample's reward becomes
    verifier_coef · r + coef · log π(a* | x, z), a* the reference answer after the response's chain of thought z
    (megapo/trainer/likelihood_reward.py); its metrics."""
    if tokenizer is None:
        raise ValueError("tokenizer: the likelihood reward cuts each response at its answer marker and appends the "
                         "reference answer's tokens; update_policy needs the run's tokenizer")
    from megapo.trainer.likelihood_reward import add_likelihood_rewards

    return add_likelihood_rewards(learner, groups, cfg.data.likelihood_reward, tokenizer)


def advantage_stages(learner: Learner, batch: list[TrainSample], groups: list[Group], cfg: RunConfig, step: int,
                     tokenizer, timer: StepTimer, nat_cut=None) -> dict:
    """The token stages at trainer step `step` (token_select's schedule, nat_prefix's cut), after the
    self-distillation stages' extra forward (collective) where one reads it, with the verdicts and hdpo's privileged
    flags only where a stage reads them; `nat_cut` (nat_cut.PrefixCut): the step's one draw of nat_prefix's cuts."""
    self_teacher, spec = None, cfg.algorithm.self_teacher()
    if spec is not None:
        with timer("self_teacher"):
            self_teacher = self_teacher_inputs(learner, batch, groups, cfg, tokenizer, spec)
    reads = cfg.algorithm.stage_inputs()
    correct = verdicts(groups, cfg) if "correct" in reads else None
    privileged = [g.privileged for g in groups for _ in g.samples] if "privileged" in reads else None
    blocks = block_rewards(batch, groups, cfg, tokenizer) if "block_rewards" in reads else None
    sum_p2 = None
    if "old_sum_p2" in reads:  # OTB's (collective), after the old-log-prob pass set the routes the steps replay
        with timer("sum_p2"):
            sum_p2 = old_sum_p2(learner, batch)
    hidden = vocab = vocab_logp = None
    if "old_hidden" in reads and "old_vocab_logp" in reads:  # THR's (collective): both from one forward
        with timer("hidden_vocab_logp"):
            hidden, vocab, vocab_logp = old_hidden_vocab_logp(learner, batch)
    elif "old_hidden" in reads:  # DelTA's (collective): the LM head's input, on the replayed routes
        with timer("hidden"):
            hidden = old_hidden(learner, batch)
    attention = None
    if "old_attention_entropy" in reads:  # the attention-entropy stage's (collective), on the replayed routes
        with timer("attention_entropy"):
            attention = old_attention_entropy(learner, batch, cfg)
    if "old_vocab_logp" in reads and vocab is None:  # (collective): π_old over the batch's response vocabulary
        with timer("vocab_logp"):
            vocab, vocab_logp = old_vocab_logp(learner, batch)
    rewards = [r for g in groups for r in g.rewards] if "reward" in reads else None
    tempered = None
    if "old_tempered_logp" in reads:  # distribution_centric's target π^T_old (collective), on the replayed routes
        with timer("tempered_logp"):
            tempered = old_tempered_logp(learner, batch, cfg)
    first_correct = None
    if "first_correct" in reads:  # decs's: the task's checker on each correct response's step prefixes
        with timer("first_correct"):
            first_correct = first_correct_answers(batch, groups, cfg, tokenizer)
    anytime = None
    if "anytime" in reads:  # stage anytime's: BRPO on the thinkings, r − baseline on the summaries
        from megapo.trainer.anytime import anytime_token_advantages

        stage = next(s for s in cfg.algorithm.pipeline() if "anytime" in s.inputs)
        anytime = anytime_token_advantages(groups, stage.options.summaries)
    # stage soup's: each sample's historical prefix length (megapo/trainer/soup.py)
    soup_prefix = None
    if "soup_prefix" in reads:
        from megapo.trainer.soup import prefix_lens

        soup_prefix = prefix_lens(groups)
    information = steps = None
    if "answer_information" in reads:  # iapo's (collective): every prefix followed by the reference answer
        with timer("answer_information"):
            information = answer_information(learner, batch, groups, cfg, tokenizer)
    if "answer_steps" in reads:  # spae's (collective): the prefix before each step followed by the reference answer
        with timer("answer_steps"):
            steps = answer_steps(learner, batch, groups, cfg, tokenizer)
    from megapo.trainer.multi_reward import multi_reward_inputs

    # gdpo's and mrtpo's: the task's reward components; mrtpo's JS distances (collective, the components packed)
    multi = multi_reward_inputs(learner, batch, groups, cfg, tokenizer, reads, timer, replayed_routes(batch))
    return token_stages(batch, cfg, step, self_teacher=self_teacher, correct=correct, privileged=privileged,
                        blocks=blocks, sum_p2=sum_p2, hidden=hidden, attention_entropy=attention, vocab=vocab,
                        vocab_logp=vocab_logp, rewards=rewards, first_correct=first_correct,
                        tempered_logp=tempered, answer_information=information, answer_steps=steps,
                        anytime=anytime, soup_prefix=soup_prefix, nat_cut=nat_cut, **multi)


def answer_information(learner: Learner, batch: list[TrainSample], groups: list[Group], cfg: RunConfig,
                       tokenizer) -> list:
    """Stage iapo's input (megapo/algorithms/information.py): per sample, m_t = log π(a* | x, y_≤t) −
    log π(a* | x, y_<t) at each response token (with the stage's step_delimiter, each step's, shared by its tokens)."""
    from megapo.algorithms.information import token_information

    stage = next(s for s in cfg.algorithm.pipeline() if "answer_information" in s.inputs)
    return [token_information([float(lp.sum()) for lp in probe.logp], probe.cuts)
            for probe in answer_after_prefixes(learner, batch, groups, tokenizer, stage)]


def answer_steps(learner: Learner, batch: list[TrainSample], groups: list[Group], cfg: RunConfig, tokenizer) -> list:
    """Stage spae's input (megapo/algorithms/information.py): per sample, an AnswerProbe at the prompt and after each
    step of the stage's step_delimiter, with a*'s next-token entropies."""
    stage = next(s for s in cfg.algorithm.pipeline() if "answer_steps" in s.inputs)
    return answer_after_prefixes(learner, batch, groups, tokenizer, stage, with_entropy=True)


def answer_after_prefixes(learner: Learner, batch: list[TrainSample], groups: list[Group], tokenizer, stage,
                          with_entropy: bool = False) -> list:
    """Per sample an information.AnswerProbe: a*'s token log-probs (and entropies) after x ⊕ y_<t, a* the prompt's
    reference answer, t every prefix length or, with `stage`'s step_delimiter, 0 and each step's end; one learner
    forward (collective, routing freely: no engine routed these sequences) of x ⊕ y_<t ⊕ a* at every cut, under the
    weights the old-log-prob pass used."""
    if tokenizer is None:
        raise ValueError(f"tokenizer: stage {stage.name} appends each prompt's reference answer to the response "
                         "prefixes; update_policy needs the run's tokenizer")
    from megapo.algorithms.information import AnswerProbe, prefix_answer_sequences, prefix_cuts
    from megapo.algorithms.process_rewards import step_ends, token_texts
    from megapo.trainer.likelihood_reward import encode_text
    from megapo.trainer.self_teacher import freely_routed_logprobs

    delimiter = stage.options.step_delimiter
    answers = [answer for g in groups for answer in [encode_text(tokenizer, str(g.example.answer))] * len(g.samples)]
    texts_cache: dict = {}
    sequences, prompt_lens, cuts = [], [], []
    for s, answer in zip(batch, answers):
        if not answer:
            raise ValueError(f"stage {stage.name}: a reference answer encodes to no tokens (prompt {s.prompt_len} "
                             "tokens); the stage reads the answer's log-likelihood")
        response = list(s.tokens[s.prompt_len:])
        ends = step_ends(token_texts(tokenizer, response, texts_cache), delimiter) if delimiter else None
        cuts.append(prefix_cuts(len(response), ends))
        sequences += prefix_answer_sequences(s.tokens[:s.prompt_len], response, answer, cuts[-1])
        prompt_lens += [s.prompt_len] * len(cuts[-1])
    out = freely_routed_logprobs(learner, sequences, prompt_lens, with_entropy=with_entropy) if sequences else []
    logps, entropies = (iter(out[0]), iter(out[1])) if with_entropy and sequences else (iter(out), None)
    probes = []
    for a, c in zip(answers, cuts):
        logp = [torch.as_tensor(next(logps), dtype=torch.float64)[-len(a):] for _ in c]
        entropy = [torch.as_tensor(next(entropies), dtype=torch.float64)[-len(a):] for _ in c] if entropies else None
        probes.append(AnswerProbe(c, logp, entropy))
    return probes


def old_tempered_logp(learner: Learner, batch: list[TrainSample], cfg: RunConfig) -> list:
    """Stage distribution_centric's input (megapo/algorithms/distribution_centric.py): log softmax(z_old/T) at each
    response token (Learner.response_tempered_logp, collective), T the stage's target temperature from the batch's
    entropy estimate over π_old; on the routes the train steps replay (routing freely where there are none)."""
    from megapo.algorithms.distribution_centric import batch_temperature

    stage = next(s for s in cfg.algorithm.pipeline() if "old_tempered_logp" in s.inputs)
    masks = [s.loss_mask for s in batch]
    temperature = batch_temperature([s.old_logp for s in batch], masks if any(m is not None for m in masks) else None,
                                    stage.options)
    return learner.response_tempered_logp([list(s.tokens) for s in batch], [s.prompt_len for s in batch], temperature,
                                          routes=replayed_routes(batch))


def first_correct_answers(batch: list[TrainSample], groups: list[Group], cfg: RunConfig, tokenizer) -> list[int]:
    """Stage decs's input first_correct (megapo/algorithms/token_length.py): per sample, the token count through the
    first step (the stage's step_delimiter) whose prefix the task's answer checker (data.reward) scores
    >= data.correct_threshold; -1 for an incorrect response and for one with no such step (every rank, the same)."""
    if tokenizer is None:
        raise ValueError("tokenizer: stage decs decodes each correct response to check its step prefixes; "
                         "update_policy needs the run's tokenizer")
    from megapo.algorithms.token_length import first_correct_ends
    from megapo.trainer.rewards import answer_checker

    stage = next(s for s in cfg.algorithm.pipeline() if "first_correct" in s.inputs)
    return first_correct_ends([s.tokens[s.prompt_len:] for s in batch],
                              [g.example.answer for g in groups for _ in g.samples], verdicts(groups, cfg), tokenizer,
                              answer_checker(cfg.data), cfg.data.correct_threshold,
                              stage.options.step_delimiter)


def replayed_routes(batch: list[TrainSample]) -> list | None:
    """The routes the train steps replay (sample.routes, set by the old-log-prob pass) for a learner's extra response
    pass, or None (route freely) where a sample has none."""
    routes = [s.routes for s in batch]
    return routes if all(r is not None for r in routes) else None


def old_sum_p2(learner: Learner, batch: list[TrainSample]) -> list:
    """Σ_v π_old(v)² at each response token of every sample (Learner.response_sum_p2, collective), on the routes
    the train steps replay (sample.routes, set by the old-log-prob pass; routing freely where there are none)."""
    return learner.response_sum_p2([list(s.tokens) for s in batch], [s.prompt_len for s in batch],
                                   routes=replayed_routes(batch))


def old_hidden(learner: Learner, batch: list[TrainSample]) -> list:
    """The LM head's input at each response token of every sample (Learner.response_hidden, collective), on the
    routes the train steps replay (sample.routes; routing freely where there are none)."""
    return learner.response_hidden([list(s.tokens) for s in batch], [s.prompt_len for s in batch],
                                   routes=replayed_routes(batch))


def old_attention_entropy(learner: Learner, batch: list[TrainSample], cfg: RunConfig) -> list:
    """The entropy of the stage attention_entropy's layer's head-averaged attention at each response token of every
    sample (Learner.response_attention_entropy, collective), on the routes the train steps replay."""
    stage = next(s for s in cfg.algorithm.pipeline() if "old_attention_entropy" in s.inputs)
    return learner.response_attention_entropy([list(s.tokens) for s in batch], [s.prompt_len for s in batch],
                                              stage.options.layer, routes=replayed_routes(batch))


def old_vocab_logp(learner: Learner, batch: list[TrainSample]) -> tuple[list[int], list]:
    """(ids, per sample [response tokens, len(ids)]): log π_old of every token id in the batch's policy tokens at each
    response token (Learner.response_logp_at, collective), on the routes the train steps replay."""
    ids = response_vocabulary(batch)
    return ids, learner.response_logp_at([list(s.tokens) for s in batch], [s.prompt_len for s in batch], ids,
                                         routes=replayed_routes(batch))


def response_vocabulary(batch: list[TrainSample]) -> list[int]:
    """The token ids of the batch's policy tokens (loss_mask 1; every response token where there is no mask),
    sorted: the ids old_vocab_logp reads π_old at."""
    return sorted({int(v) for s in batch for v, m in zip(s.tokens[s.prompt_len:], s.loss_mask or
                                                         [1] * (len(s.tokens) - s.prompt_len)) if m})


def old_hidden_vocab_logp(learner: Learner, batch: list[TrainSample]) -> tuple[list, list[int], list]:
    """(old_hidden's values, then old_vocab_logp's ids and values) from ONE forward (Learner.response_hidden_logp_at,
    collective) where a stage reads both (thr), on the routes the train steps replay."""
    ids = response_vocabulary(batch)
    hidden, logp = learner.response_hidden_logp_at([list(s.tokens) for s in batch], [s.prompt_len for s in batch],
                                                   ids, routes=replayed_routes(batch))
    return hidden, ids, logp


def block_rewards(batch: list[TrainSample], groups: list[Group], cfg: RunConfig, tokenizer):
    """Stage bae's input (megapo/algorithms/blockwise.py): each response's token blocks and its block rewards from
    the stage's block_reward function on the decoded response and its prompt's answer (every rank, the same)."""
    from megapo.algorithms.blockwise import block_inputs

    stage = next(s for s in cfg.algorithm.pipeline() if "block_rewards" in s.inputs)
    return block_inputs([s.tokens[s.prompt_len:] for s in batch],
                        [str(g.example.answer) for g in groups for _ in g.samples],
                        [len(g.samples) for g in groups], tokenizer, stage.options)


def teacher_terms(teachers: list[Reference], batch: list[TrainSample], cfg: RunConfig) -> dict:
    """algorithm.distill: reverse_kl subtracts the teachers' weighted reverse KLs from the (per-token) advantage;
    topk_forward_kl attaches their top-k rows, which the learner's loss term reads."""
    d = cfg.algorithm.distill
    if d.mode == "topk_forward_kl":
        from megapo.trainer.distill import attach_teacher_topk

        attach_teacher_topk(teachers, batch, d.k)
        return {}
    return distill_advantages(teachers, batch, [t.coef for t in d.all_teachers()])


def distill_advantages(teachers: list[Reference], batch: list[TrainSample], coefs: list[float]) -> dict:
    """A_t - Σ_j coefs[j] (log π_old - log π_Tj) on every response token (megapo/trainer/distill.py; every rank: a
    Megatron teacher is collective); distill/reverse_kl[/<j>], each teacher's mean gap over the policy tokens."""
    from megapo.trainer.distill import reverse_kl_metrics, teachers_advantages

    adv, kls = teachers_advantages([s.advantage for s in batch], [s.old_logp for s in batch],
                                   [reference_logprobs(t, batch) for t in teachers], coefs,
                                   [s.loss_mask for s in batch])
    for sample, values in zip(batch, adv):
        sample.advantage = values
    return reverse_kl_metrics(kls)


def use_engine_logprobs(batch: list[TrainSample]) -> dict:
    """algorithm.old_policy=engine: the objective's π_old becomes the engine's log-probs μ of the weights
    that drew each sample. Its clip then bounds the move from the sampling policy: a sample k versions
    old whose probability the last k updates already moved past the clip range stops pushing (the
    objective's ratio π_θ/μ is a clipped importance weight). Returns how far the learner now is from
    the engine on these samples: k3 = mean(ρ - 1 - log ρ), ρ = π_learner/μ (the staleness, plus numerics)."""
    from megapo.replay.modes import engine_mismatch

    batch = as_train_samples(batch)
    m = engine_mismatch(batch, [s.old_logp for s in batch])
    for sample in batch:
        sample.old_logp = list(sample.rollout_logp)
    return {"old_policy/learner_vs_engine_k3": m["k3"],
            "old_policy/learner_vs_engine_max_abs_dlogp": m["max_abs_dlogp"]}


def reference_logprobs(reference: Reference | None, batch: list[TrainSample]) -> list[list[float]]:
    """π_ref's response log-probs of every sample, on every rank: computed by every rank (a Megatron reference)
    or on rank 0 and broadcast (a plain one)."""
    if reference is not None and reference.collective:
        return reference.response_logprobs(batch)
    return broadcast_object(reference.response_logprobs(batch) if reference is not None else None)


def mini_batch_bounds(group_sizes: list[int], mini_batches: int) -> list[tuple[int, int]]:
    """[lo, hi) sample ranges of the optimizer steps on one rollout batch: `mini_batches` of whole groups (fewer
    when dynamic sampling kept fewer groups than that), as even in groups as whole groups allow, in batch
    order; `group_sizes`: the samples of each group (they differ after a group filter)."""
    num_groups = len(group_sizes)
    parts = min(mini_batches, num_groups)
    counts = [num_groups // parts + (i < num_groups % parts) for i in range(parts)]
    ends = [sum(group_sizes[:sum(counts[:i + 1])]) for i in range(parts)]
    return list(zip([0] + ends[:-1], ends))


def update_policy(learner: Learner, groups: list[Group], cfg: RunConfig, reference: Reference | None, loss: LossSpec,
                  timer: StepTimer,
                  measure_free_kl: bool = False, measure_free_routing: bool = False, step: int = 1,
                  prompt_stats=None, teachers: list[Reference] | None = None, critic=None, reward_model=None,
                  tokenizer=None) -> dict:
    """All ranks: advantages, old (and reference) log-probs, then the optimizer steps on mini-batches under `loss`
    (the run's LossSpec, RunConfig.loss_spec).
    π_old (sample.old_logp) and the replayed routes (sample.routes) are set once, before the first
    update, and stay fixed over all of them. Under r3, `measure_free_kl` / `measure_free_routing` take one more
    forward pass with the learner's own routing first (timed as "stability"): mismatch/k3_free, router/*.
    `critic` (algorithm.critic): GAE advantages from its values and its own step; during its warm-up
    (algorithm.critic.warmup_steps) the policy does not move. `reward_model` (data.reward_model, collective): its
    score times data.reward_model.coef is added to each sample's reward in `groups` before the advantages; with
    data.reward_model.dense, coef times its process advantage is added to each token's advantage after the token
    stages instead (megapo/algorithms/process_rewards.py).
    data.likelihood_reward (collective, after the reward model): each reward becomes verifier_coef · r + coef ·
    log π(reference answer | prompt, the response cut at its answer), before the advantages (likelihood_rewards).
    `teachers` (algorithm.distill, in its order, collective): their weighted reverse KLs enter the advantage.
    `tokenizer`: the run's, for the self-distillation stages' prompts with a context (self_teacher_inputs).
    Stage nat_prefix's cuts (option cut) are drawn once, before any pass (nat_prefix_cut); where nothing reads the
    cut tokens the batch is cut then, so the old-log-prob, reference and stability passes run on the kept ones."""
    from megapo.replay.modes import free_routing, on_policy_step
    from megapo.algorithms.nat_cut import cut_stage, rescale, shorten
    from megapo.trainer.soup import batch_prefix_lens

    metrics: dict[str, float] = {}
    mode = cfg.algorithm.routing_replay
    dense = None
    if reward_model is not None:  # megapo/trainer/reward_model.py: every rank gets and adds the same scores
        with timer("reward_model"):
            dense = model_rewards(reward_model, groups, cfg, tokenizer, metrics)
    if cfg.data.likelihood_reward.enabled:  # after the reward model's term: r <- verifier_coef · r + coef · L
        with timer("likelihood"):
            metrics.update(likelihood_rewards(learner, groups, cfg, tokenizer))
    batch = train_samples(groups, cfg, step, prompt_stats)
    fused, free = on_policy(cfg, learner), None
    nat = None
    if cut_stage(cfg.algorithm.pipeline()) is not None:  # NAT's prefix cut: drawn once, before any pass
        nat = nat_prefix_cut(batch, groups, cfg, step, loss, fused)
        if nat.early:  # nothing reads the cut tokens: the passes below run on the kept ones only
            batch, _ = shorten(batch, nat)
    if mode == "r3" and (measure_free_kl or measure_free_routing):
        with timer("stability"):  # before any update: the weights π_old comes from
            free = free_routing(learner, batch)
    with timer("old_logp"):
        if not fused:
            metrics.update(old_logprob_pass(learner, batch, cfg, measure_free_kl, free_logps=free,
                                            stale_prefix=batch_prefix_lens(groups)))
    if any(g.privileged for g in groups):  # hdpo (refused with old_policy=engine): μ of the privileged samples
        privileged_mu(batch)
    if cfg.old_policy() == "engine":
        metrics.update(use_engine_logprobs(batch))
    if cfg.algorithm.needs_reference():  # before the stages: future_kl's and future_drift's advantages read it
        with timer("ref_logp"):
            ref = reference_logprobs(reference, batch)
        for sample, lp in zip(batch, ref):
            sample.ref_logp = lp
    if critic is not None:  # before the stages, which may reweight the advantages
        from megapo.trainer.critic_step import critic_advantages

        with timer("critic"):
            metrics.update(critic_advantages(critic, batch, [r for g in groups for r in g.rewards],
                                             cfg.algorithm.critic))
        if step <= cfg.algorithm.critic.warmup_steps:  # the values first learn the returns; the policy waits
            metrics["critic/warmup"] = 1
            return metrics
    metrics.update(advantage_stages(learner, batch, groups, cfg, step, tokenizer, timer, nat_cut=nat))
    if dense is not None:  # A_t + coef · Â_t: the RM's process advantage per token
        from megapo.trainer.reward_model import add_process_advantages

        metrics.update(add_process_advantages(batch, dense, cfg.data.reward_model.coef))
    if teachers:  # on-policy distillation (collective)
        with timer("teacher"):
            metrics.update(teacher_terms(teachers, batch, cfg))
    if reads_low_prob(loss):  # lp_reg: the batch-global quantile, after every stage set the advantages
        metrics.update(set_low_prob(batch, loss))
    if reads_token_input(loss, "entropy_score"):  # ppo clip_mode hapo: π_old's entropy scored over the batch
        metrics.update(set_entropy_scores(batch, loss))
    if nat is not None:  # NAT's prefix cut: the tokens after it leave the batch (if not yet), the normalisers kept
        if not nat.early:
            batch, free = shorten(batch, nat, free)
        rescale(batch, nat)
        metrics.update(nat.metrics())
    with timer("train"):
        last: dict = {}
        if fused:  # one update on the whole batch, π_old from its own forward
            last, old_pass = on_policy_step(learner, batch, mode, loss, measure_kl=measure_free_kl, free_logps=free,
                                            keep_entropy=cfg.rollout.adaptive_temperature > 0)
            metrics.update(old_pass)
        else:
            bounds = mini_batch_bounds([len(g.samples) for g in groups], cfg.train.mini_batches)
            last, split = policy_updates(learner, batch, bounds, cfg, loss)
            metrics.update(split)
    # the learner's distill/* (topk_forward_kl's term) keep their names, as the reverse KL's do
    metrics.update({k if k.startswith("distill/") else f"train/{k}": v for k, v in last.items()
                    # off: a recording hook's replay/* mean nothing
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and not (mode == "off" and k.startswith("replay/"))})
    # "kl": to the reference when there is a KL penalty, else the engine-vs-learner mismatch (measured
    # before the update; with old_policy=engine the train step sees π_old = μ and measures nothing)
    kl_key = next((k for k in ("train/kl", "old_policy/learner_vs_engine_k3", "train/mismatch_k3") if k in metrics),
                  None)
    if kl_key is not None:
        metrics["kl"] = metrics[kl_key]
    if cfg.rollout.adaptive_temperature > 0:  # the next rollout's temperatures follow this batch's π_old entropy
        metrics.update(temperature_stats(batch))
    return metrics


def nat_prefix_cut(batch: list[TrainSample], groups: list[Group], cfg: RunConfig, step: int, loss: LossSpec,
                   fused: bool):
    """Stage nat_prefix's cut of this step (nat_cut.PrefixCut), drawn once from (train.seed, `step`) on the uncut
    `batch`, its normalisers those of the train steps' mini-batches (the whole batch when `fused`); early (the batch
    cut before the old-log-prob pass) unless something reads the cut tokens (nat_cut.early_cut_blocker)."""
    from megapo.algorithms.nat_cut import draw_cut, early_cut_blocker

    bounds = [(0, len(batch))] if fused else mini_batch_bounds([len(g.samples) for g in groups],
                                                                cfg.train.mini_batches)
    return draw_cut(batch, cfg.train.seed, step, loss, bounds, early=early_cut_blocker(cfg) is None)


def keeps_old_entropy(cfg: RunConfig) -> bool:
    """Whether the old-log-prob pass keeps π_old's entropy: for a stage or the loss, or for HAPO's adaptive sampling
    temperature (rollout.adaptive_temperature)."""
    return cfg.algorithm.needs_old_entropy() or cfg.rollout.adaptive_temperature > 0


TEMPERATURE_STATS = ("centre", "scale", "top", "bottom")  # EntropyTemperature's fields from a batch


def temperature_stats(batch: list[TrainSample]) -> dict:
    """HAPO's adaptive temperature's statistics of this batch's π_old entropy over its policy tokens
    (objectives.hapo_entropy_stats, pivot the median as in the authors' sampler) as metrics
    hapo_temperature/<centre | scale | top | bottom>: the trainer builds the next rollout's EntropyTemperature
    from them (megapo.trainer.run). None of them when the batch has no policy token."""
    from megapo.algorithms.objectives import hapo_entropy_stats

    batch = as_train_samples(batch)
    if any(s.old_entropy is None for s in batch):
        raise ValueError("old_entropy: rollout.adaptive_temperature scores π_old's entropy; the old-log-prob pass "
                         "kept none")
    stats = hapo_entropy_stats([s.old_entropy for s in batch], [s.loss_mask for s in batch], 0.5, eps=1e-6)
    return {} if stats is None else {f"hapo_temperature/{k}": v for k, v in zip(TEMPERATURE_STATS, stats)}


def stability_step(cfg: RunConfig, step: int) -> bool:
    """Whether `step` measures the stability metrics that cost a forward pass under r3
    (train.stability_metrics_every; 0: the eval steps)."""
    every = cfg.train.stability_metrics_every or cfg.train.eval_every
    return bool(every) and step % every == 0


def new_prompt_stats(cfg: RunConfig, saved: dict | None = None):
    """The running per-prompt reward statistics (stages.PromptRewardStats) a stage reads (prompt_stats:
    cumulative_std), or SPO's value tracker (algorithm.advantage spo: value_tracker.ValueTracker), restored from a
    checkpoint's TrainerState.extra when `saved` is given; None when none does."""
    from megapo.algorithms.stages import PromptRewardStats
    from megapo.algorithms.value_tracker import STATE_KEY, ValueTracker

    if cfg.algorithm.advantage == "spo":  # SPO's value tracker (megapo/algorithms/value_tracker.py)
        return ValueTracker((saved or {}).get(STATE_KEY))
    if "prompt_stats" not in cfg.algorithm.stage_inputs():
        return None
    return PromptRewardStats((saved or {}).get("prompt_stats"))


def stage_state(prompt_stats) -> dict:
    """What the stages keep across steps, for TrainerState.extra (JSON)."""
    from megapo.algorithms.value_tracker import STATE_KEY, ValueTracker

    if isinstance(prompt_stats, ValueTracker):
        return {STATE_KEY: prompt_stats.state_dict()}
    return {} if prompt_stats is None else {"prompt_stats": prompt_stats.state_dict()}

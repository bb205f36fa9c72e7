"""Rank 0's side of a step: prompts -> samples (one response, or a multi-turn trajectory) -> rewards ->
the length stage and dynamic sampling -> the groups to train on, with the rollout metrics.

The groups are what the update (megapo.trainer.update) reads: one Group per prompt, its kept samples and
their rewards."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from megapo.engines.base import Engine, Sample, SamplingParams
from megapo.envs.base import Trajectory
from megapo.tasks.base import Example
from megapo.trainer.config import RunConfig


@dataclass
class Group:
    """The samples of one prompt kept for training, with their rewards (shaped by the length stage)."""

    example: Example
    samples: list[Sample | Trajectory]  # a Trajectory: a multi-turn rollout (megapo.envs)
    rewards: list[float]  # what the advantages are computed from
    scores: list[float] | None = None  # the verifier's rewards before length shaping (None: not shaped)
    correct: list[bool] | None = None  # the verifier's verdict, reward >= data.correct_threshold
    sampled: int | None = None  # responses drawn for this prompt (more than len(samples) after a group filter)
    prompt_index: int | None = None  # the prompt's place in the run's prompt pool
    sample_ids: list[int] | None = None  # each kept sample's index among those drawn (None: all, in order)
    # the MoE layers its samples' routes hold, as columns (None: all); with PP > 1 a rank other than 0 gets its
    # pipeline stage's only (megapo.trainer.handout)
    route_layers: list[int] | None = None
    # HDPO's privileged rollouts (megapo/trainer/privileged.py): correct responses drawn with the reference answer in
    # the prompt, attached to the original prompt; no estimator advantage (stage hdpo gives them λ)
    privileged: bool = False
    # stage anytime's (megapo/trainer/anytime.py): the budget rewards of a group's thinkings, or of the thinkings a
    # summary group summarises (anytime.BudgetRewards; slots set on a summary group)
    anytime: Any = None
    # each kept sample's importance weight, multiplying its loss (duet's abort rule: 1/q for a rollout continued
    # past the abort check; megapo/algorithms/duet.py); None: all 1
    weights: list[float] | None = None
    # stage soup's (megapo/trainer/soup.py): per kept sample, how many of its first response tokens are a prefix a
    # historical policy drew (0: on-policy); None: no sample is mixed
    prefix_lens: list[int] | None = None

    @property
    def extra(self) -> bool:
        """A group the step adds beside the sampled ones (hdpo's privileged, anytime's summaries): no estimator
        advantage, its stage sets it."""
        return self.privileged or getattr(self.anytime, "slots", None) is not None

    def verdicts(self, threshold: float) -> list[bool]:
        """Each kept sample's verifier verdict: `correct` where the length stage set it, else its score (the reward
        before length shaping) >= `threshold` (data.correct_threshold)."""
        if self.correct is not None:
            return [bool(c) for c in self.correct]
        scores = self.scores if self.scores is not None else self.rewards
        return [r >= threshold for r in scores]


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

    @functools.lru_cache(maxsize=1 << 16)  # a step's responses repeat (the same answer by many samples)
    def decode(ids: tuple[int, ...]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    def response_text(sample) -> str:
        if isinstance(sample, Trajectory):  # a multi-turn trajectory: its last policy turn is the answer
            return tokenizer.decode(sample.answer_ids(stop), skip_special_tokens=True)
        ids = sample.output_ids[:-1] if sample.finish_reason == "stop" else sample.output_ids
        return decode(tuple(ids))

    def reward(pairs: list) -> list[float]:
        scores = fn.score_all([(response_text(sample), example.answer) for example, sample in pairs],
                              truncated=[sample.finish_reason != "stop" for _, sample in pairs])
        # an environment's own reward at the end of a trajectory replaces the verifier's
        return [s.env_reward if getattr(s, "env_reward", None) is not None else r for r, (_, s) in zip(scores, pairs)]

    reward.pop_errors = fn.pop_errors
    reward.pop_truncated = fn.pop_truncated
    return reward


def rollout_round(engine: Engine, params, examples: list, prompt_ids: list[list[int]], reward_fn,
                  indices: list[int] | None = None, sampler=None, counts: list[int] | None = None) -> list[Group]:
    """One sampling round: every prompt's samples with the verifier's rewards (before length shaping);
    `indices`: the prompts' places in the prompt pool; `sampler`: multi-turn trajectories in place of
    engine.generate (megapo.envs.rollout.trajectory_sampler); `counts`: each prompt's own number of samples
    (duet's allocation) in place of params.n."""
    if counts is not None:
        drawn = generate_counts(engine, params, prompt_ids, counts)
    elif sampler is not None:
        drawn = sampler(engine, prompt_ids, examples, params)
    else:
        drawn = engine.generate(prompt_ids, params)
    scores = iter(reward_fn([(ex, s) for ex, samples in zip(examples, drawn) for s in samples]))
    indices = indices if indices is not None else [None] * len(examples)
    return [Group(ex, samples, [next(scores) for _ in samples], prompt_index=i)
            for ex, samples, i in zip(examples, drawn, indices)]


def generate_counts(engine: Engine, params: SamplingParams, prompt_ids: list[list[int]],
                    counts: list[int]) -> list[list[Sample]]:
    """Prompt i's counts[i] samples: one engine call with prompt i repeated counts[i] times at n = 1 (every engine
    takes it; the rows are independent draws as n rows of one prompt are)."""
    from dataclasses import replace

    flat = [ids for ids, c in zip(prompt_ids, counts) for _ in range(c)]
    rows = iter(engine.generate(flat, replace(params, n=1)))
    return [[next(rows)[0] for _ in range(c)] for c in counts]


def collect_rollouts(engine: Engine, params, pool, source, reward_fn, cfg: RunConfig, length=None,
                     sampler=None, privileged=None, anytime=None, soup=None) -> tuple[list[Group], dict, int]:
    """Rank 0: sample groups for one step (with dynamic sampling, refilled up to max_sampling_rounds), each
    round shaped and filtered by `length` (trainer.length_stage.LengthStage) before dynamic sampling judges it;
    `sampler`: multi-turn trajectories (rollout_round); `privileged` (privileged.PrivilegedRollouts, stage hdpo):
    one more engine call for the step's all-fail groups, their privileged groups after the others; `anytime`
    (anytime.AnytimeRollouts, stage anytime): one more engine call for the kept groups' responses cut at the step's
    budgets, their summary groups after the others; `soup` (soup.SoupRollouts, stage soup): one more engine call
    per continuation budget for the kept groups' mixed samples (historical prefix, on-policy continuation); returns the
    groups to train on (whole groups, a multiple of dp), metrics, generated tokens."""
    from megapo.trainer import data
    from megapo.trainer.metrics import length_metrics

    sampled: list[Group] = []  # every group generated this step, as the verifier scored it, for the metrics
    shaped: list[Group] = []  # the same after the length stage (kept responses only)
    if length is not None:
        length.begin_batch()

    def one_round() -> list[Group]:
        chosen = source.next_batch(cfg.data.prompts_per_step)
        items = pool.items(chosen) if isinstance(pool, data.PromptPool) else [pool[i] for i in chosen]
        examples = [ex for ex, _ in items]
        counts = length.rollout_counts(examples, cfg.rollout.n_samples, [ids for _, ids in items]) \
            if length is not None else None
        round_params = length.abort_params(engine, params, counts) if length is not None else params  # duet's abort
        new = rollout_round(engine, round_params, examples, [ids for _, ids in items], reward_fn,
                            [int(i) for i in chosen], sampler, counts)
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
    groups, tokens = groups[:keep], sum(policy_tokens(s) for s in samples)
    if soup is not None and groups:  # stage soup: the kept groups' last `mix` slots mixed where the buffer allows
        groups, soup_metrics, extra_tokens = soup(engine, groups, reward_fn)
        metrics.update(soup_metrics)
        tokens += extra_tokens
    if privileged is not None:  # HDPO: every group of the step is looked at, also those dynamic sampling dropped
        extra, hdpo_metrics, extra_tokens = privileged(engine, shaped, reward_fn)
        metrics.update(hdpo_metrics)
        groups, tokens = dp_whole(groups, extra, cfg.parallel.dp), tokens + extra_tokens
    if anytime is not None and groups:  # stage anytime: the kept groups' budget rewards, their summaries after them
        groups, summaries, anytime_metrics, extra_tokens = anytime(engine, groups, reward_fn)
        metrics.update(anytime_metrics)
        groups, tokens = dp_whole(groups, summaries, cfg.parallel.dp), tokens + extra_tokens
    return groups, metrics, tokens


def dp_whole(groups: list[Group], extra: list[Group], dp: int) -> list[Group]:
    """`groups` (a multiple of dp already) and as many of the privileged `extra` as keep the count a multiple of
    dp (every DP rank gets whole groups). Empty when `groups` is (dynamic sampling kept no group: the step is
    skipped, as without hdpo; a batch of privileged samples alone would hold no engine routes for r3)."""
    if not groups:
        return []
    return groups + extra[:len(extra) - len(extra) % dp]


def policy_tokens(sample) -> int:
    """Tokens the engine generated for a sample (a trajectory's observations are not)."""
    return sum(sample.loss_mask) if isinstance(sample, Trajectory) else len(sample.output_ids)


def turn_play(cfg: RunConfig):
    """The run's environment and turn limits (megapo.envs.rollout.TurnPlay), or None for single-turn rollouts."""
    from megapo.envs.rollout import TurnLimits, TurnPlay

    make_env = cfg.env_factory()
    if make_env is None:
        return None
    return TurnPlay(make_env, TurnLimits(cfg.env.max_turns, cfg.response_tokens()))


def sampling_params(cfg: RunConfig, stop_token_id: int, routes: bool) -> SamplingParams:
    """The engine's sampling parameters of every rollout; `routes`: return each token's experts."""
    r = cfg.rollout
    return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                          stop_token_ids=(stop_token_id,), return_routes=routes)

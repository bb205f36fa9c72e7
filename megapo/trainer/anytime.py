"""Stage anytime's summaries (AnytimeReasoner, megapo/algorithms/anytime.py): rank 0's side of a step, the per-token
advantages every rank reads, and the config's refusals.

After the step's groups are sampled and scored, each response z (the thinking) is cut at every budget b_s of the
step's support (anytime.step_budgets: the prior's, or seeded draws from it); where z did not end on its own within
b_s, one engine call (for the whole step) draws `summaries` answers behind x ⊕ z[:b_s] ⊕ trigger, each scored by the
run's reward. R_{g,s} is the mean score there (z's own score where it ended within b_s). Every group gets its
BudgetRewards (Group.anytime); the summaries of a group's thinkings follow the step's groups as one more Group
(anytime.slots set: each summary's thinking, budget and truncation), trained as samples of their own: the engine drew
them behind exactly that prompt, so their log-probs are μ and (under r3) their routes replay as any sample's.

The estimator gives the summary groups no advantage (update.group_advantages); stage anytime then sets every
thinking token's BRPO advantage and every summary token's r − baseline (anytime_token_advantages).

draw_summaries is the one place summaries are drawn: the training step's (all budgets in one call) and the held-out
anytime accuracy's (megapo/trainer/anytime_eval.py: greedy, one call per budget).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megapo.algorithms.anytime import (AnytimeOptions, BudgetRewards, brpo_advantages, step_budgets,
                                       summary_baselines, thinking_token_advantages)
from megapo.engines.base import Sample, SamplingParams
from megapo.trainer.rollout import Group


def ended_within(sample: Sample, budget: int) -> bool:
    """Whether the thinking ended on its own (end-of-sequence) within `budget` tokens: its own answer counts there."""
    return sample.finish_reason == "stop" and len(sample.output_ids) <= budget


def summary_prompt(sample: Sample, budget: int, trigger_ids: list[int]) -> list[int]:
    """x ⊕ z[:b] ⊕ trigger: the thinking cut at `budget` tokens (all of it when shorter), then the answer request."""
    return list(sample.prompt_ids) + list(sample.output_ids[:budget]) + list(trigger_ids)


def draw_summaries(engine, thinkings: list[Sample], cuts: list[int], trigger_ids: list[int],
                   params: SamplingParams) -> list[list[Sample]]:
    """One engine call: params.n summaries behind each thinking cut at its budget and the trigger (summary_prompt).
    The stage's training summaries and the held-out anytime accuracy (megapo/trainer/anytime_eval.py) both draw
    theirs here."""
    if not thinkings:
        return []
    return engine.generate([summary_prompt(z, b, trigger_ids) for z, b in zip(thinkings, cuts)], params)


@dataclass(frozen=True)
class Request:
    """One (thinking, budget) that needs summaries: group gi, sample g, budget slot s, truncation length cut."""

    gi: int
    g: int
    s: int
    cut: int


def summary_requests(groups: list[Group], budgets: list[int]) -> list[Request]:
    """The (thinking, budget) pairs whose thinking did not end within the budget, in group, sample, budget order."""
    return [Request(gi, g, s, min(b, len(z.output_ids)))
            for gi, grp in enumerate(groups) for g, z in enumerate(grp.samples)
            for s, b in enumerate(budgets) if not ended_within(z, b)]


def budget_rewards(group: Group, budgets: list[int], drawn: dict[tuple[int, int], list[float]],
                   own_scores: list[float]) -> list[list[float]]:
    """R[g][s]: the mean score of thinking g's summaries at budget s (`drawn` by (g, s)), or g's own score
    (`own_scores`, the verifier's before length shaping) where it ended within b_s."""
    return [[own_scores[g] if ended_within(z, b) else sum(drawn[(g, s)]) / len(drawn[(g, s)])
             for s, b in enumerate(budgets)] for g, z in enumerate(group.samples)]


@dataclass
class AnytimeRollouts:
    """Rank 0: the summaries of one step (__call__), as stage anytime's options ask."""

    params: SamplingParams  # the run's sampling parameters; n becomes summaries, max_new_tokens summary_tokens
    options: AnytimeOptions
    trigger_ids: list[int]
    seed: int  # train.seed: the budget draws'
    step: int = 1  # the trainer step the next call belongs to (Run.generate sets it): the budget draws'

    def __call__(self, engine, groups: list[Group], reward_fn) -> tuple[list[Group], list[Group], dict, int]:
        """`groups` with their BudgetRewards, the summary groups (one per group with a summary), the metrics
        anytime/summaries, anytime/reward@<b> (the mean R at each budget) and anytime/score (Σ_s p_s mean R_s), and
        the tokens generated."""
        budgets, weights = step_budgets(self.options, self.seed, self.step)
        requests = summary_requests(groups, budgets)
        params = dataclasses.replace(self.params, n=self.options.summaries,
                                     max_new_tokens=self.options.summary_tokens)
        drawn = draw_summaries(engine, [groups[q.gi].samples[q.g] for q in requests],
                               [budgets[q.s] for q in requests], self.trigger_ids, params)
        scores = iter(reward_fn([(groups[q.gi].example, s) for q, samples in zip(requests, drawn) for s in samples]))
        per_request = [[next(scores) for _ in samples] for samples in drawn]
        out, extra = [], []
        for gi, grp in enumerate(groups):
            mine = [(q, samples, sc) for q, samples, sc in zip(requests, drawn, per_request) if q.gi == gi]
            own = grp.scores if grp.scores is not None else grp.rewards
            rewards = budget_rewards(grp, budgets, {(q.g, q.s): sc for q, _, sc in mine}, own)
            info = BudgetRewards(budgets, weights, rewards)
            out.append(dataclasses.replace(grp, anytime=info))
            if mine:
                extra.append(self._summary_group(grp, info, mine))
        return out, extra, self._metrics(out, budgets, weights, drawn), sum(
            len(s.output_ids) for samples in drawn for s in samples)

    @staticmethod
    def _summary_group(grp: Group, info: BudgetRewards, mine: list) -> Group:
        samples = [s for _, drawn, _ in mine for s in drawn]
        scores = [r for _, _, sc in mine for r in sc]
        slots = [(q.g, q.s, q.cut) for q, drawn, _ in mine for _ in drawn]
        return Group(grp.example, samples, scores, prompt_index=grp.prompt_index,
                     anytime=dataclasses.replace(info, slots=slots))

    @staticmethod
    def _metrics(groups: list[Group], budgets: list[int], weights: list[float], drawn: list) -> dict:
        r = torch.tensor([row for g in groups for row in g.anytime.rewards], dtype=torch.float64)
        mean = r.mean(0) if r.numel() else torch.zeros(len(budgets), dtype=torch.float64)
        out = {f"anytime/reward@{b}": float(m) for b, m in zip(budgets, mean)}
        out["anytime/score"] = float(sum(w * float(m) for w, m in zip(weights, mean)))
        out["anytime/summaries"] = float(sum(len(s) for s in drawn))
        out["anytime/budgets"] = float(len(budgets))
        return out


def anytime_token_advantages(groups: list[Group], n_summaries: int) -> list[torch.Tensor]:
    """Per sample in batch order, stage anytime's per-token advantages: a thinking's BRPO advantage of its segment,
    a summary's r − baseline on each of its tokens (megapo/algorithms/anytime.py)."""
    out: list[torch.Tensor] = []
    for grp in groups:
        info = grp.anytime
        if info is None:
            raise ValueError("anytime: a group without budget rewards (megapo/trainer/anytime.py sets them)")
        if info.slots is None:
            adv = brpo_advantages(torch.tensor(info.rewards, dtype=torch.float64),
                                  torch.tensor(info.weights, dtype=torch.float64))
            out.extend(thinking_token_advantages(len(z.output_ids), info.budgets, adv[g])
                       for g, z in enumerate(grp.samples))
            continue
        base = summary_baselines(info, grp.rewards, n_summaries)
        out.extend(torch.full((len(z.output_ids),), r - b, dtype=torch.float64)
                   for z, r, b in zip(grp.samples, grp.rewards, base))
    return out


def anytime_rollouts(cfg, tokenizer, params: SamplingParams) -> AnytimeRollouts | None:
    """Stage anytime's summaries for this run (rank 0), None when algorithm.stages has no anytime."""
    from megapo.trainer.anytime_config import stage_index, trigger_text
    from megapo.trainer.likelihood_reward import encode_text

    i = stage_index(cfg)
    if i is None:
        return None

    o = cfg.algorithm.pipeline()[i].options
    return AnytimeRollouts(params, o, encode_text(tokenizer, trigger_text(cfg, o)), cfg.train.seed)

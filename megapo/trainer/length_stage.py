"""The trainer's length-control stage: data.length_reward and data.group_filter on every sampling round.

After the verifier scores a round's groups, `LengthStage.apply` hands the methods of
megapo.algorithms.length one ScoredGroup per prompt (verifier rewards, correctness, lengths, truncation,
prompt key, difficulty), replaces each group's rewards by the shaped ones and keeps the responses the
filter keeps (groups may then differ in size). A length reward that reads steps (megapo/algorithms/step_length.py)
gets each response's step lengths, cut with the run's tokenizer, and where it asks, the end of its first correct
answer from the task's answer checker on each step's prefix (StepSplitter). data.overlong (DAPO's soft overlong
penalty) is the length reward dapo_overlong under its older spelling. The stage counts the batches it has shaped (its
`step`, the trainer step in sync mode) and its methods' state; both travel in the checkpoint
(`state_dict`) so a resumed run shapes as the unstopped one. A filter that drops whole groups (GroupFilter.drops_groups:
decs_curriculum) leaves them out of the round's groups, and one with an answer_delimiter() is handed the groups it
kept with each correct response's first correct answer (StepSplitter.answer_ends: token_length.first_correct_ends,
only on the kept groups' correct responses) and their steps; the trainer's train.seed seeds its random draws.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from megapo.algorithms.length import ScoredGroup, build_group_filter, build_length_reward, check_kept, check_shaped
from megapo.engines.base import AbortRule
from megapo.trainer.rewards import answer_checker

log = logging.getLogger(__name__)


def length_reward_of(data, budget: int):
    """The configured length reward: data.length_reward, or dapo_overlong from data.overlong, or None."""
    if data.overlong.enabled:
        return build_length_reward("dapo_overlong", {"max_len": budget, "cache_len": data.overlong.buffer,
                                                     "factor": data.overlong.penalty}, budget)
    return build_length_reward(data.length_reward, data.length_reward_options, budget)


class LengthStage:
    def __init__(self, cfg, state: dict | None = None, tokenizer=None):
        d, budget = cfg.data, cfg.rollout.max_new_tokens
        self.reward = length_reward_of(d, budget)
        self.filter = build_group_filter(d.group_filter, d.group_filter_options, budget)
        self.correct_threshold = d.correct_threshold
        self.steps = StepSplitter.of(self.reward, d, tokenizer)  # None: no method reads steps
        self.answers = StepSplitter.for_filter(self.filter, d, tokenizer)  # None: the filter observes nothing
        self.markers = MarkerFinder.for_filter(self.filter, tokenizer)  # None: the filter reads no answer marker
        if self.filter is not None:
            self.filter.seed = cfg.train.seed
        self.step = 0  # batches begun
        self._abort_path_logged = False
        if state:
            self.load_state_dict(state)

    def rollout_counts(self, examples: list, n_samples: int, prompt_ids: list | None = None) -> list[int] | None:
        """Each prompt's rollout count for the next round where the filter allocates them (duet), else None
        (rollout.n_samples each); `prompt_ids`: each prompt's token ids (duet's surrogate features reads them)."""
        from megapo.algorithms.stages import prompt_key

        if self.filter is None or not hasattr(self.filter, "allocate"):
            return None
        return self.filter.allocate([prompt_key(ex.prompt) for ex in examples], n_samples,
                                    [getattr(ex, "difficulty", None) for ex in examples], prompt_ids)

    def abort_params(self, engine, params, counts: list[int] | None):
        """`params` with the filter's in-engine abort rule for this round's sum(counts) rollouts (duet's
        abort_plan, as SamplingParams.abort) where the engine can stop a request on it (EngineCapabilities.abort_rule:
        the embedded engine), else `params` unchanged (the filter's select then aborts after generation, on the
        same draws). Logs once which path the run takes."""
        if counts is None or self.markers is None or not hasattr(self.filter, "abort_plan"):
            return params
        in_engine = engine.capabilities.abort_rule
        if not self._abort_path_logged:
            self._abort_path_logged = True
            log.info(
                "data.group_filter %s: the abort rule runs %s", type(self.filter).__name__,
                "in the engine (an aborted rollout stops at horizon + grace tokens)" if in_engine else
                "after generation (this engine cannot stop a request on a marker rule: rollouts run to their end)")
        if not in_engine:
            return params
        plan = self.filter.abort_plan(self.step, sum(counts))
        if plan is None:
            return params
        at, keep = plan
        return replace(params, abort=AbortRule(at, tuple(keep), self.markers.passes))

    def begin_batch(self) -> int:
        """A new step's batch starts (its rounds share the step number); returns that step."""
        self.step += 1
        return self.step

    def apply(self, groups: list) -> list:
        """Groups (trainer.rollout.Group, `rewards` as the verifier scored them) -> the same prompts with shaped
        rewards, the verifier's `scores` and `correct`, and only the kept responses."""
        from megapo.algorithms.stages import prompt_key
        from megapo.trainer.rollout import Group

        scored = [self.scored_group(g, prompt_key(g.example.prompt)) for g in groups]
        shaped = [s.rewards for s in scored]
        if self.reward is not None:
            shaped = check_shaped(scored, self.reward.shape(scored, self.step), "data.length_reward")
        kept = [torch.arange(s.size) for s in scored]
        weights = None
        if self.filter is not None:
            kept = check_kept(scored, self.filter.select(scored, self.step), "data.group_filter",
                              drops=self.filter.drops_groups)
            weights = getattr(self.filter, "weights", None)  # duet's importance weights, per group
            if self.answers is not None:
                self.filter.observe([self.answers.answer_ends(s, g) for g, s, k in zip(groups, scored, kept)
                                     if k.numel()], self.step)
        out = []
        for gi, (g, s, r, k) in enumerate(zip(groups, scored, shaped, kept)):
            idx = k.tolist()
            if not idx:  # the filter dropped the whole group
                continue
            out.append(Group(g.example, [g.samples[i] for i in idx], [float(r[i]) for i in idx],
                             scores=[float(s.rewards[i]) for i in idx], correct=[bool(s.correct[i]) for i in idx],
                             sampled=s.size, prompt_index=g.prompt_index, sample_ids=idx,
                             weights=[float(weights[gi][i]) for i in idx] if weights else None))
        return out

    def scored_group(self, g, key: str) -> ScoredGroup:
        rewards = torch.tensor(g.rewards, dtype=torch.float64)
        scored = ScoredGroup(key, getattr(g.example, "difficulty", None), rewards, rewards >= self.correct_threshold,
                             torch.tensor([len(s.output_ids) for s in g.samples], dtype=torch.int64),
                             torch.tensor([s.finish_reason != "stop" for s in g.samples]))
        scored = self.steps.split(scored, g) if self.steps is not None else scored
        return self.markers.find(scored, g) if self.markers is not None else scored

    def metrics(self) -> dict[str, float]:
        """The methods' own numbers (a dual variable, targets), under length/."""
        out = {}
        for method in (self.reward, self.filter):
            fn = getattr(method, "metrics", None)
            if fn is not None:
                out.update({f"length/{k}": float(v) for k, v in fn().items()})
        return out

    def state_dict(self) -> dict:
        return {"step": self.step,
                "length_reward": self.reward.state_dict() if self.reward is not None else {},
                "group_filter": self.filter.state_dict() if self.filter is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))
        for name, method in (("length_reward", self.reward), ("group_filter", self.filter)):
            saved = state.get(name, {})
            if method is not None:
                method.load_state_dict(saved)
            elif saved:
                raise ValueError(f"length state: the checkpoint holds data.{name} state but none is configured")



class StepSplitter:
    """The steps of each response for a length reward that reads them (LengthMethod.step_delimiter: cut where the
    decoded text completes the delimiter, megapo.algorithms.process_rewards.step_ends) and, for one that reads
    ScoredGroup.first_correct, the token count through the first step whose prefix the task's answer checker
    (data.reward, the task's when auto) scores >= data.correct_threshold."""

    def __init__(self, delimiter: str, tokenizer, checker=None, threshold: float = 0.0):
        self.delimiter, self.tokenizer, self.checker, self.threshold = delimiter, tokenizer, checker, threshold
        self.cache: dict = {}  # token id -> its text, shared across rounds

    @classmethod
    def of(cls, method, data, tokenizer) -> "StepSplitter | None":
        delimiter = method.step_delimiter() if method is not None else None
        if delimiter is None:
            return None
        if tokenizer is None:
            raise ValueError(f"data.length_reward: {data.length_reward} splits responses into steps and needs the "
                             "run's tokenizer")
        checker = answer_checker(data) if method.needs_first_correct else None
        return cls(delimiter, tokenizer, checker, data.correct_threshold)

    @classmethod
    def for_filter(cls, method, data, tokenizer) -> "StepSplitter | None":
        """For a group filter that observes its kept groups' answers (GroupFilter.answer_delimiter), else None."""
        delimiter = method.answer_delimiter() if method is not None else None
        if delimiter is None:
            return None
        if tokenizer is None:
            raise ValueError(f"data.group_filter: {data.group_filter} checks each correct response's step prefixes "
                             "for its answer and needs the run's tokenizer")
        return cls(delimiter, tokenizer, answer_checker(data), data.correct_threshold)

    def answer_ends(self, scored: ScoredGroup, g) -> ScoredGroup:
        """`scored` with first_correct (token_length.first_correct_ends: the correct responses only, −1 for the
        others) and step_lengths, both cut at this splitter's delimiter."""
        from dataclasses import replace

        from megapo.algorithms.process_rewards import step_ends, step_token_counts, token_texts
        from megapo.algorithms.token_length import first_correct_ends

        ids = [list(s.output_ids) for s in g.samples]
        first = first_correct_ends(ids, [g.example.answer] * len(ids), [bool(c) for c in scored.correct],
                                   self.tokenizer, self.checker, self.threshold, self.delimiter)
        steps = tuple(torch.tensor(step_token_counts(step_ends(token_texts(self.tokenizer, x, self.cache),
                                                                          self.delimiter)), dtype=torch.int64)
                      for x in ids)
        return replace(scored, step_lengths=steps, first_correct=torch.tensor(first, dtype=torch.int64))

    def split(self, scored: ScoredGroup, g) -> ScoredGroup:
        from dataclasses import replace

        from megapo.algorithms.process_rewards import first_accepted_end, step_ends, step_token_counts, token_texts

        texts = [token_texts(self.tokenizer, list(s.output_ids), self.cache) for s in g.samples]
        ends = [step_ends(t, self.delimiter) for t in texts]
        steps = tuple(torch.tensor(step_token_counts(e), dtype=torch.int64) for e in ends)
        first = None
        if self.checker is not None:
            answer = g.example.answer
            accept = lambda text: float(self.checker(text, answer)) >= self.threshold  # noqa: E731
            first = torch.tensor([first_accepted_end(t, e, accept, self.delimiter) for t, e in zip(texts, ends)],
                                 dtype=torch.int64)
        return replace(scored, step_lengths=steps, first_correct=first)


class MarkerFinder:
    """Where a group filter's answer marker (GroupFilter.marker: duet's abort rule) first appears in each response,
    in tokens (ScoredGroup.marker_end), from the run's tokenizer's per-token texts."""

    def __init__(self, marker: str, tokenizer):
        self.marker, self.tokenizer = marker, tokenizer
        self.cache: dict = {}  # token id -> its text, shared across rounds

    @classmethod
    def for_filter(cls, method, tokenizer) -> "MarkerFinder | None":
        marker = method.marker() if method is not None and hasattr(method, "marker") else None
        if marker is None:
            return None
        if tokenizer is None:
            raise ValueError("data.group_filter_options.marker: the abort rule finds the marker in each decoded "
                             "response and needs the run's tokenizer")
        return cls(marker, tokenizer)

    def find(self, scored: ScoredGroup, g) -> ScoredGroup:
        from dataclasses import replace

        from megapo.algorithms.duet import marker_end
        from megapo.algorithms.process_rewards import token_texts

        ends = [marker_end(token_texts(self.tokenizer, list(s.output_ids), self.cache), self.marker) for s in g.samples]
        return replace(scored, marker_end=torch.tensor(ends, dtype=torch.int64))

    def passes(self, ids: list[int]) -> bool:
        """Whether the response `ids` (output token ids) holds the marker, found as `find` finds it: the
        in-engine abort's check (megapo.engines.base.AbortRule.passes) on a rollout's first horizon + grace tokens."""
        from megapo.algorithms.duet import marker_end
        from megapo.algorithms.process_rewards import token_texts

        return marker_end(token_texts(self.tokenizer, list(ids), self.cache), self.marker) > 0

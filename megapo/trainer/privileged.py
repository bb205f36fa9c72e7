"""HDPO's privileged rollouts (stage hdpo, megapo/algorithms/self_distill.py), rank 0's side of a step.

After the step's groups are sampled and scored, every "cliff" group (all of its samples failed: the verifier's
verdict, Group.correct where the length stage set it, else score >= data.correct_threshold) gets one more engine
call on its prompt rewritten with the reference answer in `template` (x ⊕ c: self_teacher.with_context, the run's
prompt encoding). The correct responses are kept and re-attached to the ORIGINAL prompt's tokens x as one extra
Group (privileged=True) after the step's groups; the update trains them with advantage λ (hdpo).

What the engine returned for the hinted prompt is not the policy's behind x, so nothing of it reaches the learner:
the samples carry no routes (the learner's old-log-prob pass routes them freely behind x, under r2 and r3 alike, and
every train step replays those routes), and their engine log-probs (of x ⊕ c) are not μ: update.privileged_mu sets
their μ to the learner's π_old behind x (a mismatch correction then weighs them 1, and the mismatch metrics leave
them out). The kept responses' engine log-probs stay in Sample.logprobs: the teacher's log π(y_t | x ⊕ c, y_<t).

With dynamic sampling the cliff groups are the ones it dropped (every group of the step is looked at, not only the
kept ones); without it they stay in the batch too, with GRPO's zero advantage. collect_rollouts appends the
privileged groups (rollout.dp_whole: cut to a multiple of parallel.dp so every DP rank still gets whole groups).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from megapo.engines.base import Sample, SamplingParams
from megapo.trainer.rollout import Group
from megapo.trainer.self_teacher import with_context

STAGE = "hdpo"


def cliff_groups(groups: list[Group], threshold: float) -> list[int]:
    """Indices of the groups whose samples all failed ("cliff" prompts: GRPO's advantage is zero there)."""
    return [i for i, g in enumerate(groups) if g.samples and not any(g.verdicts(threshold))]


def privileged_prompt(example, template: str, encode: Callable) -> list[int]:
    """The prompt ids of x ⊕ c: `example` with its reference answer as the hint in `template`, through `encode`
    (an Example -> its prompt ids, the run's encoding)."""
    return list(encode(with_context(example, str(example.answer), template)))


def reattach(sample: Sample, prompt_ids: list[int]) -> Sample:
    """A privileged response behind the original prompt: no routes (they were the hinted prompt's)."""
    return dataclasses.replace(sample, prompt_ids=list(prompt_ids), routes=None)


@dataclass
class PrivilegedRollouts:
    """Rank 0: the privileged groups of one step (__call__), as stage hdpo's options ask."""

    params: SamplingParams  # the run's sampling parameters; n becomes max_privileged, no routes
    encode: Callable  # Example -> prompt ids (data.encode_example with the run's tokenizer and chat template)
    template: str
    max_privileged: int
    threshold: float  # data.correct_threshold

    def __call__(self, engine, groups: list[Group], reward_fn) -> tuple[list[Group], dict, int]:
        """The privileged groups for the cliff groups among `groups` (one engine call), the metrics
        hdpo/cliff_groups, hdpo/privileged_sampled, hdpo/privileged_kept, and the tokens generated."""
        cliff = [groups[i] for i in cliff_groups(groups, self.threshold)]
        metrics = {"hdpo/cliff_groups": float(len(cliff)), "hdpo/privileged_sampled": 0.0,
                   "hdpo/privileged_kept": 0.0}
        if not cliff:
            return [], metrics, 0
        params = dataclasses.replace(self.params, n=self.max_privileged, return_routes=False)
        drawn = engine.generate([privileged_prompt(g.example, self.template, self.encode) for g in cliff], params)
        scores = iter(reward_fn([(g.example, s) for g, samples in zip(cliff, drawn) for s in samples]))
        out = [kept for g, samples in zip(cliff, drawn)
               if (kept := self._kept(g, samples, [next(scores) for _ in samples])) is not None]
        metrics["hdpo/privileged_sampled"] = float(sum(len(s) for s in drawn))
        metrics["hdpo/privileged_kept"] = float(sum(len(g.samples) for g in out))
        return out, metrics, sum(len(s.output_ids) for samples in drawn for s in samples)

    def _kept(self, group: Group, samples: list[Sample], scores: list[float]) -> Group | None:
        """The correct ones of a cliff group's privileged responses as a Group behind its original prompt (None:
        none is correct)."""
        keep = [i for i, r in enumerate(scores) if r >= self.threshold]
        if not keep:
            return None
        prompt = group.samples[0].prompt_ids
        return Group(group.example, [reattach(samples[i], prompt) for i in keep], [scores[i] for i in keep],
                     correct=[True] * len(keep), sampled=len(samples), prompt_index=group.prompt_index,
                     sample_ids=keep, privileged=True)


def privileged_rollouts(cfg, tokenizer, params: SamplingParams) -> PrivilegedRollouts | None:
    """Stage hdpo's privileged rollouts for this run (rank 0), None when algorithm.stages has no hdpo."""
    stage = next((s for s in cfg.algorithm.pipeline() if s.name == STAGE), None)
    if stage is None:
        return None
    from megapo.trainer.data import encode_example

    o = stage.options
    return PrivilegedRollouts(params, lambda ex: encode_example(tokenizer, ex, cfg.data.chat_template), o.template,
                              o.max_privileged, cfg.data.correct_threshold)

"""The self-teacher input of the self-distillation stages (megapo/algorithms/self_distill.py): the policy's own
log-probs of each sampled response with a context c inserted into its prompt,

    self_teacher_logp[i][t] = log π_old(y_t | x ⊕ c, y_<t)

taken by one more learner forward of the train batch (learner.logprobs, as the old-log-prob pass; collective:
every rank builds the same sequences from the same groups and calls it), only when a stage in algorithm.stages
reads it (AlgorithmConfig.self_teacher). Each sequence is the re-encoded prompt x ⊕ c (the task's prompt text with
the hint, through the run's prompt encoding: megapo.trainer.data.encode_example) followed by the sampled response's
token ids, unchanged; the response's log-probs are read behind the new prompt.

The context c (the stages' `context` option, in their `template`): reference_answer, the task's reference answer
(Example.answer); best_sample, the group's highest-reward response, decoded. credit's baseline adds K forwards
of the batch: each response behind the prompts of the K next groups of the batch with its own hint
(contrast_teacher_logp, their mean). All of them go to the learner in one call.

Routing: the re-encoded sequences have other tokens at other positions than the ones the engine routed and the
old-log-prob pass recorded, so no recorded route fits them: this pass routes itself (free routing, nothing
replayed) under routing_replay r2 and r3 alike, and its routes are dropped (sample.routes, which every train step
replays, stay the old-log-prob pass's).
"""

from __future__ import annotations

import dataclasses

import torch

from megapo.algorithms.sample import TrainSample, as_train_samples
from megapo.algorithms.self_distill import TeacherInputs, TeacherSpec, hint_text


def group_hints(groups: list, context: str, decode) -> list[str]:
    """Each group's hint: its example's reference answer (reference_answer), or its highest-reward response (the
    first of a tie; best_sample) through `decode` (token ids -> text)."""
    if context == "reference_answer":
        return [str(g.example.answer) for g in groups]
    best = [max(range(len(g.rewards)), key=lambda i: (g.rewards[i], -i)) for g in groups]
    return [decode(list(g.samples[i].output_ids)) for g, i in zip(groups, best)]


def with_context(example, hint: str, template: str):
    """`example` with the hint in its prompt text (and in its last chat turn, where it has chat turns)."""
    meta = dict(example.meta)
    turns = meta.get("messages")
    if turns:
        turns = [dict(t) for t in turns]
        turns[-1]["content"] = hint_text(template, turns[-1]["content"], hint)
        meta["messages"] = turns
    return dataclasses.replace(example, prompt=hint_text(template, example.prompt, hint), meta=meta)


def freely_routed_logprobs(learner, sequences: list[list[int]], prompt_lens: list[int], with_entropy: bool = False):
    """learner.logprobs under free routing; with a route hook, the routes it recorded are dropped (collective). The
    forward of sequences no engine routed: this pass's and the likelihood reward's (megapo/trainer/
    likelihood_reward.py)."""
    if learner.route_hook is None:
        return learner.logprobs(sequences, with_entropy=with_entropy, prompt_lens=prompt_lens)
    from megapo.replay.modes import logprobs_with_routes

    out, _, _ = logprobs_with_routes(learner, sequences, None, with_entropy=with_entropy, prompt_lens=prompt_lens)
    return out


def self_teacher_pass(learner, batch: list[TrainSample], groups: list, spec: TeacherSpec, encode,
                      decode) -> TeacherInputs:
    """The self-teacher's per-response-token values of `batch` (the samples of `groups`, in order): one
    learner.logprobs call on (1 + K)·len(batch) sequences, K = min(spec.contrast, len(groups) − 1). `encode`: an
    Example -> its prompt ids (the run's prompt encoding); `decode`: response ids -> text (best_sample)."""
    batch = as_train_samples(batch)
    owner = [g for g, group in enumerate(groups) for _ in group.samples]
    if len(owner) != len(batch):
        raise ValueError(f"groups: {len(owner)} samples for a batch of {len(batch)}")
    hints = group_hints(groups, spec.context, decode)
    contrast = min(spec.contrast, len(groups) - 1)
    prompts: dict[tuple[int, int], list[int]] = {}  # (whose prompt, whose hint) -> ids

    def prompt(p: int, h: int) -> list[int]:
        if (p, h) not in prompts:
            prompts[(p, h)] = list(encode(with_context(groups[p].example, hints[h], spec.template)))
        return prompts[(p, h)]

    sequences, prompt_lens = [], []
    for k in range(contrast + 1):  # k = 0: the sample's own prompt; k >= 1: the k-th next group's, the same hint
        for g, sample in zip(owner, batch):
            ids = prompt((g + k) % len(groups), g)
            sequences.append(ids + list(sample.tokens[sample.prompt_len:]))
            prompt_lens.append(len(ids))
    out = freely_routed_logprobs(learner, sequences, prompt_lens, spec.entropy)
    logps, entropies = out if spec.entropy else (out, None)
    response = [torch.as_tensor(lp, dtype=torch.float64)[n - 1:] for lp, n in zip(logps, prompt_lens)]
    n = len(batch)
    mean = None
    if contrast:
        mean = [sum(response[k * n + i] for k in range(1, contrast + 1)) / contrast for i in range(n)]
    return TeacherInputs(
        logp=[r.tolist() for r in response[:n]],
        entropy=None if entropies is None else [torch.as_tensor(h, dtype=torch.float64)[p - 1:].tolist()
                                                for h, p in zip(entropies[:n], prompt_lens[:n])],
        contrast=None if mean is None else [m.tolist() for m in mean], contrast_inputs=contrast)

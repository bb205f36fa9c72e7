"""The multi-reward stages' inputs at the update (megapo/algorithms/multi_reward.py: gdpo, mrtpo), every rank alike.

reward_components: the task's verifier split into named rewards (Task.components, megapo.tasks.components) on each
kept sample's decoded response, in batch order, with the text each component checked it against. A response cut at
the length limit gets data.truncated_reward in every component, as the scalar reward does (None: its text is
scored). Computed from the groups the update trains on, so whatever the length stage, dynamic sampling or a group
filter kept is what is scored.

old_js_distance (collective): one learner call (Learner.response_js_distances) on each response y behind its prompt x
and behind x ⊕ c_k for every component k (c_k the component's verifier information in the stage's template, through
the run's prompt encoding, self_teacher.with_context), x ⊕ y packed with its K variants in one unit so that it is
forwarded once (one pass where the K + 1 sequences fit the micro-batch token budget, else a few), on the routes the
train steps replay for (x, y); x ⊕ c_k routes freely (no engine routed it).
"""

from __future__ import annotations

import torch

from megapo.algorithms.multi_reward import ComponentRewards
from megapo.envs.base import Trajectory


def response_text(sample, tokenizer) -> str:
    """The decoded response the verifier reads (the stop token removed), as the rollout's reward function does."""
    ids = sample.output_ids[:-1] if sample.finish_reason == "stop" else sample.output_ids
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def component_rewards(groups: list, verifier, tokenizer, truncated_reward: float | None) -> ComponentRewards:
    """Each kept sample's components (`verifier`: a megapo.tasks.components.ComponentVerifier), in batch order."""
    values, information = [], []
    for g in groups:
        for sample in g.samples:
            if isinstance(sample, Trajectory):
                raise ValueError("reward_components: multi-turn trajectories have no per-component verifier here")
            parts = verifier(g.example, response_text(sample, tokenizer))
            cut = sample.finish_reason != "stop" and truncated_reward is not None
            values.append([float(truncated_reward) if cut else p.value for p in parts])
            information.append([p.information for p in parts])
    return ComponentRewards(tuple(verifier.names), torch.tensor(values, dtype=torch.float64).reshape(
        len(values), len(verifier.names)), information)


def js_distances(learner, batch: list, groups: list, rewards: ComponentRewards, template: str, encode,
                 routes=None) -> list[torch.Tensor]:
    """Per sample [K, response tokens] float64: the JS distance at each response token between π_old behind x and
    behind x ⊕ c_k, every component in one learner call (Learner.response_js_distances, collective: x ⊕ y forwarded
    once beside its K variants). `encode`: an Example -> its prompt ids."""
    from megapo.trainer.self_teacher import with_context

    owners = [g for g in groups for _ in g.samples]
    if len(owners) != len(batch):
        raise ValueError(f"groups: {len(owners)} samples for a batch of {len(batch)}")
    sequences = [list(s.tokens) for s in batch]
    prompt_lens = [s.prompt_len for s in batch]
    prompts: dict[tuple[int, str], list[int]] = {}  # (group, information) -> the prompt ids of x ⊕ c
    contexts, context_lens = [], []
    for k in range(len(rewards.names)):
        context, lens = [], []
        for i, (g, s) in enumerate(zip(owners, batch)):
            key = (id(g), rewards.information[i][k])
            if key not in prompts:
                prompts[key] = list(encode(with_context(g.example, key[1], template)))
            context.append(prompts[key] + list(s.tokens[s.prompt_len:]))
            lens.append(len(prompts[key]))
        contexts.append(context)
        context_lens.append(lens)
    distances = learner.response_js_distances(sequences, prompt_lens, contexts, context_lens, routes=routes)
    return [torch.as_tensor(d, dtype=torch.float64) for d in distances]


def multi_reward_inputs(learner, batch: list, groups: list, cfg, tokenizer, reads: set, timer, routes=None) -> dict:
    """The pipeline.TokenContext fields components and js_distance where a stage reads reward_components /
    old_js_distance (update.advantage_stages), else {}; `routes`: those the train steps replay (None: route
    freely)."""
    if "reward_components" not in reads and "old_js_distance" not in reads:
        return {}
    from megapo.tasks.registry import get_task

    if tokenizer is None:
        raise ValueError("tokenizer: the multi-reward stages decode each response for the task's verifier; "
                         "update_policy needs the run's tokenizer")
    verifier = get_task(cfg.data.task, cfg.data.task_options).components if cfg.data.task else None
    if verifier is None:
        raise ValueError("reward_components: data.task gives no reward components (Task.components)")
    rewards = component_rewards(groups, verifier, tokenizer, cfg.data.truncated_reward)
    out = {"components": rewards}
    if "old_js_distance" in reads:
        from megapo.trainer.data import encode_example

        stage = next(s for s in cfg.algorithm.pipeline() if "old_js_distance" in s.inputs)
        with timer("js_distance"):
            out["js_distance"] = js_distances(learner, batch, groups, rewards, stage.options.template,
                                              lambda ex: encode_example(tokenizer, ex, cfg.data.chat_template),
                                              routes=routes)
    return out

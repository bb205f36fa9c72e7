"""The trainer's length-control stage: data.length_reward and data.group_filter on every sampling round.

After the verifier scores a round's groups, `LengthStage.apply` hands the methods of
megapo.algorithms.length one ScoredGroup per prompt (verifier rewards, correctness, lengths, truncation,
prompt key, difficulty), replaces each group's rewards by the shaped ones and keeps the responses the
filter keeps (groups may then differ in size). data.overlong (DAPO's soft overlong penalty) is the
length reward dapo_overlong under its older spelling. The stage counts the batches it has shaped (its
`step`, the trainer step in sync mode) and its methods' state; both travel in the checkpoint
(`state_dict`) so a resumed run shapes as the unstopped one.
"""

from __future__ import annotations

import torch

from megapo.algorithms.length import ScoredGroup, build_group_filter, build_length_reward, check_kept, check_shaped


def length_reward_of(data, budget: int):
    """The configured length reward: data.length_reward, or dapo_overlong from data.overlong, or None."""
    if data.overlong.enabled:
        return build_length_reward("dapo_overlong", {"max_len": budget, "cache_len": data.overlong.buffer,
                                                     "factor": data.overlong.penalty}, budget)
    return build_length_reward(data.length_reward, data.length_reward_options, budget)


class LengthStage:
    def __init__(self, cfg, state: dict | None = None):
        d, budget = cfg.data, cfg.rollout.max_new_tokens
        self.reward = length_reward_of(d, budget)
        self.filter = build_group_filter(d.group_filter, d.group_filter_options, budget)
        self.correct_threshold = d.correct_threshold
        self.step = 0  # batches begun
        if state:
            self.load_state_dict(state)

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
        if self.filter is not None:
            kept = check_kept(scored, self.filter.select(scored, self.step), "data.group_filter")
        out = []
        for g, s, r, k in zip(groups, scored, shaped, kept):
            idx = k.tolist()
            out.append(Group(g.example, [g.samples[i] for i in idx], [float(r[i]) for i in idx],
                             scores=[float(s.rewards[i]) for i in idx], correct=[bool(s.correct[i]) for i in idx],
                             sampled=s.size, prompt_index=g.prompt_index, sample_ids=idx))
        return out

    def scored_group(self, g, key: str) -> ScoredGroup:
        rewards = torch.tensor(g.rewards, dtype=torch.float64)
        return ScoredGroup(key, getattr(g.example, "difficulty", None), rewards, rewards >= self.correct_threshold,
                           torch.tensor([len(s.output_ids) for s in g.samples], dtype=torch.int64),
                           torch.tensor([s.finish_reason != "stop" for s in g.samples]))

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


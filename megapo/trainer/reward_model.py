"""A reward model in the loop (data.reward_model: path, coef): each sample's reward becomes

    r_i <- r_i + coef · RM(prompt_i + response_i)

before the advantages, where r_i is the verifier's (data.reward, after any length shaping) and RM is an HF
*ForSequenceClassification folder (one label, scored at the last token as transformers does) run as a frozen
Megatron ScoreModel (megapo/learner/score.py) under the learner's layout and precision. The Megatron model is
collective, so the scoring runs on every rank in the update (megapo.trainer.update.update_policy), not on rank 0's
rollout side; every rank holds the same groups and adds the same scores. data.reward still applies: for the reward
model alone, give a reward of 0 for every response (a "module:function" returning 0.0); data.dynamic_sampling and
the length stage read the verifier's rewards, before the reward model's scores are added.

Metrics: reward/model, the batch mean of the RM's scores (before coef); reward/with_model, the batch mean of the
rewards the advantages are computed from. The logged `reward` stays the verifier's.
"""

from __future__ import annotations


def build_reward_model(cfg):
    """The reward model as a frozen Megatron ScoreModel under the learner's layout and precision (collective)."""
    from megapo.learner.score import ScoreModel

    return ScoreModel(cfg.data.reward_model.path, cfg.parallel, seed=cfg.train.seed,
                      micro_batch_tokens=cfg.train.micro_batch_tokens, row_tokens=cfg.train.row_tokens,
                      precision=cfg.train.precision_spec(), field="data.reward_model.path")


def add_model_rewards(reward_model, groups: list, coef: float) -> dict:
    """g.rewards[i] += coef · score of prompt_ids + output_ids for every sample of every group, in place (every
    rank: the model is collective); the metrics reward/model and reward/with_model."""
    sequences = [list(s.prompt_ids) + list(s.output_ids) for g in groups for s in g.samples]
    if not sequences:
        return {}
    scores = iter(reward_model.scores(sequences))
    scored: list[float] = []
    for g in groups:
        extra = [next(scores) for _ in g.samples]
        scored.extend(extra)
        g.rewards = [r + coef * x for r, x in zip(g.rewards, extra)]
    combined = [r for g in groups for r in g.rewards]
    return {"reward/model": sum(scored) / len(scored), "reward/with_model": sum(combined) / len(combined)}

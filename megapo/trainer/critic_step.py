"""PPO with a critic in the step: GAE advantages from the critic's values, then the critic's own update.

    metrics = critic_advantages(critic, batch, rewards, cfg.algorithm.critic)   # every rank (collective)

The outcome reward of each sample sits on its last response token (the episode ends there: V after it is 0); the
policy's per-token advantages are GAE with λ_policy (VAPO's length-adaptive λ when `adaptive_alpha` > 0), the
critic's targets GAE returns with λ_critic (1: Monte-Carlo), both over the values the critic gave before its step
(megapo/algorithms/gae.py). Then one critic step on PPO's clipped value loss towards those returns.
"""

from __future__ import annotations

import torch

from megapo.algorithms.config import CRITIC_POLICY
from megapo.algorithms.gae import gae, length_adaptive_lambda
from megapo.algorithms.sample import TrainSample

CRITIC_DIR = "critic"  # the critic's Megatron checkpoint, beside learner/ in a trainer checkpoint


def build_critic(cfg, policy_dir):
    """The critic under the learner's layout and precision, its own optimizer (algorithm.critic.lr; the rest of
    optim's settings but its lr warm-up), replaying the policy's routes when it shares the policy's MoE shape (collective)."""
    import dataclasses

    from megapo.layout import read_hf_config
    from megapo.learner.critic import Critic
    from megapo.trainer.distill import same_moe_shape

    c = cfg.algorithm.critic
    path = policy_dir if c.path == CRITIC_POLICY else c.path
    replay = cfg.algorithm.routing_replay != "off" and same_moe_shape(read_hf_config(path), read_hf_config(policy_dir))
    # no lr warm-up: the critic's warm-up is its steps alone (algorithm.critic.warmup_steps), at full lr
    optim = dataclasses.replace(cfg.optim, lr=c.lr, min_lr=min(cfg.optim.min_lr, c.lr), warmup_steps=0)
    return Critic(path, cfg.parallel, optim, seed=cfg.train.seed, micro_batch_tokens=cfg.train.micro_batch_tokens,
                  row_tokens=cfg.train.row_tokens, total_steps=cfg.train.steps, routing_replay=replay,
                  precision=cfg.train.precision_spec())


def padded(rows: list, width: int) -> torch.Tensor:
    """[B, width] float64, each row right-padded with zeros."""
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.float64)
    return out


def outcome_rewards(rewards: list[float], lengths: list[int]) -> list[list[float]]:
    """Each sample's reward on its last response token, 0 on the others."""
    return [[0.0] * (n - 1) + [float(r)] for r, n in zip(rewards, lengths)]


def gae_targets(values: list[torch.Tensor], rewards: list[float], critic_cfg) -> tuple[list[list[float]], list[list[float]]]:
    """(policy advantages, critic returns) per response token of each sample."""
    lengths = [len(v) for v in values]
    width = max(lengths)
    mask = padded([[1.0] * n for n in lengths], width)
    v = padded([x.tolist() for x in values], width)
    r = padded(outcome_rewards(rewards, lengths), width)
    lam_policy = critic_cfg.lam_policy
    if critic_cfg.adaptive_alpha > 0:  # VAPO: longer responses keep more of their late reward
        lam_policy = length_adaptive_lambda(torch.tensor(lengths), critic_cfg.adaptive_alpha).clamp(0.0, 1.0)
    adv, _ = gae(r, v, mask, critic_cfg.gamma, lam_policy)
    _, returns = gae(r, v, mask, critic_cfg.gamma, critic_cfg.lam_critic)
    return ([a[:n].tolist() for a, n in zip(adv, lengths)], [x[:n].tolist() for x, n in zip(returns, lengths)])


def critic_advantages(critic, batch: list[TrainSample], rewards: list[float], critic_cfg) -> dict:
    """Set each sample's per-token advantage from GAE over the critic's values, then take the critic's step.
    Collective (the critic is a Megatron model on every rank)."""
    values = critic.values(batch)
    advantages, returns = gae_targets(values, rewards, critic_cfg)
    for sample, adv in zip(batch, advantages):
        sample.advantage = adv
    step = critic.train_step(batch, returns, [v.tolist() for v in values], clip=critic_cfg.value_clip)
    flat_v = torch.cat(values).double()
    flat_r = torch.tensor([x for row in returns for x in row], dtype=torch.float64)
    explained = 1.0 - float((flat_r - flat_v).var() / flat_r.var().clamp(min=1e-12))  # 1: values predict returns
    return {"critic/loss": step["loss"], "critic/values_mean": float(flat_v.mean()),
            "critic/returns_mean": float(flat_r.mean()), "critic/clip_frac": step.get("clip_frac", 0.0),
            "critic/grad_norm": step.get("grad_norm", float("nan")), "critic/explained_variance": explained}

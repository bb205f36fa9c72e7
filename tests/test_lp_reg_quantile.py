"""Lp-Reg's batch-global low-probability quantile (Huang et al. 2025, Low-probability Tokens Sustain Exploration in
Reinforcement Learning with Verifiable Reward, arXiv:2510.03222): the selection against a loop over the whole batch's
tokens, the loss's split invariance (4 micro-batches x 2 DP shards == one batch, the selection computed once over the
batch), a float64 finite-difference gradient, the trainer's glue (update.set_low_prob, the separate old-log-prob pass)
and the refusals naming what is missing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.objectives import low_prob_flags
from megapo.algorithms.sample import TrainSample
from megapo.algorithms.spec import LossSpec
from megapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_autograd_matches_fd  # noqa: E402


def ref_flags(old, adv, masks, neg, pos):
    """Per sample, per token: 1 where its advantage has sign s and π_old is among the ⌈ρ_s·n_s⌉ lowest of the batch's
    n_s policy tokens of sign s (the ρ_s-quantile δ_s, ties at δ_s included); a loop over the batch."""
    out = [[0.0] * len(o) for o in old]
    for sign, share in ((-1, neg), (1, pos)):
        tokens = [(i, t) for i in range(len(old)) for t in range(len(old[i]))
                  if masks[i][t] == 1 and adv[i][t] * sign > 0]
        if share <= 0 or not tokens:
            continue
        k = math.ceil(share * len(tokens))
        delta = sorted(old[i][t] for i, t in tokens)[k - 1]
        for i, t in tokens:
            if old[i][t] <= delta:
                out[i][t] = 1.0
    return out


def random_batch(seed, lengths=(5, 7, 3, 6, 4, 8, 2, 5)):
    gen = torch.Generator().manual_seed(seed)
    old = [(-torch.rand(n, generator=gen, dtype=torch.float64) * 4).tolist() for n in lengths]
    signs = [1.0, -1.0, -0.5, 0.7, -1.2, 0.0, 0.9, -0.3]
    adv = [[signs[i % len(signs)]] * n for i, n in enumerate(lengths)]
    adv[3] = [(-1.0) ** t * 0.5 for t in range(lengths[3])]  # an earlier token stage's per-token advantages
    masks = [[1] * n for n in lengths]
    masks[1][2] = masks[5][0] = 0  # observation tokens: never selected, never counted
    return old, adv, masks


def test_flags_are_the_batch_quantile_per_sign():
    old, adv, masks = random_batch(0)
    old[4][1] = old[0][2] = old[1][0]  # a tie
    for neg, pos in ((0.25, 0.0), (0.1, 0.4), (1.0, 1.0), (0.0, 0.0)):
        got = low_prob_flags(old, adv, masks, neg, pos)
        want = ref_flags(old, adv, masks, neg, pos)
        assert [g.tolist() for g in got] == want
    # scalar advantages and no loss_mask read as every token the policy's
    lengths = [len(o) for o in old]
    got = low_prob_flags(old, [a[0] for a in adv], None, 0.3, 0.2)
    want = ref_flags(old, [[a[0]] * n for a, n in zip(adv, lengths)], [[1] * n for n in lengths], 0.3, 0.2)
    assert [g.tolist() for g in got] == want


def padded(rows, width):
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.float64)
    return out


def batch_tensors(seed):
    old, adv, masks = random_batch(seed)
    width = max(len(o) for o in old)
    gen = torch.Generator().manual_seed(seed + 1)
    o = padded(old, width)
    logp = o + torch.randn(o.shape, generator=gen, dtype=torch.float64) * 0.3
    proxy = o + torch.rand(o.shape, generator=gen, dtype=torch.float64) * 0.5  # q > π_old: sparks where selected
    mask = padded(masks, width) > 0.5
    flags = padded([f.tolist() for f in low_prob_flags(old, adv, masks, 0.3, 0.2)], width)
    return logp, o, padded(adv, width), mask, proxy, flags


def test_loss_is_split_invariant_with_the_batch_quantile():
    """The selection computed once over the batch: 4 micro-batches x 2 DP shards of it sum to the one-batch loss
    (token-mean with the batch's global token count), to 1e-12."""
    logp, old, adv, mask, proxy, flags = batch_tensors(3)
    spec = LossSpec("lp_reg", objective_options=dict(neg_fraction=0.3, pos_fraction=0.2, eps_low=0.2, eps_high=0.2))
    n = int(mask.sum())
    whole, _ = policy_loss(spec, logp, old, adv, mask, proxy_logp=proxy, low_prob=flags, global_tokens=n)
    parts = 0.0
    for rank in range(2):  # DP shards: alternate samples; each cut into 4 micro-batches
        rows = list(range(rank, logp.shape[0], 2))
        for micro in (rows[j::4] for j in range(4)):
            if micro:
                idx = torch.tensor(micro)
                part, _ = policy_loss(spec, logp[idx], old[idx], adv[idx], mask[idx], proxy_logp=proxy[idx],
                                      low_prob=flags[idx], global_tokens=n)
                parts = parts + part
    assert abs(float(parts) - float(whole)) < 1e-12
    # the selection matters: without it the loss is another one (the example has sparks)
    none, _ = policy_loss(spec, logp, old, adv, mask, proxy_logp=proxy, low_prob=torch.zeros_like(flags),
                          global_tokens=n)
    assert abs(float(none) - float(whole)) > 1e-6


def test_loss_gradient_matches_float64_finite_differences():
    logp, old, adv, mask, proxy, flags = batch_tensors(5)
    spec = LossSpec("lp_reg", objective_options=dict(neg_fraction=0.3, pos_fraction=0.2, eps_low=0.2, eps_high=0.2))

    def loss(x):
        return policy_loss(spec, x, old, adv, mask, proxy_logp=proxy, low_prob=flags)[0]

    assert_autograd_matches_fd(loss, logp, mask)


def test_the_trainer_sets_the_flags_over_the_whole_batch_and_takes_the_separate_pass():
    from megapo.trainer.update import on_policy, reads_low_prob, set_low_prob

    old, adv, masks = random_batch(7)
    batch = [TrainSample([1, 2] + [3] * len(o), 2, a, old_logp=o, loss_mask=m) for o, a, m in zip(old, adv, masks)]
    cfg = make_cfg(objective="lp_reg", objective_options={"neg_fraction": 0.3, "pos_fraction": 0.2})
    spec = cfg.loss_spec()
    assert reads_low_prob(cfg) and reads_low_prob(spec) and not reads_low_prob(make_cfg(objective="ppo"))
    metrics = set_low_prob(batch, spec)
    want = ref_flags(old, adv, masks, 0.3, 0.2)
    assert [s.low_prob for s in batch] == want
    assert metrics["lp_reg/low_prob_frac"] == pytest.approx(sum(map(sum, want)) / sum(map(len, want)))

    class FusedLearner:  # would take the fused on-policy step for any other objective
        def train_step_on_policy(self, batch, loss, *, keep_logprobs=False, keep_entropy=False):
            raise AssertionError

    ppo = make_cfg(objective="ppo")
    for c in (cfg, ppo):  # one update on one mini-batch, π_old the learner's: ppo fuses the old-log-prob pass
        c.train.mini_batches = c.train.updates_per_rollout = 1
        c.algorithm.old_policy = "learner"
    assert on_policy(ppo, FusedLearner()) and not on_policy(cfg, FusedLearner())


def test_refusals_name_what_is_missing():
    x = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="^low_prob: required by objective 'lp_reg'"):
        policy_loss("lp_reg", x, x, x, torch.ones(1, 2, dtype=torch.bool), proxy_logp=x)
    with pytest.raises(ConfigError) as err:
        make_cfg(objective="lp_reg", objective_options={"neg_fraction": 1.5})
    assert err.value.field == "algorithm.objective_options" and "neg_fraction" in str(err.value)
    with pytest.raises(ValueError, match=r"^old_logp\[1\]"):
        low_prob_flags([[0.0], None], [1.0, -1.0], None, 0.5, 0.5)

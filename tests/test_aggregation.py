"""Loss aggregation: formulas written out here, and the gradient's independence from how a batch
is split into micro-batches / DP ranks when global_tokens / global_seqs are given."""

from __future__ import annotations

import random

import pytest
import torch

from megapo.algorithms import policy_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_batch(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        lp = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.05
        old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.2
        adv = torch.full((n,), float(torch.randn(1, generator=g)), dtype=torch.float64)
        seqs.append((lp, old, adv))
    return seqs


def as_padded(seqs, width):
    B = len(seqs)
    out = [torch.zeros(B, width, dtype=torch.float64) for _ in range(3)]
    mask = torch.zeros(B, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = s[0].numel()
        for k in range(3):
            out[k][i, :n] = s[k]
        mask[i, :n] = True
    return out, mask, None


def as_packed(seqs):
    cat = [torch.cat([s[k] for s in seqs]) for k in range(3)]
    cu = torch.tensor([0] + [s[0].numel() for s in seqs]).cumsum(0)
    return cat, torch.ones_like(cat[0], dtype=torch.bool), cu


def grads_per_seq(name, agg, seqs, form, **kw):
    """Loss and list of per-sequence gradients (valid tokens) for one shard."""
    (lp, old, adv), mask, cu = form(seqs)
    lp = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(name, lp, old, adv, mask, cu_seqlens=cu, loss_agg=agg, **kw)
    loss.backward()
    out = []
    if cu is None:
        for i, s in enumerate(seqs):
            out.append(lp.grad[i, : s[0].numel()])
    else:
        for i in range(len(seqs)):
            out.append(lp.grad[cu[i] : cu[i + 1]])
    return loss, out


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "vespo", "sapo"])
@pytest.mark.parametrize("agg", AGGS)
def test_split_invariance(name, agg):
    lengths = [3, 7, 1, 5, 2, 6, 4]
    seqs = make_batch(0, lengths)
    opts = {"max_len": 8} if agg.endswith("norm") else {}
    if name == "gspo":
        opts.update(eps_low=0.05, eps_high=0.05)
    full_loss, full_grads = grads_per_seq(name, agg, seqs, lambda s: as_padded(s, 9), **opts)
    glob = dict(global_tokens=sum(lengths), global_seqs=len(lengths))
    # 3 DP ranks x uneven micro-batches, mixed padded (various widths) and packed forms
    shards = [seqs[0:1], seqs[1:3], seqs[3:4], seqs[4:7]]
    forms = [lambda s: as_padded(s, 3), as_packed, lambda s: as_padded(s, 11), as_packed]
    total, grads = 0.0, []
    for shard, form in zip(shards, forms):
        loss, g = grads_per_seq(name, agg, shard, form, **glob, **opts)
        total += loss.item()
        grads += g
    assert total == pytest.approx(full_loss.item(), rel=1e-12, abs=1e-14)
    for g_full, g_split in zip(full_grads, grads):
        assert torch.allclose(g_full, g_split, rtol=1e-12, atol=1e-15)
    # without the global counts, shards normalise locally and the sum differs (the test can fail)
    local = sum(grads_per_seq(name, agg, sh, f, **opts)[0].item() for sh, f in zip(shards, forms))
    assert local != pytest.approx(full_loss.item(), rel=1e-6)


def test_aggregation_formulas_and_empty_rows():
    """An all-masked row is not a sequence: it adds no tokens and is not counted."""
    seqs = make_batch(1, [3, 2, 4])
    (lp, old, adv), mask, _ = as_padded(seqs, 5)
    lp = torch.cat([lp, torch.zeros(1, 5, dtype=torch.float64)])
    old = torch.cat([old, torch.zeros(1, 5, dtype=torch.float64)])
    adv = torch.cat([adv, torch.zeros(1, 5, dtype=torch.float64)])
    mask = torch.cat([mask, torch.zeros(1, 5, dtype=torch.bool)])
    per_tok = [[-a * l for l, a in zip(s[0].tolist(), s[2].tolist())] for s in seqs]
    expect = {
        "token-mean": sum(map(sum, per_tok)) / 9,
        "seq-mean-token-mean": sum(sum(x) / len(x) for x in per_tok) / 3,
        "seq-mean-token-sum": sum(map(sum, per_tok)) / 3,
        "seq-mean-token-sum-norm": sum(map(sum, per_tok)) / (10 * 3),
    }
    for agg, value in expect.items():
        loss, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg=agg, max_len=10)
        assert loss.item() == pytest.approx(value, rel=1e-12), agg


def test_global_counts_scale_the_loss():
    seqs = make_batch(2, [2, 3])
    (lp, old, adv), mask, _ = as_padded(seqs, 3)
    base, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="token-mean")
    scaled, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="token-mean", global_tokens=50)
    assert scaled.item() == pytest.approx(base.item() * 5 / 50)
    base, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="seq-mean-token-sum")
    scaled, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="seq-mean-token-sum", global_seqs=8)
    assert scaled.item() == pytest.approx(base.item() * 2 / 8)


# The aggregation each objective's paper uses (what loss_agg "auto", the config's default, must pick):
# GSPO, GSPO-token, GMPO and SAPO average per sequence (1/G Σ_i 1/|y_i| Σ_t), VESPO sums a sequence's
# tokens (Σ_t log π per sequence), CISPO normalises by all tokens; the rest take DAPO's token mean.
PAPER_AGG = {"gspo": "seq-mean-token-mean", "gspo_token": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean",
             "sapo": "seq-mean-token-mean", "vespo": "seq-mean-token-sum", "cispo": "token-mean", "ppo": "token-mean",
             "ctpo": "token-mean", "minirl": "token-mean", "reinforce": "token-mean",
             # trust_region.py: the abstracts do not name one; sequence-ratio methods follow GSPO
             "dhpo": "seq-mean-token-mean", "sspo": "seq-mean-token-mean", "holder": "seq-mean-token-mean",
             "minpro": "token-mean",
             "dppo": "token-mean", "cppo": "token-mean", "cppo_prefix_mean": "token-mean", "kpo": "token-mean",
             "aspo": "token-mean",
             # issue 32: FIPO and DGPO on DAPO's scaffold, the search agents' SAPO on GRPO's
             "fipo": "token-mean", "dgpo": "token-mean", "search_sapo": "seq-mean-token-mean",
             # ratio_gating.py: S-PPO / ST-PPO on PPO's token mean, FiberPO's trajectories weighted equally
             "s_ppo": "token-mean", "st_ppo": "token-mean", "fiberpo": "seq-mean-token-mean",
             # plackett_luce.py: HAEPO's sum over trajectories, as a mean over them
             "haepo": "seq-mean-token-mean",
             # SimKO's released code: PPO's masked mean over all tokens
             "simko": "token-mean",
             # Lp-Reg's released recipes: loss_agg_mode token-mean
             "lp_reg": "token-mean",
             # RLPT: the abstract names none, DAPO's token mean
             "rlpt": "token-mean"}


def test_each_objective_defaults_to_its_papers_aggregation():
    from megapo.algorithms import entries
    from megapo.trainer.config import AlgorithmConfig

    assert {e.name: e.loss_agg for e in entries("objective")} == PAPER_AGG
    assert AlgorithmConfig().loss_agg == "auto"  # a config that does not say gets the objective's own
    seqs = make_batch(3, [2, 6, 3])
    (lp, old, adv), mask, _ = as_padded(seqs, 6)
    tau_pos, tau_neg = 1.0, 1.05  # SAPO's defaults
    per_tok = []
    for l, o, a in seqs:
        tau = tau_pos if a[0] > 0 else tau_neg
        per_tok.append([-(torch.sigmoid(tau * (torch.exp(x - y) - 1)) * 4 / tau).item() * a[0].item()
                        for x, y in zip(l, o)])
    seq_mean = sum(sum(t) / len(t) for t in per_tok) / len(per_tok)
    token_mean = sum(map(sum, per_tok)) / sum(map(len, per_tok))
    for agg in (None, "auto"):
        kw = {} if agg is None else {"loss_agg": agg}
        loss, _ = policy_loss("sapo", lp, old, adv, mask, **kw)
        assert loss.item() == pytest.approx(seq_mean, rel=1e-12)
    assert seq_mean != pytest.approx(token_mean, rel=1e-3)  # unequal lengths: the two conventions differ
    loss, _ = policy_loss("sapo", lp, old, adv, mask, loss_agg="token-mean")  # still overridable
    assert loss.item() == pytest.approx(token_mean, rel=1e-12)
    # GSPO: one clipped value per sequence, averaged over sequences
    eps_low, eps_high = 3e-4, 4e-4
    per_seq = []
    for l, o, a in seqs:
        s = torch.exp((l - o).mean()).item()
        A = a[0].item()
        per_seq.append(max(-A * s, -A * min(max(s, 1 - eps_low), 1 + eps_high)))
    loss, _ = policy_loss("gspo", lp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-12)

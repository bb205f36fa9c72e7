"""HAPO (Liu et al. 2025, From Uniform to Heterogeneous: Tailoring Policy Optimization to Every Token's Nature,
arXiv:2509.16591): ppo's clip_mode hapo, its Asymmetric Adaptive Clipping and Differential Advantage Redistribution
as the authors' released code, on π_old's entropy scored over the whole batch. Against the formulas written out as
loops here (the authors' compute_entropy_h / ada_clip / ada_advantage, with the low-entropy side kept negative),
float64 finite differences, the 4 micro-batches x 2 DP shards split, refusals naming the field, and the trainer's
plumbing (the separate old-log-prob pass keeps π_old's entropy; the scores are set before the update)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.objectives import hapo_entropy_scores

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from objective_loops import F64, check_split_sums, clip, fd_grad, padded, token_mean  # noqa: E402


def scores_loop(entropies, masks, pivot, eps=1e-8):
    logs = [math.log(max(e, eps)) for ent, m in zip(entropies, masks) for e, k in zip(ent, m) if k]
    ordered = sorted(logs)
    centre = ordered[round(pivot * (len(logs) - 1))]
    rms = math.sqrt(max(sum((x - centre) ** 2 for x in logs) / len(logs), eps))
    zs = [(x - centre) / rms for x in logs]
    top, bottom = max(max(zs), eps), min(min(zs), -eps)
    out = []
    for ent, m in zip(entropies, masks):
        row = []
        for e, k in zip(ent, m):
            z = (math.log(max(e, eps)) - centre) / rms
            row.append(0.0 if not k else (z / top if z > 0 else z / -bottom))
        out.append(row)
    return out


def test_entropy_scores_are_the_authors_statistics_over_the_batchs_policy_tokens():
    rng = random.Random(0)
    entropies = [[rng.uniform(0.0, 3.0) for _ in range(n)] for n in (5, 3, 7, 1)]
    entropies[1][0] = 0.0  # clamped at eps before the log
    masks = [[1] * len(e) for e in entropies]
    masks[2][3] = 0  # an observation token: out of the statistics, score 0
    for pivot in (0.5, 0.3, 0.0, 1.0):
        got = hapo_entropy_scores(entropies, masks, pivot)
        want = scores_loop(entropies, masks, pivot)
        for g, w in zip(got, want):
            assert g.tolist() == pytest.approx(w, rel=1e-12, abs=1e-12)
        flat = torch.cat(got)
        assert flat.max().item() == pytest.approx(1.0 if pivot < 1 else 0.0)  # each side scaled to reach 1 in size
        assert flat.min().item() == pytest.approx(-1.0 if pivot > 0 else 0.0)
        assert got[2][3].item() == 0.0
    assert min(torch.cat(hapo_entropy_scores(entropies, None, 0.5)).tolist()) == pytest.approx(-1.0)


def ppo_hapo_loop(seqs, eps_low, eps_high, alpha, beta, adaptive, lp_of, frozen_of):
    """token-mean of max(-A'·r, -A'·clip(r, 1 - ε_low,t, 1 + ε_high,t)) with the authors' ada_clip / ada_advantage;
    frozen_of(j): the ratio the advantage's branch is chosen with (no gradient through the choice)."""
    rows = []
    for j, s in enumerate(seqs):
        row = []
        for t, (lp, old, a, h) in enumerate(zip(lp_of(j), s["old"], s["adv"], s["h"])):
            low = eps_low * (1 - alpha * h) if h <= 0 else eps_low
            high = eps_high * (1 + alpha * h) if h > 0 else eps_high
            if adaptive:
                r0 = math.exp(frozen_of(j)[t] - old)
                neutral = 1 - low / 2 < r0 < 1 + high / 2
                spread = a * (1 + beta * h)
                a = (a if neutral else spread) if h > 0 else (spread if neutral else a)
            r = math.exp(lp - old)
            row.append(max(-a * r, -a * clip(r, 1 - low, 1 + high)))
        rows.append(row)
    return token_mean(rows)


def make_seqs(seed=1, count=8):
    rng = random.Random(seed)
    seqs = []
    for n in [rng.randint(2, 6) for _ in range(count)]:
        old = [math.log(rng.uniform(0.05, 0.95)) for _ in range(n)]
        seqs.append({"old": old, "lp": [o + rng.uniform(-0.5, 0.5) for o in old],
                     "adv": [rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0)] * n,
                     "h": [rng.uniform(-1.0, 1.0) for _ in range(n)]})
    return seqs


def call(name, p, x, **kw):
    return policy_loss(name, x, p["old"], p["adv"], p["mask"], entropy_score=p["h"], **kw)


@pytest.mark.parametrize("opts", [{}, {"clip_alpha": 0.5, "adv_beta": 2.0}, {"adaptive_advantage": False},
                                  {"eps_low": 0.3, "eps_high": 0.1, "clip_alpha": 3.0}])
def test_ppo_hapo_loss_and_gradient_equal_the_loop(opts):
    seqs = make_seqs()
    o = {"eps_low": 0.2, "eps_high": 0.2, "clip_alpha": 1.0, "adv_beta": 1.0, "adaptive_advantage": True, **opts}
    p = padded(seqs, ("lp", "old", "adv", "h"))
    x = p["lp"].clone().requires_grad_(True)
    loss, _ = call("ppo", p, x, loss_agg="token-mean", clip_mode="hapo", **opts)
    loss.backward()
    want = ppo_hapo_loop(seqs, o["eps_low"], o["eps_high"], o["clip_alpha"], o["adv_beta"], o["adaptive_advantage"],
                         lambda j: seqs[j]["lp"], lambda j: seqs[j]["lp"])
    assert loss.item() == pytest.approx(want, rel=1e-12)
    fd = fd_grad(lambda lp_of, frozen_of: ppo_hapo_loop(seqs, o["eps_low"], o["eps_high"], o["clip_alpha"],
                                                        o["adv_beta"], o["adaptive_advantage"], lp_of, frozen_of), seqs)
    for i, row in enumerate(fd):
        assert x.grad[i, : len(row)].tolist() == pytest.approx(row, rel=1e-6, abs=1e-9)


def test_ppo_hapo_redistributes_by_entropy_side_and_band():
    # one token per case, ε 0.2, α = β = 1: inside the band (r = 1) a high-entropy token keeps A, a low-entropy one
    # takes A(1 + βĥ); outside it (r = 1.5 > 1 + ε_high,t / 2), the other way round
    def loss_of(h, lp):
        p = {"old": torch.zeros(1, 1, dtype=F64), "adv": torch.ones(1, 1, dtype=F64),
             "mask": torch.ones(1, 1, dtype=torch.bool), "h": torch.full((1, 1), h, dtype=F64)}
        return call("ppo", p, torch.full((1, 1), lp, dtype=F64), clip_mode="hapo", loss_agg="token-mean")[0].item()
    assert loss_of(0.5, 0.0) == pytest.approx(-1.0)  # high entropy, in the band: A
    assert loss_of(-0.5, 0.0) == pytest.approx(-0.5)  # low entropy, in the band: A(1 - 0.5)
    r = 1.5  # outside the band: high entropy A(1 + 0.5) with its bound 1 + 0.2·1.5 = 1.3; low entropy A, bound 1.2
    assert loss_of(0.5, math.log(r)) == pytest.approx(-1.5 * 1.3)
    assert loss_of(-0.5, math.log(r)) == pytest.approx(-1.2)


def test_ppo_hapo_split_over_micro_batches_and_ranks_sums_to_the_batch():
    check_split_sums(call, "ppo", make_seqs(seed=3), lambda s, width=None: padded(s, ("lp", "old", "adv", "h"), width),
                     {"clip_mode": "hapo"})


@pytest.mark.parametrize("opts, field", [({"clip_alpha": -1.0}, "clip_alpha"), ({"adv_beta": float("nan")}, "adv_beta"),
                                         ({"entropy_pivot": 1.5}, "entropy_pivot"),
                                         ({"adaptive_advantage": "sometimes"}, "adaptive_advantage")])
def test_bad_hapo_options_refused_naming_the_field(opts, field, tmp_path, tiny_moe):
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    seqs = make_seqs()
    p = padded(seqs, ("lp", "old", "adv", "h"))
    with pytest.raises(ValueError, match=field):
        call("ppo", p, p["lp"], clip_mode="hapo", **opts)
    overrides = ", ".join(f"{k}: {v}" for k, v in {"clip_mode": "hapo", **opts}.items())
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition", "algorithm.objective=ppo",
                                      f"algorithm.objective_options={{{overrides}}}",
                                      f"train.output_dir={tmp_path / 'run'}"])
    assert err.value.field.startswith("algorithm.objective_options") and field in str(err.value)
    with pytest.raises(ValueError, match="entropy_score"):
        policy_loss("ppo", p["lp"], p["old"], p["adv"], p["mask"], clip_mode="hapo")


def test_the_trainer_keeps_pi_old_entropy_and_scores_it_before_the_update(tmp_path, tiny_moe):
    from megapo.algorithms.sample import as_train_samples
    from megapo.config import load_config
    from megapo.trainer.config import RunConfig
    from megapo.trainer.update import on_policy, set_entropy_scores

    cfg = load_config(RunConfig, None, [f"model.path={tiny_moe}", "data.task=addition", "algorithm.objective=ppo",
                                        "algorithm.objective_options={clip_mode: hapo}",
                                        f"train.output_dir={tmp_path / 'run'}"])
    assert cfg.algorithm.needs_old_entropy()
    assert not on_policy(cfg, object())  # the separate pass: the scores need π_old before the loss
    rng = random.Random(5)
    batch = [{"tokens": [1] * (3 + n), "prompt_len": 3, "advantage": 1.0, "old_logp": [-1.0] * n,
              "old_entropy": [rng.uniform(0.1, 2.0) for _ in range(n)]} for n in (2, 4, 3)]
    metrics = set_entropy_scores(batch, cfg.loss_spec())
    want = scores_loop([b["old_entropy"] for b in batch], [[1] * len(b["old_entropy"]) for b in batch], 0.5)
    for b, w in zip(batch, want):
        assert b["entropy_score"] == pytest.approx(w, rel=1e-12)
    assert metrics["hapo/high_entropy_frac"] == pytest.approx(sum(x > 0 for row in want for x in row) / 9)
    bare = [dict(b, old_entropy=None) for b in batch]
    with pytest.raises(ValueError, match="old_entropy"):
        set_entropy_scores(as_train_samples(bare), cfg.loss_spec())


def test_one_training_step_with_clip_mode_hapo(tmp_path, tiny_moe):
    """The Megatron learner's train step reads entropy_score as a per-token column (the plumbing end to end)."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "hapo", f"model.path={tiny_moe}", "train.steps=1", "algorithm.objective=ppo",
                      "algorithm.objective_options={clip_mode: hapo}", "algorithm.advantage=hapo_tga")
    assert rows[0]["step"] == 1 and math.isfinite(rows[0]["train/loss"])
    assert 0 < rows[0]["hapo/high_entropy_frac"] < 1, sorted(rows[0])

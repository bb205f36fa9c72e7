"""FIPO (Ma et al. 2026, FIPO: Eliciting Deep Reasoning with Future-KL Influenced Policy Optimization, arXiv:2603.19835).

The objective `fipo` (megapo/algorithms/objectives.py, algorithm.objective=fipo): the paper's Δ = log π_θ − log π_old
inside the update, against a loop written out from its formula in float64, with finite-difference gradients.

The stage `future_drift` (megapo/algorithms/stages.py, algorithm.stages [{name: future_drift}]; called fipo until
issue 32, a name that now refuses naming it): FIPO's weight on π_old's drift from π_ref (or μ) before the update,
against a loop, each option's effect, through policy_loss with a float64 finite-difference gradient, bad options
refused at config time naming the field, and the loop's wiring (which log-probs it reads, the reference it loads).
No split-invariance check: the weight of a token reads only its own response."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.stages import token_advantages

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402

config_data = partial(algorithm_configs.config_data, n_samples=2)
make_cfg = partial(algorithm_configs.make_cfg, n_samples=2)

F64 = torch.float64


def rand_lists(seed, lengths, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(-torch.rand(n, generator=g, dtype=F64) * scale).tolist() for n in lengths]


def future_drift_reference(adv, old, other, half_life, clip, high_only):
    gamma = 1.0 if half_life is None else 2.0 ** (-1.0 / half_life)
    out = []
    for a, lp, ot in zip(adv, old, other):
        row = []
        for t in range(len(lp)):
            future = sum(gamma ** (s - t) * (lp[s] - ot[s]) for s in range(t, len(lp)))
            lo = 1.0 if high_only else 1.0 - clip
            row.append(a * min(max(math.exp(future), lo), 1.0 + clip))
        out.append(row)
    return out


@pytest.mark.parametrize("against, half_life, clip, high_only", [
    ("reference", 32.0, 0.2, True), ("reference", 2.0, 0.5, False), ("engine", 1.0, 0.3, False),
    ("reference", None, 0.9, False),
])
def test_future_drift_against_a_loop(against, half_life, clip, high_only):
    lengths = [3, 7, 1, 5, 4, 2]
    old, other = rand_lists(0, lengths), rand_lists(1, lengths)
    adv = torch.tensor([0.9, -0.4, 1.3, -1.1, 0.0, 0.6], dtype=F64)
    field = {"reference": "ref_logp", "engine": "rollout_logp"}[against]
    got = token_advantages("future_drift", adv, old, None, group_size=3, **{field: other}, against=against,
                           half_life=half_life, clip=clip, clip_high_only=high_only)
    want = future_drift_reference(adv.tolist(), old, other, half_life, clip, high_only)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, rel=1e-12, abs=1e-15)
    flat = torch.cat(got) / torch.cat([torch.full((n,), a, dtype=F64) for a, n in zip(adv.tolist(), lengths)])
    weights = flat[torch.isfinite(flat)]
    assert not torch.allclose(weights, torch.ones_like(weights))  # the weight moves credit (the test can fail)
    assert weights.min() >= (1.0 if high_only else 1.0 - clip) - 1e-12 and weights.max() <= 1.0 + clip + 1e-12


def test_future_drift_discount_and_clip_each_act():
    old, ref = [[-0.1, -0.2, -0.3]], [[-0.2, -0.2, -0.6]]  # Δ = 0.1, 0, 0.3
    one = torch.tensor([1.0], dtype=F64)

    def run(**o):
        return token_advantages("future_drift", one, old, None, group_size=1, ref_logp=ref, **o)[0].tolist()

    gamma = 2.0 ** (-1.0 / 4.0)
    assert run(half_life=4.0, clip=0.9) == pytest.approx(
        [math.exp(0.1 + gamma ** 2 * 0.3), math.exp(gamma * 0.3), math.exp(0.3)], rel=1e-13)
    assert run(half_life=4.0, clip=0.05) == pytest.approx([1.05, 1.05, 1.05], rel=1e-13)  # clipped at 1 + ε
    assert run(half_life=None, clip=0.9)[0] == pytest.approx(math.exp(0.4), rel=1e-13)  # no discount
    # Δ < 0 everywhere: high-only keeps the plain advantage, the two-sided clip lowers it to 1 − ε at most
    neg = token_advantages("future_drift", one, ref, None, group_size=1, ref_logp=old, clip=0.2)[0].tolist()
    assert neg == [1.0, 1.0, 1.0]
    low = token_advantages("future_drift", one, ref, None, group_size=1, ref_logp=old, clip=0.2, clip_high_only=False)
    assert low[0].tolist() == pytest.approx([max(math.exp(-(0.1 + 2 ** (-1 / 32) ** 2 * 0.3)), 0.8),
                                             max(math.exp(-2 ** (-1 / 32) * 0.3), 0.8), 0.8], rel=1e-13)


def test_future_drift_without_the_other_log_probs_refused():
    old = rand_lists(2, [2, 3])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    with pytest.raises(ValueError, match=r"ref_logp\[0\]"):
        token_advantages("future_drift", adv, old, None, group_size=2)
    with pytest.raises(ValueError, match=r"rollout_logp\[1\]: expected 3"):
        token_advantages("future_drift", adv, old, None, group_size=2, rollout_logp=[old[0], old[1][:2]], against="engine")


def test_future_drift_advantages_through_policy_loss_formula_and_gradient():
    """The per-token advantages drive ppo's loss as A_t·f_t (sequence-mean of token-means, written out), and
    its float64 autograd gradient matches finite differences."""
    lengths = [3, 5, 2, 4]
    old, ref = rand_lists(3, lengths), rand_lists(4, lengths)
    adv_seq = [0.8, -0.6, 1.2, -0.3]
    per_token = token_advantages("future_drift", torch.tensor(adv_seq, dtype=F64), old, None, group_size=2, ref_logp=ref,
                                 clip=0.5, clip_high_only=False, half_life=3.0)
    width = max(lengths)

    def pad(rows):
        out = torch.zeros(len(rows), width, dtype=F64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=F64)
        return out

    g = torch.Generator().manual_seed(5)
    logp_rows = [[x + 0.1 * float(torch.randn(1, generator=g)) for x in lp] for lp in old]
    lp, o, adv, mask = pad(logp_rows), pad(old), pad(per_token), pad([[1] * n for n in lengths]).bool()
    loss, _ = policy_loss("ppo", lp, o, adv, mask, loss_agg="seq-mean-token-mean")
    f = future_drift_reference([1.0] * 4, old, ref, 3.0, 0.5, False)
    expect = 0.0
    for i, n in enumerate(lengths):
        seq = 0.0
        for t in range(n):
            r, a = math.exp(logp_rows[i][t] - old[i][t]), adv_seq[i] * f[i][t]
            seq += -min(r * a, min(max(r, 0.8), 1.2) * a)
        expect += seq / n
    assert loss.item() == pytest.approx(expect / len(lengths), rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda y: policy_loss("ppo", y, o, adv, mask, loss_agg="seq-mean-token-mean")[0],
        (lp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- config and the loop


@pytest.mark.parametrize("options, words", [
    ({"half_life": 0}, "half_life"), ({"half_life": -3.0}, "half_life"), ({"clip": 1.0}, "clip"),
    ({"clip": -0.1}, "clip"), ({"clip_high_only": "yes"}, "clip_high_only"), ({"against": "ref"}, "against"),
    ({"gamma": 0.9}, "gamma"),
])
def test_bad_future_drift_options_refused_at_config_time(options, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "future_drift", **options}])
    assert err.value.field == "algorithm.stages[0]" and words in str(err.value)


def test_future_drift_against_engine_refused_where_pi_old_is_the_engine():
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "future_drift", "against": "engine"}], old_policy="engine")
    assert err.value.field == "algorithm.stages[0]" and "old_policy" in str(err.value)
    make_cfg(stages=[{"name": "future_drift", "against": "engine"}], old_policy="learner")


def test_future_drift_in_the_loop_reads_the_reference_and_loads_it():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(stages=[{"name": "future_drift", "clip": 0.5, "half_life": None}])
    a = cfg.algorithm
    assert a.needs_reference() and a.needs_old_stats() and not a.needs_old_entropy()
    assert cfg.loss_spec().kl_coef == 0.0  # the reference feeds the advantage only: no loss-side KL
    engine = make_cfg(stages=[{"name": "future_drift", "against": "engine"}])
    assert not engine.algorithm.needs_reference()
    batch = [{"advantage": 1.0, "old_logp": [-0.5, -1.0], "ref_logp": [-0.7, -1.1], "rollout_logp": [0.0, 0.0]},
             {"advantage": -1.0, "old_logp": [-2.0], "ref_logp": [-1.5], "rollout_logp": [0.0]}]
    token_stages(batch, cfg, step=1)
    assert batch[0]["advantage"] == pytest.approx([min(math.exp(0.3), 1.5), math.exp(0.1)], rel=1e-13)
    assert batch[1]["advantage"] == pytest.approx([-1.0], rel=1e-13)  # Δ < 0, high-only clip: weight 1


def test_old_stage_name_refuses_naming_the_new_ones():
    from megapo.config import ConfigError

    for options in ({}, {"clip": 0.5}):
        with pytest.raises(ConfigError) as err:
            make_cfg(stages=[{"name": "fipo", **options}])
        assert "future_drift" in str(err.value) and "objective=fipo" in str(err.value)
    with pytest.raises(ValueError, match="future_drift"):
        token_advantages("fipo", torch.ones(2, dtype=F64), [[-0.1], [-0.2]], None, group_size=2, ref_logp=[[0.0], [0.0]])


# ----------------------------------------------------------------------------- the objective fipo


def fipo_loop(seqs, half_life=32.0, clip=0.2, high_only=True, eps_low=0.2, eps_high=0.28, dual=None, safety=4.0,
              lp_of=None, frozen_of=None):
    """Per-token losses of objective fipo, written out: F_t a plain double loop over the later tokens."""
    gamma = 1.0 if half_life is None else 2.0 ** (-1.0 / half_life)
    out = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        fz = frozen_of(i) if frozen_of else lp
        n, old, adv = len(lp), s["old"], s["adv"]
        ell = [fz[t] - old[t] for t in range(n)]  # the weight reads sg[log r]
        delta = [0.0 if (dual is not None and math.exp(e) > dual) else e for e in ell]
        row = []
        for t in range(n):
            future = sum(gamma ** (u - t) * delta[u] for u in range(t, n))
            f = min(max(math.exp(future), 1.0 if high_only else 1.0 - clip), 1.0 + clip)
            if safety is not None and adv[t] < 0 and math.exp(ell[t]) > safety:
                f = min(max(f, 0.8), 1.0)
            a = adv[t] * f
            r = math.exp(lp[t] - old[t])
            loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            row.append(loss)
        out.append(row)
    return out


def _seqs(seed, lengths, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n in lengths:
        lp = (-torch.rand(n, generator=g, dtype=F64) * 2 - 0.05).tolist()
        old = [x + noise * float(torch.randn(1, generator=g, dtype=F64)) for x in lp]
        a = float(torch.randn(1, generator=g, dtype=F64))
        seqs.append(dict(lp=lp, old=old, adv=[a] * n))
    return seqs


def _pad(seqs, key, width):
    out = torch.zeros(len(seqs), width, dtype=F64)
    for i, s in enumerate(seqs):
        out[i, : len(s[key])] = torch.tensor(s[key], dtype=F64)
    return out


def _token_mean(rows):
    return sum(sum(r) for r in rows) / sum(len(r) for r in rows)


FIPO_CASES = [dict(), dict(half_life=2.0, clip=0.5, high_only=False), dict(half_life=None, clip=0.3),
              dict(half_life=4.0, clip=0.4, high_only=False, dual=1.5, safety=1.2, eps_high=0.2)]


@pytest.mark.parametrize("case", FIPO_CASES, ids=[str(c) for c in FIPO_CASES])
def test_fipo_objective_against_a_loop_and_finite_differences(case):
    lengths = [4, 7, 1, 5, 3]
    seqs = _seqs(7, lengths, noise=0.4)
    width = max(lengths) + 2
    lp, old, adv = _pad(seqs, "lp", width), _pad(seqs, "old", width), _pad(seqs, "adv", width)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    names = dict(half_life="half_life", clip="clip", high_only="clip_high_only", eps_low="eps_low",
                 eps_high="eps_high", dual="dual_clip", safety="safety_threshold")
    opts = {names[k]: v for k, v in case.items()}

    def lib(x):
        return policy_loss("fipo", x, old, adv, mask, **opts)

    x = lp.clone().requires_grad_(True)
    loss, metrics = lib(x)
    want = fipo_loop(seqs, **case)
    assert loss.item() == pytest.approx(_token_mean(want), rel=1e-12)  # loss_agg auto: the token mean
    loss.backward()
    # central differences of the loop with the sg[·] parts frozen at the current log-probs
    h = 1e-6
    frozen = [list(s["lp"]) for s in seqs]
    for i, n in enumerate(lengths):
        for t in range(n):
            vals = []
            for sign in (1, -1):
                def lp_of(j, sign=sign, i=i, t=t):
                    v = list(frozen[j])
                    if j == i:
                        v[t] += sign * h
                    return v
                vals.append(_token_mean(fipo_loop(seqs, **case, lp_of=lp_of, frozen_of=lambda j: frozen[j])))
            assert x.grad[i, t].item() == pytest.approx((vals[0] - vals[1]) / (2 * h), rel=1e-6, abs=1e-9), (i, t)
    assert torch.all(x.grad[~mask] == 0)
    # the weight moves credit on this data (the test can fail): the loss is not PPO's with the same clips
    ppo_opts = {k: v for k, v in opts.items() if k in ("eps_low", "eps_high", "dual_clip")}
    ppo_opts.setdefault("eps_high", 0.28)
    assert loss.item() != pytest.approx(policy_loss("ppo", lp, old, adv, mask, **ppo_opts)[0].item(), rel=1e-6)


def test_fipo_is_ppo_on_policy_and_weights_by_the_future_drift():
    """π_θ = π_old (the first mini-batch): f = 1, the loss and gradient are PPO's with the same clip. A token
    whose later tokens rose (A > 0) gets more credit; one whose later tokens fell keeps 1 (high-only clip)."""
    lp = torch.tensor([[-1.0, -0.7, -2.0, -0.3]], dtype=F64)
    adv, mask = torch.ones(1, 4, dtype=F64), torch.ones(1, 4, dtype=torch.bool)
    x1, x2 = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    l1, _ = policy_loss("fipo", x1, lp, adv, mask)
    l2, _ = policy_loss("ppo", x2, lp, adv, mask, eps_high=0.28)
    l1.backward(), l2.backward()
    assert l1.item() == pytest.approx(l2.item(), rel=1e-15) and torch.equal(x1.grad, x2.grad)
    # the last token drifted up by 0.1: every token before it sees F_t = γ^{3-t}·0.1 > 0
    old = lp - torch.tensor([[0.0, 0.0, 0.0, 0.1]], dtype=F64)
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss("fipo", x, old, adv, mask, half_life=None, clip=0.5)
    loss.backward()
    ppo_grad = -1.0 / 4  # d/dlp of -A·r at r = 1, token mean over 4
    assert x.grad[0, :3].tolist() == pytest.approx([ppo_grad * math.exp(0.1)] * 3, rel=1e-12)
    old_down = lp + torch.tensor([[0.0, 0.0, 0.0, 0.1]], dtype=F64)
    y = lp.clone().requires_grad_(True)
    policy_loss("fipo", y, old_down, adv, mask, half_life=None, clip=0.5)[0].backward()
    assert y.grad[0, :3].tolist() == pytest.approx([ppo_grad] * 3, rel=1e-12)  # F < 0, high-only: weight 1


def test_fipo_future_sum_crosses_its_blocks():
    """Rows longer than the future sum's 256-column blocks, packed behind masked prompt tokens."""
    from megapo.algorithms.objectives import discounted_future_sum
    from megapo.algorithms.stages import discounted_to_go

    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 700, generator=g, dtype=F64)
    for gamma in (1.0, 2 ** (-1 / 32), 0.5):
        assert torch.allclose(discounted_future_sum(v, gamma), discounted_to_go(v, gamma), rtol=1e-12, atol=1e-12)
    lengths = [600, 3, 300]
    seqs = _seqs(9, lengths, noise=0.05)
    prompt = 2
    flat = {k: [] for k in ("lp", "old", "adv")}
    pmask, cu = [], [0]
    for s in seqs:
        for k in flat:
            flat[k] += [0.0] * prompt + s[k]
        pmask += [False] * prompt + [True] * len(s["lp"])
        cu.append(cu[-1] + prompt + len(s["lp"]))
    t = {k: torch.tensor(v, dtype=F64) for k, v in flat.items()}
    loss, _ = policy_loss("fipo", t["lp"], t["old"], t["adv"], torch.tensor(pmask), cu_seqlens=torch.tensor(cu),
                          half_life=64.0, clip=0.5, clip_high_only=False)
    assert loss.item() == pytest.approx(_token_mean(fipo_loop(seqs, half_life=64.0, clip=0.5, high_only=False)),
                                        rel=1e-11)


@pytest.mark.parametrize("options, field", [
    ({"half_life": 0}, "half_life"), ({"clip": 1.0}, "clip"), ({"clip_high_only": 1}, "clip_high_only"),
    ({"dual_clip": 1.1}, "dual_clip"), ({"safety_threshold": 0}, "safety_threshold"), ({"eps_low": -0.1}, "eps_low"),
])
def test_bad_fipo_objective_options_refused_at_config_time(options, field):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(objective="fipo", objective_options=options)
    assert err.value.field == "algorithm.objective_options" and str(err.value.message).startswith(f"{field}:")
    make_cfg(objective="fipo", objective_options={"dual_clip": 10.0, "half_life": None})

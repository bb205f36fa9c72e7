"""Objectives of megapo/algorithms/ratio_gating.py (issue 32) against their formulas written out here as float64
loops: s_ppo and st_ppo (Li et al. 2025, ST-PPO: Stabilized Off-Policy Proximal Policy Optimization for Multi-Turn
Agents, arXiv:2511.20718) and fiberpo (Li et al. 2026, Fibration Policy Optimization, arXiv:2603.08239). Each: the
loss against a loop, float64 central finite differences of that loop for the gradient w.r.t. the log-probs (sg[·]
parts frozen), the split over 4 micro-batches x 2 DP shards summing to the full batch (global_tokens /
global_seqs), the mechanism's own identities, and bad options refused at config time naming the field.
"""

from __future__ import annotations

import math
import random
import sys

import pytest
import torch

from megapo.algorithms import entries, policy_loss
from megapo.algorithms.batch import TokenBatch
from megapo.algorithms.loss import token_inputs
from megapo.algorithms.ratio_gating import FiberPOOptions, fiber_gated_log_ratio
from megapo.cli import main

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import objective_loops  # noqa: E402
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import F64, check_split_sums, clip, seq_mean, token_mean  # noqa: E402


# ----------------------------------------------------------------------------- data


def make_seqs(seed, lengths, noise=0.5, end_rate=0.3):
    """Sequences as dicts of float lists: lp (π_θ), old (π_old), adv, end (1.0 where a turn ends)."""
    rng = random.Random(seed)
    seqs = []
    for n in lengths:
        lp = [-abs(rng.gauss(1.2, 0.9)) - 0.02 for _ in range(n)]
        old = [min(x + rng.gauss(0, noise), -1e-3) for x in lp]
        a = rng.choice([-1.0, 1.0]) * (0.2 + rng.random())
        end = [float(rng.random() < end_rate) for _ in range(n)]
        seqs.append(dict(lp=lp, old=old, adv=[a] * n, end=end))
    return seqs


def padded(seqs, width=None):
    return objective_loops.padded(seqs, ("lp", "old", "adv", "end"), width)


def call(name, p, x=None, **kw):
    return policy_loss(name, p["lp"] if x is None else x, p["old"], p["adv"], p["mask"], sentence_end=p["end"], **kw)


# ----------------------------------------------------------------------------- references


def pessimistic(a, ell, gated):
    return max(-a * math.exp(ell), -a * math.exp(gated))


def excess(a, ell, lo, hi):
    if a > 0 and ell > hi:
        return ell - hi
    if a < 0 and ell < lo:
        return lo - ell
    return 0.0


def turns(end):
    """Each token's turn index: a turn ends at a flagged token, the tail is one turn."""
    out, k = [], 0
    for e in end:
        out.append(k)
        k += e > 0.5
    return out


def turn_means(values, end):
    ids = turns(end)
    means = {k: sum(v for v, j in zip(values, ids) if j == k) / ids.count(k) for k in set(ids)}
    return [means[k] for k in ids]


def sppo_loop(seqs, eps_low=0.2, eps_high=0.2, bias_scale=1.0, turn_level=False, lp_of=None, frozen_of=None):
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    out = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        fz = frozen_of(i) if frozen_of else lp
        ell = [lp[t] - s["old"][t] for t in range(len(lp))]
        ell_fz = [fz[t] - s["old"][t] for t in range(len(lp))]
        if turn_level:
            ell, ell_fz = turn_means(ell, s["end"]), turn_means(ell_fz, s["end"])
        beta = sum(excess(s["adv"][t], ell_fz[t], lo, hi) for t in range(len(lp))) / len(lp)
        w = 1 / (1 + bias_scale * beta)
        out.append([w * pessimistic(s["adv"][t], ell[t], clip(ell[t], lo, hi)) for t in range(len(lp))])
    return out


def stppo_loop(seqs, sentence_end_ids=(), **kw):
    # the turn ends are the flags in s["end"] (what the learner computes from sentence_end_ids); no ids: one turn
    if not sentence_end_ids:
        seqs = [dict(s, end=[0.0] * len(s["end"])) for s in seqs]
    return sppo_loop(seqs, turn_level=True, **kw)


def fiberpo_loop(seqs, base_eps_low=0.05, base_eps_high=0.05, fiber_eps_low=0.2, fiber_eps_high=0.2, lp_of=None,
                 frozen_of=None):
    b_lo, b_hi = math.log(1 - base_eps_low), math.log(1 + base_eps_high)
    f_lo, f_hi = math.log(1 - fiber_eps_low), math.log(1 + fiber_eps_high)
    out = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        ell = [lp[t] - s["old"][t] for t in range(len(lp))]
        m = sum(ell) / len(ell)
        out.append([pessimistic(s["adv"][t], e, clip(m, b_lo, b_hi) + clip(e - m, f_lo, f_hi))
                    for t, e in enumerate(ell)])
    return out


LOOPS = {"s_ppo": sppo_loop, "st_ppo": stppo_loop, "fiberpo": fiberpo_loop}
AGG = {"s_ppo": token_mean, "st_ppo": token_mean, "fiberpo": seq_mean}  # their registered loss_agg (auto)
CASES = [
    ("s_ppo", dict()),
    ("s_ppo", dict(eps_low=0.1, eps_high=0.28, bias_scale=4.0)),
    ("st_ppo", dict(sentence_end_ids=[7])),
    ("st_ppo", dict(sentence_end_ids=[7, 9], eps_low=0.05, eps_high=0.08, bias_scale=2.5)),
    ("st_ppo", dict()),
    ("fiberpo", dict()),
    ("fiberpo", dict(base_eps_low=0.02, base_eps_high=0.1, fiber_eps_low=0.1, fiber_eps_high=0.3)),
]
IDS = [f"{n}-{o}" for n, o in CASES]


def fd_grad(name, seqs, opts):
    return objective_loops.fd_grad(
        lambda lp_of, frozen_of: AGG[name](LOOPS[name](seqs, **opts, lp_of=lp_of, frozen_of=frozen_of)), seqs)


# ----------------------------------------------------------------------------- objectives


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_loss_and_gradient_match_the_loop(name, opts):
    lengths = [4, 7, 1, 5, 3, 6]
    seqs = make_seqs(2, lengths)
    p = padded(seqs, width=9)
    x = p["lp"].clone().requires_grad_(True)
    loss, metrics = call(name, p, x, **opts)
    assert loss.item() == pytest.approx(AGG[name](LOOPS[name](seqs, **opts)), rel=1e-12)
    loss.backward()
    for i, row in enumerate(fd_grad(name, seqs, opts)):
        for t, g in enumerate(row):
            assert x.grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-9), (i, t)
    assert torch.all(x.grad[~p["mask"]] == 0)
    # the method's own mechanism bites on this data (the test can fail): it is not plain PPO
    base, _ = policy_loss("ppo", p["lp"], p["old"], p["adv"], p["mask"], eps_low=opts.get("eps_low", 0.2),
                          eps_high=opts.get("eps_high", 0.2),
                          loss_agg="seq-mean-token-mean" if name == "fiberpo" else "token-mean")
    assert loss.item() != pytest.approx(base.item(), rel=1e-6)
    assert float(metrics["clipfrac_low"] + metrics["clipfrac_high"]) > 0  # the gates are hit


@pytest.mark.parametrize("name, opts", CASES, ids=IDS)
def test_split_4_micro_batches_x_2_dp_shards_sums_to_the_batch(name, opts):
    """8 sequences, 2 DP ranks x 4 micro-batches of one sequence each, with the batch's global_tokens and
    global_seqs: the shards' losses and gradients sum to the full batch's (every statistic is per sequence)."""
    check_split_sums(call, name, make_seqs(2, [3, 6, 2, 5, 4, 7, 1, 5]), padded, opts)


def _loss_and_grad(name, p, **kw):
    x = p["lp"].clone().requires_grad_(True)
    loss, _ = call(name, p, x, **kw)
    loss.backward()
    return loss.item(), x.grad


def test_s_ppo_without_correction_is_ppo_and_the_weight_only_falls_with_clipping():
    p = padded(make_seqs(5, [4, 6, 3, 5]))
    loss, grad = _loss_and_grad("s_ppo", p, bias_scale=0.0)
    ppo_loss, ppo_grad = _loss_and_grad("ppo", p)
    assert loss == pytest.approx(ppo_loss, rel=1e-14) and torch.allclose(grad, ppo_grad, rtol=1e-14, atol=0)
    # one sequence, two tokens: only the second is clipped (A > 0, r = 2 > 1.2): ω = 1/(1 + (log 2 - log 1.2)/2)
    one = [dict(lp=[-1.0, -1.0 + math.log(2.0)], old=[-1.0, -1.0], adv=[1.0, 1.0], end=[0.0, 0.0])]
    loss, grad = _loss_and_grad("s_ppo", padded(one))
    w = 1 / (1 + (math.log(2.0) - math.log(1.2)) / 2)
    assert loss == pytest.approx(w * (-1.0 - 1.2) / 2, rel=1e-14)
    assert grad[0].tolist() == pytest.approx([-w / 2, 0.0], rel=1e-14)
    # nothing clipped (on-policy): weight 1, PPO's loss
    on = padded(make_seqs(6, [3, 4], noise=0.0))
    assert _loss_and_grad("s_ppo", on)[0] == pytest.approx(_loss_and_grad("ppo", on)[0], rel=1e-14)


def test_st_ppo_turns_between_token_and_sequence_level():
    seqs = make_seqs(7, [5, 3, 6])
    # every token its own turn: S-PPO
    each = padded([dict(s, end=[1.0] * len(s["end"])) for s in seqs])
    a = _loss_and_grad("st_ppo", each, sentence_end_ids=[3])
    b = _loss_and_grad("s_ppo", each)
    assert a[0] == pytest.approx(b[0], rel=1e-14) and torch.allclose(a[1], b[1], rtol=1e-13, atol=1e-16)
    # one turn and no correction (Turn-PPO on a single-turn response): GSPO's sequence ratio, clipped the same way
    p = padded(seqs)
    a = _loss_and_grad("st_ppo", p, bias_scale=0.0, loss_agg="seq-mean-token-mean")
    b = _loss_and_grad("gspo", p, eps_low=0.2, eps_high=0.2)
    assert a[0] == pytest.approx(b[0], rel=1e-14) and torch.allclose(a[1], b[1], rtol=1e-13, atol=1e-16)


def test_st_ppo_reads_turn_ends_only_when_given_ids():
    assert token_inputs("st_ppo", {}) == ()
    assert token_inputs("st_ppo", {"sentence_end_ids": [5]}) == ("sentence_end",)
    p = padded(make_seqs(8, [3]))
    with pytest.raises(ValueError, match=r"^sentence_end: required by objective 'st_ppo'"):
        policy_loss("st_ppo", p["lp"], p["old"], p["adv"], p["mask"], sentence_end_ids=[5])


def test_fiberpo_gate_jacobian_is_identity_on_policy_and_block_diagonal():
    p = padded(make_seqs(9, [4, 2, 5]))
    opts = FiberPOOptions()

    def gate(lp, old):
        return fiber_gated_log_ratio(TokenBatch(lp, old, p["adv"], p["mask"]), opts)[0]

    on = torch.autograd.functional.jacobian(lambda lp: gate(lp, p["lp"]), p["lp"])  # π_θ = π_old
    valid = p["mask"].flatten()
    jac = on.reshape(valid.numel(), valid.numel())[valid][:, valid]
    assert torch.equal(jac, torch.eye(int(valid.sum()), dtype=F64))
    off = torch.autograd.functional.jacobian(lambda lp: gate(lp, p["old"]), p["lp"])  # drifted: gates bite
    assert not torch.allclose(off.reshape(valid.numel(), -1)[valid][:, valid], jac)
    for i in range(3):
        for j in range(3):
            if i != j:
                assert torch.all(off[i, :, j, :] == 0), (i, j)
    # on-policy the loss and gradient are PPO's (same aggregation)
    on_seqs = padded(make_seqs(9, [4, 2, 5], noise=0.0))
    a = _loss_and_grad("fiberpo", on_seqs)
    b = _loss_and_grad("ppo", on_seqs, loss_agg="seq-mean-token-mean")
    assert a[0] == pytest.approx(b[0], rel=1e-14) and torch.allclose(a[1], b[1], rtol=1e-14, atol=0)


def test_fiberpo_past_its_base_budget_keeps_only_the_residual_gradient():
    """A > 0, the trajectory's mean ratio above 1 + ε_b, each residual inside its budget: the gradient moves the
    tokens relative to each other and sums to 0 over the trajectory (no motion of the trajectory as a whole)."""
    ell = [0.3, 0.2, 0.1]
    one = [dict(lp=[-1.0 + e for e in ell], old=[-1.0] * 3, adv=[1.0] * 3, end=[0.0] * 3)]
    _, grad = _loss_and_grad("fiberpo", padded(one))
    assert float(grad.sum()) == pytest.approx(0.0, abs=1e-15) and float(grad.abs().sum()) > 0


def test_overflowing_ratio_gives_finite_loss_and_gradient():
    """A > 0 and a float32 ratio e^100: the clipped branch wins, so no inf meets a zero gradient (A < 0 is PPO's
    unbounded branch, as in ppo without a dual clip)."""
    lp = torch.tensor([[-3.0, -2.0, -0.5]], requires_grad=True)
    old = lp.detach() - torch.tensor([[-5.0, 0.0, 100.0]])
    for name in ("s_ppo", "st_ppo", "fiberpo"):
        lp.grad = None
        loss, _ = policy_loss(name, lp, old, torch.ones(1, 3), torch.ones(1, 3))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name


# ----------------------------------------------------------------------------- config and listing


BAD = [
    ("s_ppo", {"eps_low": 1.0}, "eps_low"), ("s_ppo", {"eps_high": -0.1}, "eps_high"),
    ("s_ppo", {"bias_scale": -1}, "bias_scale"), ("s_ppo", {"bias_scale": float("nan")}, "bias_scale"),
    ("st_ppo", {"sentence_end_ids": "abc"}, "sentence_end_ids"), ("st_ppo", {"sentence_end_ids": [-1]},
                                                                    "sentence_end_ids"),
    ("st_ppo", {"bias_scale": "big"}, "bias_scale"),
    ("fiberpo", {"base_eps_low": 1.5}, "base_eps_low"), ("fiberpo", {"base_eps_high": -1}, "base_eps_high"),
    ("fiberpo", {"fiber_eps_low": True}, "fiber_eps_low"), ("fiberpo", {"fiber_eps_high": float("inf")},
                                                            "fiber_eps_high"),
]


@pytest.mark.parametrize("name, options, field", BAD, ids=[f"{n}-{f}-{o[f]!r}" for n, o, f in BAD])
def test_bad_options_refused_at_config_time(name, options, field):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(objective=name, objective_options=options)
    # the option's own check words it "<field>: ..."; the loader's finite-number check (nan, inf) names its path
    by_option = err.value.field == "algorithm.objective_options" and str(err.value.message).startswith(f"{field}:")
    assert by_option or err.value.field == f"algorithm.objective_options.{field}", str(err.value)


def test_good_options_load():
    make_cfg(objective="s_ppo", objective_options={"bias_scale": 0.5, "eps_high": 0.28})
    make_cfg(objective="st_ppo", objective_options={"sentence_end_ids": [151645], "bias_scale": 0})
    make_cfg(objective="fiberpo", objective_options={"base_eps_high": 0.1, "fiber_eps_low": 0.3})


def test_listed_with_paper_and_formula(capsys):
    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    by_name = {e.name: e for e in entries("objective")}
    for name in ("s_ppo", "st_ppo", "fiberpo"):
        e = by_name[name]
        assert "arXiv:" in e.paper and e.paper in out, name
        assert e.formula.splitlines()[0].strip() in out, name
        assert "Assumption:" in e.formula, name
        for option in e.option_names():
            assert option in out

"""HAEPO (Trivedi et al. 2025, HAEPO: History-Aggregated Exploratory Policy Optimization, arXiv:2508.18884):
megapo/algorithms/plackett_luce.py's stage plackett_luce and objective haepo against the formulas written out here
as float64 loops; float64 central finite differences for the gradient, and at θ = θ_old the pair's gradient equal
to that of the Plackett-Luce expected return Σ_i softmax(L(θ))_i·R_i; the split over 4 micro-batches x 2 DP shards
summing to the full batch; config refusals naming the field; the listing; one tiny training step."""

from __future__ import annotations

import math
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms import entries, policy_loss
from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages
from megapo.algorithms.plackett_luce import plackett_luce_advantages, run_stage
from megapo.algorithms.sample import TrainSample
from megapo.cli import main

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import objective_loops  # noqa: E402
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import F64, check_split_sums, fd_grad, seq_mean  # noqa: E402


def make_seqs(seed, lengths, noise=0.3):
    rng = random.Random(seed)
    seqs = []
    for n in lengths:
        lp = [-abs(rng.gauss(1.0, 0.6)) - 0.02 for _ in range(n)]
        old = [min(x + rng.gauss(0, noise), -1e-3) for x in lp]
        a = rng.gauss(0, 0.3)
        seqs.append(dict(lp=lp, old=old, adv=[a] * n))
    return seqs


def padded(seqs, width=None):
    return objective_loops.padded(seqs, ("lp", "old", "adv"), width)


def call(name, p, x=None, **kw):
    return policy_loss(name, p["lp"] if x is None else x, p["old"], p["adv"], p["mask"], **kw)


# ----------------------------------------------------------------------------- the formulas as loops


def stage_loop(returns, traj_logp):
    """Â_i = w_i·(R_i − Σ_j w_j R_j), w = softmax of the group's cumulative log-likelihoods; lists of groups."""
    out = []
    for R, L in zip(returns, traj_logp):
        top = max(L)
        e = [math.exp(v - top) for v in L]
        w = [v / sum(e) for v in e]
        mean = sum(wi * ri for wi, ri in zip(w, R))
        out.append([wi * (ri - mean) for wi, ri in zip(w, R)])
    return out


def objective_loop(seqs, kl_prev=0.01, lp_of=None):
    rows = []
    for i, s in enumerate(seqs):
        lp = lp_of(i) if lp_of else s["lp"]
        rho = math.exp(sum(a - b for a, b in zip(lp, s["old"])))
        rows.append([-rho * s["adv"][0] + kl_prev * (math.exp(a - b) - 1 - (a - b)) for a, b in zip(lp, s["old"])])
    return rows


# ----------------------------------------------------------------------------- tests


def test_stage_matches_the_loop_and_sums_policy_tokens_only():
    rng = random.Random(0)
    groups, G = 3, 4
    batch, returns, sums = [], [], []
    for _ in range(groups):
        rg, lg = [], []
        for _ in range(G):
            n = rng.randint(2, 6)
            old = [-abs(rng.gauss(0.5, 0.4)) for _ in range(n)]
            mask = [int(rng.random() > 0.3) for _ in range(n)]
            r = rng.choice([0.0, 1.0]) - 0.4
            batch.append(TrainSample(tokens=[1] * (2 + n), prompt_len=2, advantage=r, old_logp=old, loss_mask=mask))
            rg.append(r)
            lg.append(sum(o * m for o, m in zip(old, mask)))
        returns.append(rg)
        sums.append(lg)
    ctx = TokenContext(group_size=G, step=0, seed=0, kl_coef=0.0)
    metrics = run_token_stages(parse_stages([{"name": "plackett_luce"}]), batch, ctx)  # the pipeline sets them
    want = [a for g in stage_loop(returns, sums) for a in g]
    for x, a in zip(batch, want):
        assert x.advantage == pytest.approx([a] * len(x.old_logp), rel=1e-12, abs=1e-15)
    assert 0 < metrics["plackett_luce/weight_max"] <= 1
    # the weights sum to 1 per group, so the Â of a group sum to 0
    for g in range(groups):
        assert sum(batch[g * G + k].advantage[0] for k in range(G)) == pytest.approx(0, abs=1e-12)


def test_stage_refuses_per_token_advantages_and_ragged_batch():
    x = TrainSample(tokens=[1, 2, 3], prompt_len=1, advantage=[0.1, 0.2], old_logp=[-1.0, -1.0])
    with pytest.raises(ValueError, match=r"^advantage: stage plackett_luce"):
        run_stage([x, x], None, SimpleNamespace(group_size=2))
    y = TrainSample(tokens=[1, 2, 3], prompt_len=1, advantage=0.1, old_logp=[-1.0, -1.0])
    with pytest.raises(ValueError, match=r"^group_size:"):
        run_stage([y, y, y], None, SimpleNamespace(group_size=2))
    with pytest.raises(ValueError, match=r"^traj_logp:"):
        plackett_luce_advantages(torch.zeros(2, 3), torch.zeros(2, 2))


@pytest.mark.parametrize("kl_prev", [0.0, 0.01, 0.5])
def test_objective_matches_the_loop_and_its_finite_difference_gradient(kl_prev):
    seqs = make_seqs(1, [3, 6, 2, 5, 4])
    p = padded(seqs)
    x = p["lp"].clone().requires_grad_(True)
    loss, metrics = call("haepo", p, x, kl_prev=kl_prev)
    assert loss.item() == pytest.approx(seq_mean(objective_loop(seqs, kl_prev)), rel=1e-12)
    loss.backward()
    grads = fd_grad(lambda lp_of, _f: seq_mean(objective_loop(seqs, kl_prev, lp_of)), seqs)
    for i, row in enumerate(grads):
        for t, g in enumerate(row):
            assert x.grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-9), (i, t)
    assert torch.all(x.grad[~p["mask"]] == 0)
    assert metrics["ratio_max"].item() == pytest.approx(
        max(math.exp(sum(a - b for a, b in zip(s["lp"], s["old"]))) for s in seqs), rel=1e-12)


def test_at_theta_old_the_gradient_is_the_plackett_luce_expected_return_gradient():
    """Stage then objective, on-policy (π_θ = π_old): ∇_lp loss = -(1/S)·∇_lp Σ_groups Σ_i softmax(L)_i·R_i with
    L_i = Σ_t lp_{i,t} (the HAEPO objective, by finite differences of the loop); the soft KL adds nothing there."""
    G, lengths = 4, [3, 5, 2, 4, 6, 1, 3, 2]
    seqs = make_seqs(5, lengths)
    rng = random.Random(7)
    R = [rng.choice([0.0, 1.0]) + rng.gauss(0, 0.1) for _ in lengths]
    for s in seqs:
        s["old"] = list(s["lp"])  # on-policy
    groups_L = [[sum(seqs[g * G + k]["old"]) for k in range(G)] for g in range(len(lengths) // G)]
    groups_R = [R[g * G: (g + 1) * G] for g in range(len(lengths) // G)]
    adv = [a for g in stage_loop(groups_R, groups_L) for a in g]
    for s, a in zip(seqs, adv):
        s["adv"] = [a] * len(s["lp"])
    p = padded(seqs)
    x = p["lp"].clone().requires_grad_(True)
    call("haepo", p, x, kl_prev=0.3)[0].backward()

    def expected_return(lp_of, _frozen):
        total = 0.0
        for g in range(len(groups_R)):
            L = [sum(lp_of(g * G + k)) for k in range(G)]
            top = max(L)
            e = [math.exp(v - top) for v in L]
            total += sum(ei / sum(e) * r for ei, r in zip(e, groups_R[g]))
        return -total / len(lengths)

    for i, row in enumerate(fd_grad(expected_return, seqs)):
        for t, g in enumerate(row):
            assert x.grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-10), (i, t)


def test_split_4_micro_batches_x_2_dp_shards_sums_to_the_batch():
    check_split_sums(call, "haepo", make_seqs(2, [3, 6, 2, 5, 4, 7, 1, 5]), padded, {"kl_prev": 0.05})


def test_overflowing_ratio_gives_finite_loss_and_gradient():
    lp = torch.tensor([[-3.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = lp.detach() - torch.tensor([[-5.0, 0.0, 100.0]], dtype=F64)
    loss, _ = policy_loss("haepo", lp, old, torch.ones(1, 3, dtype=F64), torch.ones(1, 3))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


# ----------------------------------------------------------------------------- config and listing


def _cfg(**fields):
    base = dict(objective="haepo", stages=[{"name": "plackett_luce"}], entropy_coef=0.01)
    return make_cfg(**{**base, **fields})


def test_good_config_loads_and_runs_the_old_logprob_pass():
    cfg = _cfg(objective_options={"kl_prev": 0.1})
    assert cfg.algorithm.needs_old_stats()


@pytest.mark.parametrize("fields, field, start", [
    (dict(stages=[]), "algorithm.stages", "objective haepo reads"),
    (dict(objective="ppo"), "algorithm.stages[0]", "plackett_luce gives"),
    (dict(entropy_coef=0.0), "algorithm.entropy_coef", "haepo's entropy"),
    (dict(objective_options={"kl_prev": -1}), "algorithm.objective_options", "kl_prev:"),
    (dict(objective_options={"max_log_ratio": 0}), "algorithm.objective_options", "max_log_ratio:"),
    (dict(objective_options={"beta": 1}), "algorithm.objective_options", "unknown option"),
    (dict(stages=[{"name": "plackett_luce", "tau": 2}]), "algorithm.stages[0]", "plackett_luce:"),
], ids=["no-stage", "stage-without-haepo", "no-entropy", "kl_prev", "max_log_ratio", "unknown", "stage-option"])
def test_config_refusals_name_the_field(fields, field, start):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _cfg(**fields)
    assert err.value.field == field, str(err.value)
    assert str(err.value.message).startswith(start), str(err.value)


def test_listed_with_paper_formula_and_assumptions(capsys):
    assert main(["objectives", "--formulas"]) == 0
    out = capsys.readouterr().out
    by_name = {(e.kind, e.name): e for e in entries()}
    for key in (("objective", "haepo"), ("advantage_stage", "plackett_luce")):
        e = by_name[key]
        assert "arXiv:2508.18884" in e.paper and e.paper in out, key
        assert e.formula.splitlines()[0].strip() in out and "assumption:" in e.formula, key
        for option in e.option_names():
            assert option in out


def test_one_training_step(tmp_path, tiny_moe):
    from train_runs import train_rows

    rows = train_rows(tmp_path, "haepo", f"model.path={tiny_moe}", "train.steps=1", "algorithm.objective=haepo",
                      "algorithm.stages=[{name: plackett_luce}]", "algorithm.entropy_coef=0.01")
    assert rows[0]["step"] == 1 and math.isfinite(rows[0]["train/loss"])
    assert any(k.endswith("plackett_luce/weight_max") for k in rows[0]), sorted(rows[0])  # the stage ran

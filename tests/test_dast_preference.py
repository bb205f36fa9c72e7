"""DAST's budget preference optimisation (Shen et al. 2025, DAST: Difficulty-Adaptive Slow-Thinking for Large Reasoning
Models, arXiv:2503.04472), megapo/algorithms/dast_preference.py's stage dast_simpo: the pairs against a loop written
here; SimPO's loss against its formula; the stage's advantage shifts against float64 central finite differences of
the preference loss written as a loop; at θ = θ_old the RL loss's gradient plus coef·∇ of the preference loss (ppo
and gspo, seq-mean-token-mean); the split over 4 micro-batches x 2 DP shards (groups and pairs cut across shards)
summing to the batch at 1e-12; config refusals naming the field; the listing; one tiny training step."""

from __future__ import annotations

import math
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms import entries, policy_loss
from megapo.algorithms.dast_preference import (DastSimpoOptions, budget_pairs, dast_simpo_advantages,
                                               run_dast_simpo_stage, simpo_loss)
from megapo.algorithms.pipeline import TokenContext, parse_stages, run_token_stages
from megapo.algorithms.sample import TrainSample
from megapo.cli import main

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import objective_loops  # noqa: E402
from algorithm_configs import config_data  # noqa: E402
from objective_loops import F64, check_split_sums, fd_grad  # noqa: E402

G = 4  # responses per prompt in these batches


# ----------------------------------------------------------------------------- the formulas as loops


def pairs_loop(rewards, correct, margin, cross):
    out = []
    for w in range(len(rewards)):
        for l in range(len(rewards)):
            if w == l:
                continue
            kind_ok = correct[w] == correct[l] or (cross and correct[w] and not correct[l])
            if kind_ok and rewards[w] - rewards[l] > margin:
                out.append((w, l))
    return out


def simpo_loop(mw, ml, beta, gamma):
    x = beta * mw - beta * ml - gamma
    return math.log(1 + math.exp(-x))  # −log σ(x)


def preference_loss_loop(mean_logp, rewards, correct, n, o):
    """Σ_groups (n/|P_g|)·Σ_{(w,l)∈P_g} SimPO(ℓ̄_w, ℓ̄_l)."""
    total = 0.0
    for lo in range(0, len(rewards), n):
        pairs = pairs_loop(rewards[lo:lo + n], correct[lo:lo + n], o.margin, o.cross_pairs)
        for w, l in pairs:
            total += n / len(pairs) * simpo_loop(mean_logp[lo + w], mean_logp[lo + l], o.beta, o.gamma)
    return total


def make_groups(seed, groups, n=G):
    """Shaped rewards as dast gives them (R + score: correct > 0.1 + 1, incorrect < −0.1) and verdicts."""
    rng = random.Random(seed)
    rewards, correct = [], []
    for _ in range(groups):
        for _ in range(n):
            ok = rng.random() < 0.5
            correct.append(ok)
            rewards.append(1.0 + rng.uniform(0.1, 0.9) if ok else rng.uniform(-0.9, -0.1))
    return rewards, correct


def make_seqs(seed, lengths):
    rng = random.Random(seed)
    seqs = []
    for n in lengths:
        lp = [-abs(rng.gauss(1.0, 0.6)) - 0.02 for _ in range(n)]
        seqs.append(dict(lp=lp, old=list(lp), adv=[rng.gauss(0, 0.5)] * n))  # on-policy: π_θ = π_old
    return seqs


def padded(seqs, width=None):
    return objective_loops.padded(seqs, ("lp", "old", "adv"), width)


def call(name, p, x=None, **kw):
    return policy_loss(name, p["lp"] if x is None else x, p["old"], p["adv"], p["mask"], **kw)


def shifted(seqs, rewards, correct, o):
    """The sequences with the stage's ΔA added to their advantages (one stage call on the whole batch)."""
    mean = torch.tensor([sum(s["old"]) / len(s["old"]) for s in seqs], dtype=F64)
    shift, _ = dast_simpo_advantages(torch.tensor(rewards, dtype=F64), torch.tensor(correct), mean, G, o)
    return [dict(s, adv=[a + float(d) for a in s["adv"]]) for s, d in zip(seqs, shift)], shift


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("margin", [0.0, 0.1, 0.4])
def test_pairs_match_the_loop(cross, margin):
    for seed in range(5):
        rewards, correct = make_groups(seed, 1, n=7)
        rewards[2] = rewards[3]  # a tie is no pair
        got = budget_pairs(torch.tensor(rewards, dtype=F64), torch.tensor(correct), margin, cross)
        assert [tuple(p) for p in got.tolist()] == pairs_loop(rewards, correct, margin, cross), seed


def test_pairs_prefer_the_short_correct_and_the_long_incorrect_under_dast():
    """Through the dast length reward itself: a short correct response beats a long correct one, a long incorrect
    one beats a short incorrect one; no correct/incorrect pair unless cross_pairs."""
    from megapo.algorithms.length import ScoredGroup, build_length_reward

    r = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=F64)
    g = ScoredGroup("k", None, r, r > 0.5, torch.tensor([10, 40, 10, 40]), torch.zeros(4, dtype=torch.bool))
    shaped = build_length_reward("dast", {"max_len": 80}, 80).shape([g], 1)[0]
    assert [tuple(p) for p in budget_pairs(shaped, r > 0.5, 0.1).tolist()] == [(0, 1), (3, 2)]
    assert len(budget_pairs(shaped, r > 0.5, 0.1, cross_pairs=True)) == 2 + 4


def test_simpo_loss_matches_the_formula():
    rng = random.Random(3)
    for _ in range(20):
        mw, ml, beta, gamma = rng.uniform(-3, 0), rng.uniform(-3, 0), rng.uniform(0.1, 5), rng.uniform(0, 2)
        got = simpo_loss(torch.tensor(mw, dtype=F64), torch.tensor(ml, dtype=F64), beta, gamma).item()
        assert got == pytest.approx(simpo_loop(mw, ml, beta, gamma), rel=1e-13)


@pytest.mark.parametrize("cross", [False, True])
def test_shift_is_minus_coef_times_the_finite_difference_gradient(cross):
    o = DastSimpoOptions(coef=0.7, beta=2.5, gamma=0.6, margin=0.1, cross_pairs=cross)
    rewards, correct = make_groups(11, 3)
    rng = random.Random(12)
    mean = [-rng.uniform(0.2, 2.0) for _ in rewards]
    shift, metrics = dast_simpo_advantages(torch.tensor(rewards, dtype=F64), torch.tensor(correct),
                                           torch.tensor(mean, dtype=F64), G, o)
    h = 1e-6
    for i in range(len(mean)):
        up, down = list(mean), list(mean)
        up[i] += h
        down[i] -= h
        fd = (preference_loss_loop(up, rewards, correct, G, o) - preference_loss_loop(down, rewards, correct, G, o))
        assert shift[i].item() == pytest.approx(-o.coef * fd / (2 * h), rel=1e-6, abs=1e-9), i
    losses = [simpo_loop(mean[lo + w], mean[lo + l], o.beta, o.gamma) for lo in range(0, len(mean), G)
              for w, l in pairs_loop(rewards[lo:lo + G], correct[lo:lo + G], o.margin, cross)]
    assert metrics["dast_simpo/loss_old"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert metrics["dast_simpo/pairs"] == pytest.approx(len(losses) / 3, rel=1e-12)


@pytest.mark.parametrize("objective", ["ppo", "gspo"])
def test_at_theta_old_the_gradient_is_rl_plus_coef_times_simpo(objective):
    """Stage then objective, π_θ = π_old, seq-mean-token-mean: ∇_lp loss = ∇_lp [RL surrogate (the loop) + coef/S·
    Σ_g (n/|P_g|)·Σ SimPO(ℓ̄_w(lp), ℓ̄_l(lp))], by float64 central finite differences."""
    o = DastSimpoOptions(coef=0.5, beta=2.0, gamma=0.5, margin=0.05)
    lengths = [3, 5, 2, 4, 6, 1, 3, 2]
    rewards, correct = make_groups(5, len(lengths) // G)
    base = make_seqs(4, lengths)
    seqs, _ = shifted(base, rewards, correct, o)
    p = padded(seqs)
    x = p["lp"].clone().requires_grad_(True)
    call(objective, p, x, loss_agg="seq-mean-token-mean")[0].backward()
    S = len(lengths)

    def total(lp_of, _frozen):
        rl = 0.0
        for i, s in enumerate(base):
            d = [a - b for a, b in zip(lp_of(i), s["old"])]
            if objective == "ppo":
                rl += sum(-s["adv"][0] * math.exp(v) for v in d) / len(d)
            else:  # gspo: the sequence ratio exp(mean log r) at every token
                rl += -s["adv"][0] * math.exp(sum(d) / len(d))
        mean = [sum(lp_of(i)) / len(lp_of(i)) for i in range(S)]
        return rl / S + o.coef / S * preference_loss_loop(mean, rewards, correct, G, o)

    for i, row in enumerate(fd_grad(total, base)):
        for t, g in enumerate(row):
            assert x.grad[i, t].item() == pytest.approx(g, rel=1e-6, abs=1e-10), (i, t)


@pytest.mark.parametrize("objective", ["ppo", "gspo"])
def test_split_4_micro_batches_x_2_dp_shards_sums_to_the_batch(objective):
    """Each of the 8 pieces holds one sequence, so every group and every pair is cut across micro-batches and DP
    ranks; the stage's shifts, computed once on the whole batch, keep the sum equal to the full batch's (1e-12)."""
    o = DastSimpoOptions(coef=1.0, margin=0.05, cross_pairs=True)
    lengths = [3, 6, 2, 5, 4, 7, 1, 5]
    rewards, correct = make_groups(8, 2)
    seqs = make_seqs(9, lengths)
    rng = random.Random(10)
    for s in seqs:  # off-policy a little: the ratio moves, the shifts stay those of π_old
        s["lp"] = [v + rng.gauss(0, 0.05) for v in s["lp"]]
    seqs, shift = shifted(seqs, rewards, correct, o)
    assert shift.abs().sum() > 0
    check_split_sums(call, objective, seqs, padded, {})


def test_run_stage_reads_policy_tokens_and_keeps_per_token_advantages():
    o = DastSimpoOptions(margin=0.0)
    old = [[-0.5, -1.0, -3.0], [-2.0, -0.1], [-0.3], [-1.2, -0.4]]
    masks = [[1, 1, 0], None, None, [1, 1]]
    batch = [TrainSample(tokens=[9] + [1] * len(lp), prompt_len=1, advantage=0.25, old_logp=lp, loss_mask=m)
             for lp, m in zip(old, masks)]
    batch[1].advantage = [0.1, -0.2]  # an earlier token stage's per-token values
    rewards, correct = [1.6, 1.3, -0.2, -0.5], [True, True, False, False]
    ctx = TokenContext(group_size=4, step=0, seed=0, kl_coef=0.0, rewards=rewards, correct=correct)
    metrics = run_token_stages(parse_stages([{"name": "dast_simpo", "margin": 0.0}]), batch, ctx)
    mean = [(-0.5 - 1.0) / 2, (-2.0 - 0.1) / 2, -0.3, (-1.2 - 0.4) / 2]  # the observation token left out
    shift, _ = dast_simpo_advantages(torch.tensor(rewards, dtype=F64), torch.tensor(correct),
                                     torch.tensor(mean, dtype=F64), 4, o)
    assert batch[0].advantage == pytest.approx([0.25 + shift[0].item()] * 3, rel=1e-15)
    assert batch[1].advantage == pytest.approx([0.1 + shift[1].item(), -0.2 + shift[1].item()], rel=1e-15)
    # two pairs, (0, 1) and (2, 3), each alone in its kind: winner +, loser −, by the same amount
    w = o.coef * o.beta * 4 / 2 / (1 + math.exp(o.beta * (mean[0] - mean[1]) - o.gamma))
    assert shift[0].item() == pytest.approx(w, rel=1e-12) and shift[1].item() == pytest.approx(-w, rel=1e-12)
    assert metrics["dast_simpo/pairs"] == 2 and metrics["dast_simpo/groups_with_pairs"] == 1


def test_stage_refuses_ragged_batch_and_missing_inputs():
    x = TrainSample(tokens=[1, 2, 3], prompt_len=1, advantage=0.1, old_logp=[-1.0, -1.0])
    s = SimpleNamespace(options=DastSimpoOptions())
    with pytest.raises(ValueError, match=r"^group_size:"):
        run_dast_simpo_stage([x, x, x], s, SimpleNamespace(group_size=2, rewards=[1, 1, 1], correct=[1, 1, 1]))
    with pytest.raises(ValueError, match=r"^reward: stage dast_simpo"):
        run_dast_simpo_stage([x, x], s, SimpleNamespace(group_size=2, rewards=None, correct=None))


# ----------------------------------------------------------------------------- config and listing


def _cfg(stage=None, data=None, **algorithm):
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig

    d = config_data(objective=algorithm.pop("objective", "gspo"),
                    stages=[{"name": "dast_simpo", **(stage or {})}], **algorithm)
    d["data"].update({"length_reward": "dast", **(data or {})})
    cfg = from_dict(RunConfig, d)
    cfg._validate_algorithm()
    return cfg


def test_good_config_takes_the_old_logprob_pass():
    cfg = _cfg({"coef": 0.5, "beta": 2.5, "gamma": 1.4, "margin": 0.2, "cross_pairs": True})
    assert cfg.algorithm.needs_old_stats()
    assert {"old_logp", "reward", "correct"} <= cfg.algorithm.stage_inputs()


@pytest.mark.parametrize("kw, field, start", [
    (dict(data={"length_reward": "none"}), "data.length_reward", "stage dast_simpo (algorithm.stages[0]) builds"),
    (dict(data={"length_reward": "kimi"}), "data.length_reward", "stage dast_simpo"),
    (dict(loss_agg="token-mean"), "algorithm.loss_agg", "stage dast_simpo"),
    (dict(objective="ppo"), "algorithm.loss_agg", "stage dast_simpo"),  # ppo's own aggregation is token-mean
    (dict(stage={"beta": 0}), "algorithm.stages[0].beta", "dast_simpo: must be"),
    (dict(stage={"coef": -1.0}), "algorithm.stages[0].coef", "dast_simpo: must be"),
    (dict(stage={"gamma": -0.1}), "algorithm.stages[0].gamma", "dast_simpo: must be"),
    (dict(stage={"margin": -0.1}), "algorithm.stages[0].margin", "dast_simpo: must be"),
    (dict(stage={"cross_pairs": "yes"}), "algorithm.stages[0].cross_pairs", "dast_simpo: must be"),
    (dict(stage={"delta": 0.1}), "algorithm.stages[0]", "dast_simpo: unknown option"),
], ids=["no-length-reward", "other-length-reward", "token-mean", "ppo-auto", "beta", "coef", "gamma", "margin",
        "cross_pairs", "unknown"])
def test_config_refusals_name_the_field(kw, field, start):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _cfg(**kw)
    assert err.value.field == field, str(err.value)
    assert str(err.value.message).startswith(start), str(err.value)


def test_a_filter_that_keeps_groups_of_different_sizes_is_refused():
    from megapo.config import ConfigError

    cfg = _cfg(data={"group_filter": "gfpo", "group_filter_options": {"keep": 2}})
    with pytest.raises(ConfigError) as err:
        cfg._validate_data()
    assert err.value.field == "data.group_filter" and "dast_simpo" in err.value.message, str(err.value)


def test_ppo_with_seq_mean_token_mean_is_accepted():
    assert _cfg(objective="ppo", loss_agg="seq-mean-token-mean").algorithm.has_stage("dast_simpo")


def test_listed_with_paper_formula_and_assumptions(capsys):
    assert main(["objectives", "--stages", "--formulas"]) == 0
    out = capsys.readouterr().out
    e = next(e for e in entries("advantage_stage") if e.name == "dast_simpo")
    assert "arXiv:2503.04472" in e.paper and "dast_simpo" in out
    assert "Assumption: on-policy pairs from each step's groups" in e.formula
    for option in e.option_names():
        assert option in out


def test_one_training_step(tmp_path, tiny_moe):
    from train_runs import train_rows

    rows = train_rows(tmp_path, "dast_simpo", f"model.path={tiny_moe}", "train.steps=1", "data.prompts_per_step=16",
                      "data.length_reward=dast", "algorithm.stages=[{name: dast_simpo, margin: 0.0}]")
    assert rows[0]["step"] == 1 and math.isfinite(rows[0]["train/loss"])
    pairs = [v for k, v in rows[0].items() if k.endswith("dast_simpo/pairs")]
    assert pairs and pairs[0] > 0, sorted(rows[0])  # the stage ran and found pairs

"""Advantage and token-weight stages of issue 14 (megapo/algorithms/stages.py), each an algorithm.stages entry:
future_kl (FRPO's future-KL advantage), stapo (STAPO's spurious-token mask, renormalised) and nat_prefix
(NAT's random prefix cutting with Horvitz-Thompson weights). Each against a loop written from its formula at
float64; STAPO's batch-global renormalisation through policy_loss with float64 finite differences and the
4 micro-batches x 2 DP shards split invariance; NAT's weights unbiased over every cut and reproducible from
(seed, step); bad options refused at config time naming the field; the loop's wiring."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.stages import future_kl_advantages, token_mask_weights

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from objective_loops import assert_ppo_shards_sum, stapo_reference  # noqa: E402

config_data = partial(algorithm_configs.config_data, n_samples=3, seed=5)
make_cfg = partial(algorithm_configs.make_cfg, n_samples=3, seed=5)

F64 = torch.float64


def rand_lists(seed, lengths, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return [(-torch.rand(n, generator=g, dtype=F64) * scale).tolist() for n in lengths]


# ----------------------------------------------------------------------------- FRPO future KL


def test_future_kl_against_a_loop():
    lengths = [4, 1, 6, 3]
    old, ref = rand_lists(1, lengths), rand_lists(2, lengths)
    advantages = [0.8, -1.2, [0.1, 0.2, -0.3, 0.4, 0.5, -0.6], 0.0]  # scalar or per token
    beta = 0.07
    got = future_kl_advantages(advantages, old, ref, beta=beta)
    for i, n in enumerate(lengths):
        for t in range(n):
            a = advantages[i][t] if isinstance(advantages[i], list) else advantages[i]
            to_go = sum(old[i][s] - ref[i][s] for s in range(t, n))
            assert got[i][t].item() == pytest.approx(a - beta * to_go, rel=1e-13, abs=1e-15), (i, t)
    zero = future_kl_advantages(advantages, old, ref, beta=0.0)
    assert zero[0].tolist() == [0.8] * 4  # β = 0: the estimator's advantage
    with pytest.raises(ValueError, match=r"ref_logp\[1\]"):
        future_kl_advantages(advantages, old, [ref[0], [], ref[2], ref[3]], beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        future_kl_advantages(advantages, old, ref, beta=-1.0)


def test_future_kl_stage_in_the_loop_moves_the_kl_into_the_advantages():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(kl_coef=0.1, stages=[{"name": "future_kl"}])
    assert cfg.loss_spec().kl_coef == 0.0  # no loss-side KL
    assert make_cfg(kl_coef=0.1).loss_spec().kl_coef == 0.1
    assert cfg.algorithm.needs_old_stats() and cfg.algorithm.needs_reference()
    batch = [{"tokens": [1, 2, 3, 4], "prompt_len": 2, "advantage": 1.0, "old_logp": [-0.5, -1.0],
              "ref_logp": [-0.7, -0.4]},
             {"tokens": [1, 2, 3], "prompt_len": 2, "advantage": -1.0, "old_logp": [-2.0], "ref_logp": [-1.5]}]
    token_stages(batch, cfg, step=1)
    assert batch[0]["advantage"] == pytest.approx([1.0 - 0.1 * (0.2 - 0.6), 1.0 - 0.1 * -0.6], rel=1e-13)
    assert batch[1]["advantage"] == pytest.approx([-1.0 - 0.1 * -0.5], rel=1e-13)


# ----------------------------------------------------------------------------- STAPO


def stapo_batch():
    lengths = [5, 3, 6, 4, 2, 7, 3, 4]
    old = rand_lists(3, lengths, scale=4.0)  # probabilities from e^-4 to 1
    g = torch.Generator().manual_seed(4)
    ent = [(torch.rand(n, generator=g, dtype=F64) * 1.0).tolist() for n in lengths]
    advantages = [0.9, -0.5, 1.3, 0.4, -1.1, 0.7, [0.2, -0.9, 0.1], -0.3]
    return lengths, advantages, old, ent


@pytest.mark.parametrize("renorm", ["batch", "sequence", "none"])
def test_stapo_against_a_loop(renorm):
    lengths, advantages, old, ent = stapo_batch()
    opts = dict(prob_max=0.2, entropy_max=0.5, renorm=renorm)  # wide thresholds: a small batch exercises the mask
    got = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent, **opts)
    want = stapo_reference(advantages, old, ent, 0.2, 0.5, renorm)
    masked = sum(w == 0 for r in want for w in r)
    assert 0 < masked < sum(lengths) // 2  # the batch exercises the mask, on positive responses only
    for g_row, w_row in zip(got, want):
        assert g_row.tolist() == pytest.approx(w_row, rel=1e-13)


def test_stapo_renormalised_loss_formula_gradient_and_split():
    """renorm=batch with token-mean: the loss is the plain mean over the kept tokens only; 4 micro-batches x 2
    DP shards, each with the batch's weights, give the single-batch loss and gradient."""
    lengths, advantages, old, ent = stapo_batch()
    weights = token_mask_weights("stapo", lengths=lengths, advantages=advantages, old_logp=old, entropy=ent,
                                 prob_max=0.2, entropy_max=0.5)
    width = max(lengths)

    def pad(rows):
        out = torch.zeros(len(rows), width, dtype=F64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=F64)
        return out

    g = torch.Generator().manual_seed(9)
    lp = pad([torch.tensor(o, dtype=F64) + torch.randn(len(o), generator=g, dtype=F64) * 0.2 for o in old])
    o, w = pad(old), pad(weights)
    adv = pad([a if isinstance(a, list) else [a] * n for a, n in zip(advantages, lengths)])
    mask = pad([[1] * n for n in lengths]).bool()
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss("ppo", x, o, adv, mask, loss_agg="token-mean", token_weight=w)
    full.backward()
    kept = [(i, t) for i, n in enumerate(lengths) for t in range(n) if weights[i][t] > 0]
    expect = 0.0
    for i, t in kept:
        r = math.exp(lp[i, t].item() - o[i, t].item())
        a = adv[i, t].item()
        expect += -min(r * a, min(max(r, 0.8), 1.2) * a)
    assert full.item() == pytest.approx(expect / len(kept), rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda y: policy_loss("ppo", y, o, adv, mask, loss_agg="token-mean", token_weight=w)[0],
        (lp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)
    assert_ppo_shards_sum(lp, o, adv, mask, lengths, full, x.grad, token_weight=w)  # 2 DP x 4 micro


# ----------------------------------------------------------------------------- NAT random prefix cutting


class FixedCut:
    """A stand-in for numpy's Generator whose integers() returns the given cuts in turn."""

    def __init__(self, cuts):
        self.cuts = list(cuts)

    def integers(self, low, high):
        c = self.cuts.pop(0)
        assert low <= c < high
        return c


def test_nat_prefix_weights_and_unbiasedness_over_every_cut():
    from megapo.algorithms.registry import get

    fn = get("token_weight", "nat_prefix").fn
    (w,) = fn([5], FixedCut([3]))
    assert w.tolist() == pytest.approx([5 / 5, 5 / 4, 5 / 3, 0.0, 0.0], rel=1e-15)
    for n in (1, 4, 9):  # E_c[w_t] = (1/L)·Σ_c w_t(c) = 1 at every position: the HT estimator is unbiased
        mean = sum(fn([n], FixedCut([c]))[0] for c in range(1, n + 1)) / n
        assert mean.tolist() == pytest.approx([1.0] * n, rel=1e-13)


def test_nat_prefix_is_reproducible_from_seed_and_step():
    import numpy as np

    lengths = [6, 2, 9, 4]
    a = token_mask_weights("nat_prefix", lengths=lengths, seed=5, step=3)
    b = token_mask_weights("nat_prefix", lengths=lengths, seed=5, step=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # a resumed run's step 3 cuts as the unstopped one
    rng = np.random.default_rng([5, 3])  # the documented seeding, drawn here from the formula
    for w, n in zip(a, lengths):
        cut = int(rng.integers(1, n + 1))
        assert w.tolist() == pytest.approx([n / (n - t + 1) if t <= cut else 0.0 for t in range(1, n + 1)])
    others = [token_mask_weights("nat_prefix", lengths=lengths, seed=5, step=s) for s in range(4, 9)]
    assert any(not torch.equal(x[2], a[2]) for x in others)  # another step, other cuts


def test_token_mask_in_the_loop_multiplies_token_select():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(stages=[{"name": "token_select", "rho": 0.5}, {"name": "nat_prefix"}])
    assert not make_cfg(stages=[{"name": "nat_prefix"}]).algorithm.needs_old_stats()
    batch = [{"tokens": [1, 2, 3, 4, 5], "prompt_len": 2, "advantage": 1.0, "old_logp": [-0.1, -0.2, -0.3],
              "old_entropy": [0.9, 0.1, 0.8]},
             {"tokens": [1, 2, 3, 4], "prompt_len": 2, "advantage": -1.0, "old_logp": [-0.4, -0.5],
              "old_entropy": [0.2, 0.7]}]
    metrics = token_stages(batch, cfg, step=4)
    select = [[1.0, 0.0, 1.0], [0.0, 1.0]]  # top ceil(0.5·5) = 3 entropies: 0.9, 0.8, 0.7
    nat = token_mask_weights("nat_prefix", lengths=[3, 2], seed=5, step=4)
    for sample, s, n in zip(batch, select, nat):
        assert sample["token_weight"] == pytest.approx([a * b for a, b in zip(s, n.tolist())], rel=1e-13)
    assert metrics["nat_prefix/kept_frac"] == pytest.approx(float(torch.cat(nat).gt(0).double().mean()))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("algorithm, field, words", [
    ({"stages": [{"name": "futur_kl"}], "kl_coef": 0.1}, "algorithm.stages[0].name", "future_kl"),
    ({"stages": [{"name": "future_kl"}]}, "algorithm.kl_coef", "> 0"),
    ({"stages": [{"name": "stapoo"}]}, "algorithm.stages[0].name", "unknown stage"),
    ({"stages": [{"name": "stapo"}, {"name": "polarity"}]}, "algorithm.stages[1]", "sequence stage"),
    ({"stages": [{"prob_max": 0.1}]}, "algorithm.stages[0]", "name"),
    ({"stages": [{"name": "stapo", "prob_max": 0}]}, "algorithm.stages[0]", "prob_max"),
    ({"stages": [{"name": "stapo", "entropy_max": -1}]}, "algorithm.stages[0]", "entropy_max"),
    ({"stages": [{"name": "stapo", "renorm": "group"}]}, "algorithm.stages[0]", "renorm"),
    ({"stages": [{"name": "nat_prefix", "rho": 0.5}]}, "algorithm.stages[0]", "rho"),
    ({"stages": [{"name": "future_kl", "beta": 0.1}], "kl_coef": 0.1}, "algorithm.stages[0]", "beta"),
])
def test_bad_options_refused_at_config_time(algorithm, field, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(**algorithm)
    assert err.value.field == field and words in str(err.value)


def test_stapo_config_takes_the_old_pass_with_entropies():
    cfg = make_cfg(stages=[{"name": "stapo", "prob_max": 0.1, "renorm": "sequence"}])
    assert cfg.algorithm.needs_old_stats() and cfg.algorithm.needs_old_entropy()


# ----------------------------------------------------------------------------- D³S sample-level selection


def test_max_variance_subset_against_every_subset():
    import itertools

    from megapo.algorithms.stages import max_variance_subset

    g = torch.Generator().manual_seed(11)
    for trial in range(30):
        n = 2 + trial % 7
        values = (torch.randn(n, generator=g, dtype=F64) * 2).tolist()
        if trial % 5 == 0:
            values[1] = values[0]  # ties
        for k in range(1, n + 1):
            def var(idx):
                vals = [values[i] for i in idx]
                m = sum(vals) / len(vals)
                return sum((v - m) ** 2 for v in vals) / len(vals)

            best = max(var(c) for c in itertools.combinations(range(n), k))
            assert var(max_variance_subset(values, k)) == pytest.approx(best, rel=1e-12, abs=1e-15), (values, k)


def test_d3s_select_keeps_the_max_variance_rollouts_on_a_schedule():
    import itertools

    from megapo.algorithms.stages import select_samples

    adv = torch.tensor([[0.9, -1.2, 0.1, 0.3, -0.2, 1.4], [0.5, 0.5, -0.5, 0.2, -0.1, 0.05]], dtype=F64)
    for step, k in [(1, 2), (2, 3), (3, 4), (5, 6), (9, 6)]:  # keep 1/3 -> 1 over 4 steps: ceil(keep·6)
        out = select_samples(adv, step=step, keep=1 / 3, keep_end=1.0, anneal_steps=4)
        for row, got in zip(adv.tolist(), out.tolist()):
            kept = [i for i, v in enumerate(got) if v != 0.0]  # no advantage here is 0 itself
            assert len(kept) == k and all(got[i] == row[i] for i in kept), step

            def var(idx):
                m = sum(row[i] for i in idx) / len(idx)
                return sum((row[i] - m) ** 2 for i in idx) / len(idx)

            best = max(var(c) for c in itertools.combinations(range(6), k))
            assert var(kept) == pytest.approx(best, rel=1e-12), step
    assert select_samples(adv, keep=0.01).ne(0).sum(-1).tolist() == [2, 2]  # at least 2 per group


def fake_groups(rewards_per_group, prompts):
    from types import SimpleNamespace

    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    def sample():
        return SimpleNamespace(prompt_ids=[1, 2], output_ids=[3, 4], logprobs=[-0.1, -0.2], routes=None,
                               finish_reason="stop")

    return [Group(Example(p, "0"), [sample() for _ in r], list(r)) for r, p in zip(rewards_per_group, prompts)]


def test_d3s_select_stage_in_train_samples():
    from megapo.algorithms import compute_advantages
    from megapo.trainer.update import train_samples

    cfg = make_cfg(stages=[{"name": "d3s_select", "keep": 0.5}])
    cfg.rollout.n_samples = 4
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.0]]
    batch = train_samples(fake_groups(rewards, ["a", "b"]), cfg, step=1)
    adv = compute_advantages("grpo", torch.tensor(rewards, dtype=F64), group_size=4).tolist()
    got = [s["advantage"] for s in batch]
    assert [v != 0 for v in got[4:]] == [False, True, False, True]  # 0.9 and 0.0: the widest pair
    assert got[5] == pytest.approx(adv[1][1]) and got[7] == pytest.approx(adv[1][3])


# ----------------------------------------------------------------------------- DCPO cumulative standardisation


def cumulative_reference(history):
    """Advantages of each step's groups from all the rewards of its prompt up to and including that step."""
    import statistics

    seen: dict[str, list[float]] = {}
    out = []
    for prompts, rewards in history:
        step = []
        for p, r in zip(prompts, rewards):
            seen.setdefault(p, []).extend(r)
            mu, sd = statistics.fmean(seen[p]), statistics.pstdev(seen[p])
            step.append([(x - mu) / (sd + 1e-6) if sd > 0 else 0.0 for x in r])
        out.append(step)
    return out


HISTORY = [(["p", "q"], [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
           (["q", "r"], [[1.0, 0.0, 0.0], [0.5, 0.5, 0.5]]),
           (["p", "q"], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])]  # equal rewards: still a signal from the history


def test_cumulative_standardisation_against_a_loop_and_a_json_round_trip():
    import json

    from megapo.algorithms.stages import PromptRewardStats, cumulative_advantages

    want = cumulative_reference(HISTORY)
    stats = PromptRewardStats()
    for (prompts, rewards), expect in zip(HISTORY, want):
        got = cumulative_advantages(torch.tensor(rewards, dtype=F64), prompts, stats)
        assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expect]
    assert any(v != 0 for v in want[2][0])  # p's third group is all 1.0, its history is not
    stats = PromptRewardStats()  # resumed after step 1 from the JSON state
    cumulative_advantages(torch.tensor(HISTORY[0][1], dtype=F64), HISTORY[0][0], stats)
    resumed = PromptRewardStats(json.loads(json.dumps(stats.state_dict())))
    for (prompts, rewards), expect in zip(HISTORY[1:], want[1:]):
        got = cumulative_advantages(torch.tensor(rewards, dtype=F64), prompts, resumed)
        assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in expect]
    with pytest.raises(ValueError, match="prompt_stats"):
        PromptRewardStats({"abc": [0, 1.0, 2.0]})


def test_cumulative_statistics_survive_a_checkpoint(tmp_path):
    """The loop's running statistics go into TrainerState.extra at a checkpoint and come back from it on
    --resume: the resumed run's next advantages equal the uninterrupted run's."""
    from megapo.trainer import checkpoint as ck
    from megapo.trainer.update import new_prompt_stats, stage_state, train_samples

    cfg = make_cfg(stages=[{"name": "cumulative_std"}])
    cfg.rollout.n_samples = 3
    assert new_prompt_stats(make_cfg()) is None and stage_state(None) == {}
    straight = new_prompt_stats(cfg)
    straight_adv = [[s["advantage"] for s in train_samples(fake_groups(r, p), cfg, prompt_stats=straight)]
                    for p, r in HISTORY]
    first = new_prompt_stats(cfg)
    train_samples(fake_groups(HISTORY[0][1], HISTORY[0][0]), cfg, prompt_stats=first)
    path = ck.save_checkpoint(tmp_path, ck.TrainerState(1, {}, 1, extra=stage_state(first)))
    state = ck.load_checkpoint(path, restore_rng=False)
    resumed = new_prompt_stats(cfg, state.extra)
    for (prompts, rewards), expect in zip(HISTORY[1:], straight_adv[1:]):
        got = [s["advantage"] for s in train_samples(fake_groups(rewards, prompts), cfg, prompt_stats=resumed)]
        assert got == expect  # exactly: float64 state through JSON
    want = cumulative_reference(HISTORY)
    assert straight_adv[2] == pytest.approx([v for row in want[2] for v in row], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("algorithm, field, words", [
    ({"stages": [{"name": "d3s_select", "keep": 0}]}, "algorithm.stages[0]", "keep"),
    ({"stages": [{"name": "d3s_select", "keep": 0.5, "keep_end": 0.9}]}, "algorithm.stages[0]", "anneal_steps"),
    ({"stages": [{"name": "d3s_select", "rho": 0.5}]}, "algorithm.stages[0]", "rho"),
    ({"stages": [{"name": "cumulative_ema"}]}, "algorithm.stages[0].name", "cumulative_std"),
    ({"stages": [{"name": "cumulative_std"}], "advantage": "rloo"}, "algorithm.stages[0]", "grpo"),
    ({"stages": [{"name": "polarity"}, {"name": "cumulative_std"}]}, "algorithm.stages[1]", "first stage"),
])
def test_bad_sample_stage_options_refused_at_config_time(algorithm, field, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(**algorithm)
    assert err.value.field == field and words in str(err.value)

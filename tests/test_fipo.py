"""FIPO's future-KL token advantage (megapo/algorithms/stages.py `fipo`, algorithm.token_advantage=fipo): against
a loop written out from its formula, each option's effect, through policy_loss with a float64 finite-difference
gradient, bad options refused at config time naming the field, and the loop's wiring (which log-probs it reads,
the reference it loads). No split-invariance check: the weight of a token reads only its own response."""

from __future__ import annotations

import math

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.stages import token_advantages

F64 = torch.float64


def rand_lists(seed, lengths, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(-torch.rand(n, generator=g, dtype=F64) * scale).tolist() for n in lengths]


def fipo_reference(adv, old, other, half_life, clip, high_only):
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
def test_fipo_against_a_loop(against, half_life, clip, high_only):
    lengths = [3, 7, 1, 5, 4, 2]
    old, other = rand_lists(0, lengths), rand_lists(1, lengths)
    adv = torch.tensor([0.9, -0.4, 1.3, -1.1, 0.0, 0.6], dtype=F64)
    field = {"reference": "ref_logp", "engine": "rollout_logp"}[against]
    got = token_advantages("fipo", adv, old, None, group_size=3, **{field: other}, against=against,
                           half_life=half_life, clip=clip, clip_high_only=high_only)
    want = fipo_reference(adv.tolist(), old, other, half_life, clip, high_only)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, rel=1e-12, abs=1e-15)
    flat = torch.cat(got) / torch.cat([torch.full((n,), a, dtype=F64) for a, n in zip(adv.tolist(), lengths)])
    weights = flat[torch.isfinite(flat)]
    assert not torch.allclose(weights, torch.ones_like(weights))  # the weight moves credit (the test can fail)
    assert weights.min() >= (1.0 if high_only else 1.0 - clip) - 1e-12 and weights.max() <= 1.0 + clip + 1e-12


def test_fipo_discount_and_clip_each_act():
    old, ref = [[-0.1, -0.2, -0.3]], [[-0.2, -0.2, -0.6]]  # Δ = 0.1, 0, 0.3
    one = torch.tensor([1.0], dtype=F64)

    def run(**o):
        return token_advantages("fipo", one, old, None, group_size=1, ref_logp=ref, **o)[0].tolist()

    gamma = 2.0 ** (-1.0 / 4.0)
    assert run(half_life=4.0, clip=0.9) == pytest.approx(
        [math.exp(0.1 + gamma ** 2 * 0.3), math.exp(gamma * 0.3), math.exp(0.3)], rel=1e-13)
    assert run(half_life=4.0, clip=0.05) == pytest.approx([1.05, 1.05, 1.05], rel=1e-13)  # clipped at 1 + ε
    assert run(half_life=None, clip=0.9)[0] == pytest.approx(math.exp(0.4), rel=1e-13)  # no discount
    # Δ < 0 everywhere: high-only keeps the plain advantage, the two-sided clip lowers it to 1 − ε at most
    neg = token_advantages("fipo", one, ref, None, group_size=1, ref_logp=old, clip=0.2)[0].tolist()
    assert neg == [1.0, 1.0, 1.0]
    low = token_advantages("fipo", one, ref, None, group_size=1, ref_logp=old, clip=0.2, clip_high_only=False)
    assert low[0].tolist() == pytest.approx([max(math.exp(-(0.1 + 2 ** (-1 / 32) ** 2 * 0.3)), 0.8),
                                             max(math.exp(-2 ** (-1 / 32) * 0.3), 0.8), 0.8], rel=1e-13)


def test_fipo_without_the_other_log_probs_refused():
    old = rand_lists(2, [2, 3])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    with pytest.raises(ValueError, match=r"ref_logp\[0\]"):
        token_advantages("fipo", adv, old, None, group_size=2)
    with pytest.raises(ValueError, match=r"rollout_logp\[1\]: expected 3"):
        token_advantages("fipo", adv, old, None, group_size=2, rollout_logp=[old[0], old[1][:2]], against="engine")


def test_fipo_advantages_through_policy_loss_formula_and_gradient():
    """The per-token advantages drive ppo's loss as A_t·f_t (sequence-mean of token-means, written out), and
    its float64 autograd gradient matches finite differences."""
    lengths = [3, 5, 2, 4]
    old, ref = rand_lists(3, lengths), rand_lists(4, lengths)
    adv_seq = [0.8, -0.6, 1.2, -0.3]
    per_token = token_advantages("fipo", torch.tensor(adv_seq, dtype=F64), old, None, group_size=2, ref_logp=ref,
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
    f = fipo_reference([1.0] * 4, old, ref, 3.0, 0.5, False)
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


def config_data(**algorithm):
    return {
        "model": {"path": "/nonexistent"},
        "algorithm": {"objective": "ppo", "advantage": "grpo", **algorithm},
        "rollout": {"engine": "embedded", "n_samples": 2, "max_new_tokens": 8},
        "data": {"task": "addition", "max_prompt_tokens": 16, "prompts_per_step": 8},
        "train": {"steps": 3, "output_dir": "/tmp/unused"},
    }


def make_cfg(**algorithm):
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig

    cfg = from_dict(RunConfig, config_data(**algorithm))
    cfg._validate_algorithm()
    return cfg


@pytest.mark.parametrize("options, words", [
    ({"half_life": 0}, "half_life"), ({"half_life": -3.0}, "half_life"), ({"clip": 1.0}, "clip"),
    ({"clip": -0.1}, "clip"), ({"clip_high_only": "yes"}, "clip_high_only"), ({"against": "ref"}, "against"),
    ({"gamma": 0.9}, "gamma"),
])
def test_bad_fipo_options_refused_at_config_time(options, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(token_advantage="fipo", token_advantage_options=options)
    assert err.value.field == "algorithm.token_advantage_options" and words in str(err.value)


def test_fipo_against_engine_refused_where_pi_old_is_the_engine():
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(token_advantage="fipo", token_advantage_options={"against": "engine"}, old_policy="engine")
    assert err.value.field == "algorithm.token_advantage_options" and "old_policy" in str(err.value)
    make_cfg(token_advantage="fipo", token_advantage_options={"against": "engine"}, old_policy="learner")


def test_fipo_in_the_loop_reads_the_reference_and_loads_it():
    from megapo.trainer.update import token_stages

    cfg = make_cfg(token_advantage="fipo", token_advantage_options={"clip": 0.5, "half_life": None})
    a = cfg.algorithm
    assert a.needs_reference() and a.needs_old_stats() and not a.needs_old_entropy()
    assert cfg.loss_spec().kl_coef == 0.0  # the reference feeds the advantage only: no loss-side KL
    engine = make_cfg(token_advantage="fipo", token_advantage_options={"against": "engine"})
    assert not engine.algorithm.needs_reference()
    batch = [{"advantage": 1.0, "old_logp": [-0.5, -1.0], "ref_logp": [-0.7, -1.1], "rollout_logp": [0.0, 0.0]},
             {"advantage": -1.0, "old_logp": [-2.0], "ref_logp": [-1.5], "rollout_logp": [0.0]}]
    token_stages(batch, cfg, step=1)
    assert batch[0]["advantage"] == pytest.approx([min(math.exp(0.3), 1.5), math.exp(0.1)], rel=1e-13)
    assert batch[1]["advantage"] == pytest.approx([-1.0], rel=1e-13)  # Δ < 0, high-only clip: weight 1

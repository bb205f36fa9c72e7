"""DelTA (Zhang, Wu and Lin 2026, DelTA: Discriminative Token Credit Assignment for Reinforcement Learning from
Verifiable Rewards, arXiv:2605.21467), the stage delta, against its authors' algorithm written out here as loops over
tokens and coordinates (never the function's own output): the advantage-weighted side centroids of the token-gradient
proxies (1 − π_old(y))·h, the margins and their scales, the soft-assignment refinements, the weights in
[w_min, w_max] normalised to mean 1; the learner glue (one hidden-state pass on the replayed routes); split
invariance of the loss on the reweighted advantages; a float64 finite-difference gradient; the refusals by field;
the registry and the stability bench's variant. The hidden states themselves are checked against transformers under
every layout in tests/test_learner_layouts.py (test_response_hidden_matches_transformers_in_every_layout)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megapo.algorithms.discriminative import DeltaOptions, delta_weights
from megapo.algorithms.sample import TrainSample
from megapo.config import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algorithm_configs import make_cfg  # noqa: E402
from objective_loops import assert_ppo_gradient_matches_fd, assert_ppo_split_invariant  # noqa: E402
from one_rank import response_pass_stub  # noqa: E402

EPS = 1e-8


def sig(x):
    return 1 / (1 + math.exp(-x))


def ref_weights(adv, old, hidden, masks, steps, w_min, w_max):
    """The authors' compute_log_prob_h ("Normal", d = 1, λ_w = 1, γ_time = 1) as loops over plain floats."""
    toks = []  # (sample, position, v, A)
    for i, (a, lp, h) in enumerate(zip(adv, old, hidden)):
        for t in range(len(lp)):
            if masks is None or masks[i][t]:
                toks.append((i, t, [(1 - math.exp(lp[t])) * x for x in h[t]], a))
    dim = len(hidden[0][0])

    def centroid(weights):
        num, den = [0.0] * dim, 0.0
        for (_, _, v, _), w in zip(toks, weights):
            for k in range(dim):
                num[k] += w * v[k]
            den += w
        return [x / max(den, EPS) for x in num]

    def dist(v, mu):
        return sum((v[k] - mu[k]) ** 2 for k in range(dim))

    def margins(mu_p, mu_n):
        mp = [dist(v, mu_n) - dist(v, mu_p) for _, _, v, _ in toks]
        return mp, [-x for x in mp]

    def scale(ms, positive):
        side = [m for m, (_, _, _, a) in zip(ms, toks) if (a > 0 if positive else a < 0)]
        if not side:
            return math.sqrt(EPS)
        mean = sum(side) / len(side)
        return math.sqrt(max(sum(m * m for m in side) / len(side) - mean * mean, EPS))

    mu_p = centroid([a if a > 0 else 0.0 for *_, a in toks])
    mu_n = centroid([-a if a < 0 else 0.0 for *_, a in toks])
    mp, mn = margins(mu_p, mu_n)
    gp, gn = scale(mp, True), scale(mn, False)
    for _ in range(steps):
        wp = [sig(m / gp) * a if a > 0 else 0.0 for m, (*_, a) in zip(mp, toks)]
        wn = [sig(m / gn) * -a if a < 0 else 0.0 for m, (*_, a) in zip(mn, toks)]
        new_p, new_n = centroid(wp), centroid(wn)
        gp, gn = scale(mp, True), scale(mn, False)  # the margins of the centroids before this refinement
        mu_p, mu_n = new_p, new_n
        mp, mn = margins(mu_p, mu_n)
    w = []
    for m_p, m_n, (*_, a) in zip(mp, mn, toks):
        w.append(w_min + (w_max - w_min) * sig(m_p / gp) if a > 0 else
                 w_min + (w_max - w_min) * sig(m_n / gn) if a < 0 else w_min)
    norm = len(w) / sum(w)
    out = [[0.0] * len(lp) for lp in old]
    for (i, t, _, _), x in zip(toks, w):
        out[i][t] = x * norm
    return out


def make_batch(seed, lengths=(4, 6, 3, 5, 2, 4), dim=5):
    gen = torch.Generator().manual_seed(seed)
    old = [(-torch.rand(n, generator=gen, dtype=torch.float64) * 3).tolist() for n in lengths]
    hidden = [torch.randn(n, dim, generator=gen, dtype=torch.float64).tolist() for n in lengths]
    return old, hidden


@pytest.mark.parametrize("steps", [0, 1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_weights_match_the_authors_algorithm_written_out(steps, masked):
    old, hidden = make_batch(1)
    adv = [0.9, -0.4, 0.0, -1.2, 0.5, -0.4]
    masks = [[1, 1, 0, 1], [1] * 6, [1, 0, 1], [0, 1, 1, 1, 1], [1, 1], [1, 1, 1, 0]] if masked else None
    o = DeltaOptions(steps=steps, w_min=0.7, w_max=1.4)
    got, metrics = delta_weights(adv, [torch.tensor(x, dtype=torch.float64) for x in old], [torch.tensor(h, dtype=torch.float64) for h in hidden], masks, o)
    want = ref_weights(adv, old, hidden, masks, steps, 0.7, 1.4)
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w, abs=1e-12)
    kept = [x for g, m in zip(got, masks or [[1] * len(o_) for o_ in old]) for x, k in zip(g.tolist(), m) if k]
    assert sum(kept) / len(kept) == pytest.approx(1.0, abs=1e-12)  # self-normalised over the policy tokens
    assert 0 < metrics["delta/discriminator_acc"] <= 1


def test_a_token_close_to_its_own_side_weighs_more():
    """Two sides whose token gradients differ along one axis, with a shared pattern in both: the shared tokens weigh
    less than the side-specific ones, on each side (what the abstract says the weights do)."""
    e = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    hidden = [[e[0], e[0], e[2]], [e[0], e[2]], [e[1], e[1], e[2]], [e[1], e[2]]]  # e[2]: shared by both sides
    old = [[-20.0] * len(h) for h in hidden]  # π_old ≈ 0: v = h
    got, metrics = delta_weights([1.0, 1.0, -1.0, -1.0], [torch.tensor(x, dtype=torch.float64) for x in old],
                                 [torch.tensor(h, dtype=torch.float64) for h in hidden], None, DeltaOptions())
    assert got[0][0] > got[0][2] and got[2][0] > got[2][2]
    assert metrics["delta/discriminator_acc"] == pytest.approx(6 / 10)  # the 4 shared rows sit on the boundary


def test_zero_advantage_samples_take_w_min_before_normalising():
    old, hidden = make_batch(2, lengths=(3, 3, 3))
    got, _ = delta_weights([0.0, 0.0, 0.0], [torch.tensor(x, dtype=torch.float64) for x in old], [torch.tensor(h, dtype=torch.float64) for h in hidden], None,
                           DeltaOptions(w_min=0.5))
    assert all(g.tolist() == pytest.approx([1.0] * 3, abs=1e-15) for g in got)


def test_learner_response_hidden_reads_the_kept_rows():
    """Learner.response_hidden's glue on a hand-made micro-batch (2 sequences at 2 and 3 selected slots; the
    schedule stubbed, the head's hook standing in as the rows it kept): one [tokens, hidden] tensor per sequence."""
    from megapo.learner.learner import Learner

    logits = torch.zeros(2, 4, 7)
    rows = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    mb = SimpleNamespace(select=torch.tensor([1, 2, 5, 6, 7]), order=[0, 1], sizes=[2, 3], head_selected=True)
    me = response_pass_stub(logits, 7, mb)
    me._head = SimpleNamespace(keep_input=False, kept=rows)
    got = Learner.response_hidden(me, [[1, 2, 3, 4], [1, 2, 3, 4, 5]], [2, 2])
    assert torch.equal(got[0], rows[:2]) and torch.equal(got[1], rows[2:])
    assert me._head.keep_input is False and me._head.kept is None


def test_the_loop_takes_one_hidden_pass_on_the_replayed_routes():
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import advantage_stages

    old, hidden = make_batch(3, lengths=(3, 4, 2, 5))
    adv = [0.5, -0.5, -0.5, 0.5]
    batch = [TrainSample([1, 2] + [3] * len(o), 2, a, old_logp=o, routes=f"routes{i}")
             for i, (o, a) in enumerate(zip(old, adv))]
    calls = []

    class HiddenLearner:
        def response_hidden(self, sequences, prompt_lens, routes=None):
            calls.append((sequences, prompt_lens, routes))
            return [torch.tensor(h, dtype=torch.float64) for h in hidden]

    groups = [SimpleNamespace(rewards=[1.0, 0.0], samples=[None, None], privileged=False),
              SimpleNamespace(rewards=[0.0, 1.0], samples=[None, None], privileged=False)]
    cfg = make_cfg(stages=[{"name": "delta"}], n_samples=2)
    metrics = advantage_stages(HiddenLearner(), batch, groups, cfg, 1, None, StepTimer())
    assert calls == [([s.tokens for s in batch], [2] * 4, [f"routes{i}" for i in range(4)])]
    want = ref_weights(adv, old, hidden, None, 1, 0.8, 1.2)
    for s, a, w in zip(batch, adv, want):
        assert s.advantage == pytest.approx([a * x for x in w], abs=1e-12)
    assert "delta/discriminator_acc" in metrics


def stage_inputs(seed):
    """π_old per token, the stage's advantages (one list per sample) and the lengths, on a batch of 8."""
    old, hidden = make_batch(seed, lengths=(4, 6, 3, 5, 2, 6, 4, 3))
    adv = [0.9, -0.3, -0.3, 0.9, -0.6, 0.2, 0.9, -0.3]
    weights, _ = delta_weights(adv, [torch.tensor(x, dtype=torch.float64) for x in old],
                               [torch.tensor(h, dtype=torch.float64) for h in hidden], None, DeltaOptions())
    return old, [(a * w).tolist() for a, w in zip(adv, weights)], [len(o) for o in old]


def test_ppo_on_the_stage_advantages_is_split_invariant_and_its_gradient_matches_finite_differences():
    """The stage's statistics are taken once, before the split: PPO's loss and gradient on its advantages over 2 DP
    ranks x 4 micro-batches equal the one-batch ones (1e-12), and that gradient equals float64 finite differences."""
    old, adv, lengths = stage_inputs(6)
    assert_ppo_split_invariant(old, adv, lengths, seed=7)
    assert_ppo_gradient_matches_fd(old, adv, lengths, seed=9)


@pytest.mark.parametrize("option, value", [("steps", -1), ("steps", 1.5), ("w_min", -0.1), ("w_max", 0.5),
                                           ("w_min", float("nan"))])
def test_options_refused_naming_the_field(option, value):
    with pytest.raises(ConfigError) as err:
        make_cfg(stages=[{"name": "delta", option: value}])
    assert err.value.field == f"algorithm.stages[0].{'w_max' if option == 'w_max' else option}"


def test_stage_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match=r"^hidden\[0\]"):
        delta_weights([1.0], [torch.zeros(2)], [torch.zeros(3, 4)], None, DeltaOptions())
    with pytest.raises(ValueError, match="^hidden:"):
        delta_weights([1.0, 2.0], [torch.zeros(2)], [torch.zeros(2, 4)], None, DeltaOptions())


def test_the_stage_reads_one_sequence_advantage_per_sample():
    from megapo.algorithms.pipeline import TokenContext, run_token_stages, parse_stages

    old, hidden = make_batch(4, lengths=(2, 2))
    batch = [TrainSample([1, 2, 3, 4], 2, [0.5, 0.1], old_logp=old[0]), TrainSample([1, 2, 3, 4], 2, -0.5,
                                                                                    old_logp=old[1])]
    ctx = TokenContext(group_size=2, step=0, seed=0, kl_coef=0.0, hidden=[torch.tensor(h, dtype=torch.float64) for h in hidden])
    with pytest.raises(ValueError, match=r"^advantages\[0\]: stage delta reads one sequence advantage"):
        run_token_stages(parse_stages([{"name": "delta"}]), batch, ctx)


def test_registered_with_its_paper_and_in_the_bench():
    from megapo.algorithms.registry import entries
    from tools.bench import stability as st

    (entry,) = [e for e in entries("advantage_stage") if e.name == "delta"]
    assert "DelTA: Discriminative Token Credit Assignment" in entry.paper and "arXiv:2605.21467" in entry.paper
    assert "v_t = (1 − π_old(y_t))·h_t" in entry.formula and "Assumption, marked" in entry.formula
    assert "delta" in st.variant_names("delta")


def test_train_two_steps(tmp_path, tiny_moe):
    """`megapo train` with the stage on ppo: the learner's hidden-state pass on the tiny MoE, both steps update with a
    finite loss and log the stage's metrics."""
    from train_runs import train_rows

    rows = train_rows(tmp_path, "delta", f"model.path={tiny_moe}", "train.steps=2", "data.prompts_per_step=4",
                      "rollout.n_samples=4", "algorithm.objective=ppo", "algorithm.stages=[{name: delta}]")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_nonfinite"] == 0 for r in rows)
    assert all(0 <= r["delta/discriminator_acc"] <= 1 and r["delta/weight_pos_mean"] > 0 for r in rows)

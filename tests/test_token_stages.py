"""Stages between the estimator and the loss (megapo/algorithms/stages.py): advantage polarity, per-token
advantages (GTPO, GRPO-S, advantage reweighting), token selection by π_old entropy. Each against a
reference written out here as loops from its formula; token weights through policy_loss with a float64
finite-difference gradient check and the 4 micro-batches x 2 DP shards split invariance; bad options
refused at config time naming the field; the loop's wiring (which pass, which sample fields)."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.stages import apply_polarity, token_advantages, token_select_weights

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import algorithm_configs  # noqa: E402
from objective_loops import assert_ppo_shards_sum  # noqa: E402

config_data = partial(algorithm_configs.config_data, n_samples=2, seed=5)

F64 = torch.float64


def rand_batch(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    old_logp = [-torch.rand(n, generator=g, dtype=F64) * 3 for n in lengths]
    entropy = [torch.rand(n, generator=g, dtype=F64) * 2 + 0.01 for n in lengths]
    return old_logp, entropy


# ----------------------------------------------------------------------------- polarity


def test_polarity_each_mode_against_the_rule():
    adv = torch.tensor([[1.5, -0.5, 0.0, -2.0], [0.25, 0.75, -1.0, 0.0]], dtype=F64)
    assert apply_polarity(adv) is adv  # the default path does nothing
    for mode in ("both", "positive", "negative"):
        out = apply_polarity(adv, mode, pos_scale=0.1, neg_scale=2.0)
        for a, o in zip(adv.flatten().tolist(), out.flatten().tolist()):
            if a > 0:
                expect = 0.1 * a if mode != "negative" else 0.0
            elif a < 0:
                expect = 2.0 * a if mode != "positive" else 0.0
            else:
                expect = 0.0
            assert o == pytest.approx(expect, abs=1e-15), (mode, a)


# ----------------------------------------------------------------------------- per-token advantages


def gtpo_reference(adv, entropy, n, alpha1, alpha2, eps):
    out = []
    for i, (a, h) in enumerate(zip(adv, entropy)):
        group = range(i // n * n, i // n * n + n)
        row = []
        for t in range(len(h)):
            if a == 0:
                row.append(0.0)
                continue
            same_side = [k for k in group if (adv[k] > 0) == (a > 0) and adv[k] != 0 and len(entropy[k]) > t]
            value = (lambda x: x) if a > 0 else (lambda x: 1.0 / (x + eps))
            total = sum(value(entropy[k][t]) for k in same_side)
            share = len(same_side) * value(h[t]) / total
            row.append(a * (alpha1 + alpha2 * share))
        out.append(row)
    return out


def test_gtpo_against_a_loop():
    lengths = [3, 5, 2, 4, 6, 1, 4, 3]
    old_logp, entropy = rand_batch(0, lengths)
    adv = torch.tensor([0.9, -0.3, 1.2, -1.1, 0.0, 0.5, -0.7, -0.2], dtype=F64)
    out = token_advantages("gtpo", adv, old_logp, entropy, group_size=4, alpha1=0.3, alpha2=0.7)
    ref = gtpo_reference(adv.tolist(), [e.tolist() for e in entropy], 4, 0.3, 0.7, 1e-6)
    for got, want in zip(out, ref):
        assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the entropy share moves credit between tokens (the test can fail): not the plain advantage
    assert not torch.allclose(out[0], torch.full((3,), 0.9, dtype=F64))


def test_grpo_s_against_a_loop():
    lengths = [3, 5, 2, 4, 6, 1]
    old_logp, entropy = rand_batch(1, lengths)
    adv = torch.tensor([0.9, -0.3, 1.2, 0.4, -1.0, -0.6], dtype=F64)
    out = token_advantages("grpo_s", adv, old_logp, entropy, group_size=3, alpha1=0.5, alpha2=0.5, eps=1e-3)
    mean_h = [sum(e.tolist()) / len(e) for e in entropy]
    for i, got in enumerate(out):
        a = adv[i].item()
        group = range(i // 3 * 3, i // 3 * 3 + 3)
        side = [k for k in group if (adv[k] > 0) == (a > 0) and adv[k] != 0]
        value = (lambda x: x) if a > 0 else (lambda x: 1.0 / (x + 1e-3))
        share = len(side) * value(mean_h[i]) / sum(value(mean_h[k]) for k in side)
        assert got.tolist() == pytest.approx([a * (0.5 + 0.5 * share)] * lengths[i], rel=1e-12)


def test_advantage_reweighting_against_the_formula():
    lengths = [4, 2, 3, 5]
    old_logp, _ = rand_batch(2, lengths)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=F64)
    out = token_advantages("advantage_reweighting", adv, old_logp, None, group_size=2, alpha=0.3)
    for a, lp, got in zip(adv.tolist(), old_logp, out):
        assert got.tolist() == pytest.approx([(0.3 * math.exp(x) + 0.7) * a for x in lp.tolist()], rel=1e-12)


def test_entropy_stage_without_entropy_refused():
    old_logp, _ = rand_batch(3, [2, 3])
    with pytest.raises(ValueError, match="entropy"):
        token_advantages("gtpo", torch.tensor([1.0, -1.0], dtype=F64), old_logp, None, group_size=2)
    with pytest.raises(ValueError, match="alpha"):
        token_advantages("advantage_reweighting", torch.tensor([1.0, -1.0], dtype=F64), old_logp, group_size=2,
                         alpha=1.5)


# ----------------------------------------------------------------------------- token selection


def select_reference(scores_per_sample, rho, weight):
    flat = sorted((s for row in scores_per_sample for s in row), reverse=True)
    k = max(1, math.ceil(rho * len(flat)))
    tau = flat[k - 1]
    return [[1.0 if s >= tau else weight for s in row] for row in scores_per_sample]


@pytest.mark.parametrize("score", ["entropy", "adv_entropy"])
def test_token_select_against_a_sort(score):
    lengths = [3, 7, 2, 5]
    _, entropy = rand_batch(4, lengths)
    adv = [0.5, [0.1 * t - 0.3 for t in range(7)], -1.5, 0.8]  # scalars and a per-token list
    weights = token_select_weights(adv, entropy, score=score, rho=0.3, weight=0.25)
    scores = []
    for a, h in zip(adv, entropy):
        a_t = a if isinstance(a, list) else [a] * len(h)
        scores.append([hh if score == "entropy" else abs(aa) * hh for aa, hh in zip(a_t, h.tolist())])
    assert [w.tolist() for w in weights] == select_reference(scores, 0.3, 0.25)
    assert sum(int(w.eq(1).sum()) for w in weights) == math.ceil(0.3 * sum(lengths))


def test_token_select_rho_schedule():
    _, entropy = rand_batch(5, [10, 10])
    opts = dict(rho=0.1, rho_end=0.5, anneal_steps=4, weight=0.0)
    for step, rho in ((1, 0.1), (3, 0.3), (5, 0.5), (9, 0.5)):
        kept = sum(int(w.sum()) for w in token_select_weights([1.0, 1.0], entropy, step=step, **opts))
        assert kept == math.ceil(rho * 20 - 1e-9), step


def test_token_weight_through_policy_loss_formula_gradient_and_split():
    """token_weight multiplies the per-token loss; token-mean still divides by every token (the normaliser is
    unchanged); 4 micro-batches x 2 DP shards with the batch's weights give the single-batch gradient."""
    lengths = [3, 6, 2, 5, 4, 1, 7, 3]
    old_logp, entropy = rand_batch(6, lengths)
    adv_seq = [0.7, -0.4, 1.1, -0.9, 0.3, -1.2, 0.6, -0.1]
    weights = token_select_weights(adv_seq, entropy, score="adv_entropy", rho=0.4, weight=0.2)
    width = max(lengths)

    def pad(rows):
        out = torch.zeros(len(rows), width, dtype=F64)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=F64)
        return out

    g = torch.Generator().manual_seed(7)
    logp_rows = [lp + torch.randn(len(lp), generator=g, dtype=F64) * 0.1 for lp in old_logp]
    lp, old, w = pad(logp_rows), pad(old_logp), pad(weights)
    adv = pad([[a] * n for a, n in zip(adv_seq, lengths)])
    mask = pad([[1] * n for n in lengths]).bool()
    x = lp.clone().requires_grad_(True)
    full, metrics = policy_loss("ppo", x, old, adv, mask, loss_agg="token-mean", token_weight=w)
    full.backward()
    expect = 0.0
    for i, n in enumerate(lengths):
        for t in range(n):
            r = math.exp(logp_rows[i][t].item() - old_logp[i][t].item())
            a = adv_seq[i]
            expect += weights[i][t].item() * -min(r * a, min(max(r, 0.8), 1.2) * a)
    assert full.item() == pytest.approx(expect / sum(lengths), rel=1e-12)
    assert float(metrics["token_weight_mean"]) == pytest.approx(float(torch.cat(weights).mean()), rel=1e-12)
    assert torch.autograd.gradcheck(
        lambda y: policy_loss("ppo", y, old, adv, mask, loss_agg="token-mean", token_weight=w)[0],
        (lp.clone().requires_grad_(True),), eps=1e-6, atol=1e-8)
    assert_ppo_shards_sum(lp, old, adv, mask, lengths, full, x.grad, token_weight=w)  # 2 DP x 4 micro
    with pytest.raises(ValueError, match="token_weight"):
        policy_loss("ppo", lp, old, adv, mask, token_weight=-w)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("algorithm, field, words", [
    ({"stages": [{"name": "polarity", "polarity": "neg"}]}, "algorithm.stages[0]", "both, positive, negative"),
    ({"stages": [{"name": "polarity", "pos_scale": -1.0}]}, "algorithm.stages[0]", ">= 0"),
    ({"stages": [{"name": "gtpoo"}]}, "algorithm.stages[0].name", "unknown stage"),
    ({"stages": [{"name": "gtpo"}, {"name": "polarity"}]}, "algorithm.stages[1]", "sequence stage"),
    ({"stages": [{"name": "gtpo", "alpha3": 1}]}, "algorithm.stages[0]", "alpha3"),
    ({"stages": [{"name": "advantage_reweighting", "alpha": 2}]}, "algorithm.stages[0]", "alpha"),
    ({"stages": [{"alpha": 0.1}]}, "algorithm.stages[0]", "name"),
    ({"stages": [{"name": "token_select", "rho": 0}]}, "algorithm.stages[0]", "rho"),
    ({"stages": [{"name": "token_select", "rho": 1.5}]}, "algorithm.stages[0]", "rho"),
    ({"stages": [{"name": "token_select", "score": "prob"}]}, "algorithm.stages[0]", "score"),
    ({"stages": [{"name": "token_select", "weight": -0.1}]}, "algorithm.stages[0]", "weight"),
    ({"stages": [{"name": "token_select", "rho_end": 0.5}]}, "algorithm.stages[0]", "anneal_steps"),
])
def test_bad_stage_options_refused_at_config_time(algorithm, field, words):
    from megapo.config import ConfigError, from_dict
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError) as err:  # ranges when the section is built, the rest in its rules
        from_dict(RunConfig, config_data(**algorithm))._validate_algorithm()
    assert err.value.field == field and words in str(err.value)


def test_good_stage_options_accepted():
    from megapo.config import from_dict
    from megapo.trainer.config import RunConfig

    cfg = from_dict(RunConfig, config_data(stages=[
        {"name": "polarity", "polarity": "negative", "neg_scale": 0.5}, {"name": "gtpo"},
        {"name": "token_select", "rho": 0.2, "rho_end": 0.8, "anneal_steps": 10}]))
    cfg._validate_algorithm()
    assert cfg.algorithm.needs_old_stats() and cfg.algorithm.needs_old_entropy()


# ----------------------------------------------------------------------------- the loop's wiring


def test_loop_stages_take_the_old_pass_and_fill_the_samples():
    from megapo.config import from_dict
    from megapo.trainer.update import on_policy, token_stages
    from megapo.trainer.config import RunConfig

    class FusedLearner:
        def train_step_on_policy(self, *a, **k):
            raise AssertionError("not called")

    plain = from_dict(RunConfig, config_data())
    assert on_policy(plain, FusedLearner()) and not plain.algorithm.needs_old_entropy()
    assert token_stages([{"advantage": 1.0}], plain, 1) == {}  # default: nothing touched
    cfg = from_dict(RunConfig, config_data(stages=[{"name": "advantage_reweighting", "alpha": 0.5},
                                                   {"name": "token_select", "rho": 0.5}]))
    assert not on_policy(cfg, FusedLearner())  # the stage needs π_old before the loss
    cfg.rollout.n_samples = 2
    batch = [{"advantage": 1.0, "old_logp": [-0.5, -1.0], "old_entropy": [0.2, 0.9]},
             {"advantage": -1.0, "old_logp": [-2.0], "old_entropy": [0.5]}]
    metrics = token_stages(batch, cfg, step=1)
    assert batch[0]["advantage"] == pytest.approx([0.5 * math.exp(-0.5) + 0.5, 0.5 * math.exp(-1.0) + 0.5])
    assert batch[1]["advantage"] == pytest.approx([-(0.5 * math.exp(-2.0) + 0.5)])
    # |A|·H is not asked: score=entropy; top ceil(0.5·3) = 2 of (0.2, 0.9, 0.5) -> weights 0, 1, 1
    assert batch[0]["token_weight"] == [0.0, 1.0] and batch[1]["token_weight"] == [1.0]
    assert metrics["token_select/kept_frac"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------- the learner's side

LEARNER_SCRIPT = r"""
import json, sys
import torch
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.replay.modes import old_logprobs, on_policy_step

seen = []
def loss_fn(objective, logp, old, adv, mask, rollout_logp=None, **kw):
    from megapo.algorithms import policy_loss
    seen.append({"token_weight": None if kw.get("token_weight") is None else kw["token_weight"][mask].tolist(),
                 "adv": adv[mask].tolist(), "polarity": repr(kw.get("global_polarity"))})
    return policy_loss(objective, logp, old, adv, mask, rollout_logp, **kw)

learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3), loss_fn=loss_fn, micro_batch_tokens=8)
batch = [{"tokens": [5, 6, 7, 8, 9, 10], "prompt_len": 3, "advantage": [0.5, -0.25, 1.0],
          "token_weight": [1.0, 0.0, 0.5]},
         {"tokens": [11, 12, 13, 14, 15], "prompt_len": 2, "advantage": -1.0, "token_weight": [0.2, 1.0, 1.0]}]
full, ent = learner.logprobs([s["tokens"] for s in batch], with_entropy=True)
logps, _ = old_logprobs(learner, batch, "off", with_entropy=True)
out = {"old_entropy": [s["old_entropy"] for s in batch],
       "ref_entropy": [e[s["prompt_len"] - 1:].tolist() for e, s in zip(ent, batch)]}
train, _ = on_policy_step(learner, [dict(s) for s in batch], "off", "ppo", "balanced", keep_entropy=True)
out["seen"] = list(seen)  # this balanced step's calls
fused = [dict(s) for s in batch]
for s in fused:
    s.pop("old_entropy")
_, ent2 = learner.logprobs([s["tokens"] for s in batch], with_entropy=True)  # the weights the next step starts from
on_policy_step(learner, fused, "off", "ppo", "token-mean", keep_entropy=True)
out["fused_entropy"] = [s["old_entropy"] for s in fused]
out["fused_ref"] = [e[s["prompt_len"] - 1:].tolist() for e, s in zip(ent2, batch)]
print(json.dumps(out))
"""


def test_learner_passes_token_weights_counts_and_old_entropy(tmp_path, tiny_dense):
    """token_weight and per-token advantages reach the loss in sample order (micro-batches of 8 tokens: one
    sequence each), balanced gets the batch's polarity counts, the old-log-prob pass's and the fused on-policy
    step's old_entropy equal learner.logprobs(with_entropy=True) on the response tokens."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "learner_stages.py").write_text(LEARNER_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "learner_stages.py"), str(tiny_dense)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for got, want in zip(out["old_entropy"], out["ref_entropy"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    seen = sorted(out["seen"], key=lambda d: len(d["adv"]))  # one sequence per micro-batch
    assert len(seen) == 2
    weights = {tuple(d["adv"]): d["token_weight"] for d in seen}
    assert weights[(0.5, -0.25, 1.0)] == pytest.approx([1.0, 0.0, 0.5])
    assert weights[(-1.0, -1.0, -1.0)] == pytest.approx([0.2, 1.0, 1.0])
    # advantage sums 1.25 and -3: one positive and one negative sequence of 3 tokens each
    assert seen[0]["polarity"] == "PolarityCounts(pos_seqs=1.0, neg_seqs=1.0, pos_tokens=3.0, neg_tokens=3.0)"
    # the fused step's entropies are π_old's of that step: the weights after the first update
    for got, want, first in zip(out["fused_entropy"], out["fused_ref"], out["ref_entropy"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6) and got != pytest.approx(first, rel=1e-7)

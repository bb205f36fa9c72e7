"""NAT (Sang et al. 2026, Not all tokens are needed: token efficient reinforcement learning, arXiv:2603.06619):
nat_uniform's weights against a loop of its draws and both schemes unbiased by exact enumeration; nat_prefix's cut
(megapo/algorithms/nat_cut.py) through policy_loss at float64 and one real learner step against the uncut batch at
weight 0 (loss, gradients, π_old at the kept tokens, the packed token count); bad options refused at config time;
one `megapo train` step with each stage; through update_policy, one draw per step, before the old-log-prob pass
(the tokens it is fed, π_old at the kept tokens, the weights at the drawn positions, the train steps' loss against
the uncut batch at weight 0)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.nat_cut import CUT_FIELDS, KEPT_FIELDS, cut_batch, truncated
from megapo.algorithms.registry import get
from megapo.algorithms.sample import FIELDS, TrainSample
from megapo.algorithms.stages import NatUniformOptions, nat_prefix_cuts, token_mask_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
import algorithm_configs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def ht_prefix(n: int, cut: int) -> list[float]:
    """RPC's Horvitz-Thompson weights written out: P(token t kept) = P(c >= t) = (n - t + 1)/n."""
    return [n / (n - t + 1) if t <= cut else 0.0 for t in range(1, n + 1)]


class Draws:
    """A stand-in numpy Generator: random(n) returns the given uniforms, integers() the given cuts, in turn."""

    def __init__(self, uniforms=(), cuts=()):
        self.uniforms, self.cuts = list(uniforms), list(cuts)

    def random(self, n):
        out, self.uniforms = self.uniforms[:n], self.uniforms[n:]
        return np.asarray(out, dtype=np.float64)

    def integers(self, low, high):
        return self.cuts.pop(0)


# ----------------------------------------------------------------------------- (a) weights and unbiasedness


@pytest.mark.parametrize("keep", [0.5, 0.3, 1.0])
def test_uniform_weights_against_a_loop_of_the_draws(keep):
    lengths = [5, 1, 8, 3]
    got = token_mask_weights("nat_uniform", lengths=lengths, seed=7, step=4, keep=keep)
    rng = np.random.default_rng([7, 4])  # the documented seeding: one uniform per token, the batch in order
    for w, n in zip(got, lengths):
        want = [1.0 / keep if rng.random() < keep else 0.0 for _ in range(n)]
        assert w.dtype == F64 and w.tolist() == pytest.approx(want, rel=1e-15)
    again = token_mask_weights("nat_uniform", lengths=lengths, seed=7, step=4, keep=keep)
    assert all(torch.equal(a, b) for a, b in zip(got, again))  # a resumed run draws as the unstopped one
    if keep < 1:
        other = token_mask_weights("nat_uniform", lengths=lengths, seed=7, step=5, keep=keep)
        assert any(not torch.equal(a, b) for a, b in zip(got, other))


@pytest.mark.parametrize("keep", [Fraction(1, 2), Fraction(1, 4)])
def test_uniform_is_unbiased_over_every_subset(keep):
    """Σ over all 2^L keep patterns of P(pattern)·Σ_t w_t ℓ_t == Σ_t ℓ_t, exactly (q and 1/q dyadic)."""
    fn = get("token_weight", "nat_uniform").fn
    n = 5
    losses = [Fraction(3), Fraction(-7, 2), Fraction(1, 3), Fraction(5), Fraction(-2, 7)]
    expected = Fraction(0)
    for pattern in itertools.product((True, False), repeat=n):
        uniforms = [0.0 if kept else 0.999 for kept in pattern]  # below q: kept
        (w,) = fn([n], Draws(uniforms=uniforms), NatUniformOptions(keep=float(keep)))
        prob = math.prod(keep if kept else 1 - keep for kept in pattern)
        expected += prob * sum(Fraction(float(x)) * l for x, l in zip(w.tolist(), losses))
    assert expected == sum(losses)


def test_prefix_is_unbiased_over_every_cut_with_and_without_the_cut():
    """E_c[Σ_t w_t ℓ_t / N] over c ~ U{1..L} == Σ_t ℓ_t / N (float64), both for the weights at full length and
    for the cut sample whose weights absorb token-mean's normaliser (N_kept instead of N)."""
    fn = get("token_weight", "nat_prefix").fn
    n = 7
    losses = [0.3, -1.2, 2.5, 0.7, -0.4, 1.9, -2.2]
    full = sum(losses) / n
    mean_weighted = mean_cut = 0.0
    for c in range(1, n + 1):
        (w,) = fn([n], Draws(cuts=[c]))
        assert w.tolist() == pytest.approx(ht_prefix(n, c), rel=1e-15)
        mean_weighted += sum(x * l for x, l in zip(w.tolist(), losses)) / n / n
        sample = {"tokens": list(range(3 + n)), "prompt_len": 3, "advantage": 1.0, "token_weight": w.tolist()}
        (cut,), keep = cut_batch([sample], [c], [(0, 1)], "token-mean")
        assert keep == [c] and len(cut.tokens) == 3 + c
        mean_cut += sum(x * l for x, l in zip(cut.token_weight, losses)) / c / n  # normaliser: the kept tokens
    assert mean_weighted == pytest.approx(full, rel=1e-13)
    assert mean_cut == pytest.approx(full, rel=1e-13)


# ----------------------------------------------------------------------------- the cut itself


def test_every_train_sample_field_is_cut():
    assert set(CUT_FIELDS + KEPT_FIELDS) == set(FIELDS)
    n, p, k = 6, 3, 2
    per_token = [float(t) for t in range(n)]
    s = TrainSample(tokens=list(range(p + n)), prompt_len=p, advantage=list(per_token), rollout_logp=list(per_token),
                    old_logp=list(per_token), old_entropy=list(per_token), ref_logp=list(per_token),
                    token_weight=list(per_token), loss_mask=[1] * n, sentence_end=[0] * n,
                    routes=np.zeros((p + n - 1, 2, 2), dtype=np.int64), engine_routes=np.zeros((p + n - 1, 2, 2)),
                    own_routes=torch.zeros(p + n - 1, 2, 2), teacher_topk_ids=torch.zeros(n, 3),
                    teacher_topk_logp=[[0.0] * 3] * n, kl_weight=list(per_token), low_prob=list(per_token),
                    entropy_score=list(per_token), mismatch_mask=[0] + [1] * (n - 1))
    c = truncated(s, k, factor=0.5)
    assert c.tokens == list(range(p + k)) and c.prompt_len == p
    for name in ("advantage", "rollout_logp", "old_logp", "old_entropy", "ref_logp", "loss_mask", "sentence_end",
                 "teacher_topk_ids", "teacher_topk_logp", "kl_weight", "low_prob", "entropy_score", "mismatch_mask"):
        assert len(getattr(c, name)) == k, name
    assert c.mismatch_mask == [0, 1]
    assert c.token_weight == [0.0, 0.5]
    for name in ("routes", "engine_routes", "own_routes"):
        assert len(getattr(c, name)) == p + k - 1, name
    assert len(s.tokens) == p + n  # the original untouched


def test_a_cut_keeps_the_first_policy_token():
    """A multi-turn sample whose cut falls among observation tokens keeps up to its first policy token (at weight
    0 there), so it still counts in global_seqs."""
    s = {"tokens": list(range(2 + 6)), "prompt_len": 2, "advantage": 1.0, "loss_mask": [0, 0, 0, 1, 1, 0],
         "token_weight": [6 / 6, 6 / 5, 0, 0, 0, 0]}
    (c,), keep = cut_batch([s], [2], [(0, 1)], "seq-mean-token-mean")
    assert keep == [4] and c.loss_mask == [0, 0, 0, 1]
    assert c.token_weight == [0.5, 0.6, 0.0, 0.0]  # 1 policy token kept of 2: factor 1/2


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=F64)


def step_loss(batch, logp_rows, agg):
    """The loss one learner train step on `batch` computes (policy_loss on the padded view, the learner's
    normalisers: the batch's policy tokens and its samples with any) and the gradient at each response token."""
    width = max(len(s["old_logp"]) for s in batch)
    logp = padded(logp_rows, width).requires_grad_(True)
    mask = padded([s.get("loss_mask") or [1.0] * len(s["old_logp"]) for s in batch], width)
    valid = padded([[1.0] * len(s["old_logp"]) for s in batch], width).bool() & mask.bool()
    counts = valid.sum(1)
    loss, _ = policy_loss("ppo", logp, padded([s["old_logp"] for s in batch], width),
                          padded([[s["advantage"]] * len(s["old_logp"]) for s in batch], width), valid,
                          loss_agg=agg, global_tokens=int(counts.sum()), global_seqs=int((counts > 0).sum()),
                          token_weight=padded([s["token_weight"] for s in batch], width), max_len=16)
    loss.backward()
    return loss.detach(), [logp.grad[i, :len(s["old_logp"])] for i, s in enumerate(batch)]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_the_cut_batch_has_the_uncut_loss_and_gradient(agg):
    """Per train step (two mini-batches), the cut batch's policy loss and its gradient at the kept tokens equal the
    uncut batch's with the cut tokens at weight 0 (whose gradient there is 0), at float64."""
    g = torch.Generator().manual_seed(3)
    lengths, cuts = [6, 3, 8, 5, 7, 2], [2, 3, 5, 1, 7, 1]
    batch = []
    for i, (n, c) in enumerate(zip(lengths, cuts)):
        mask = [1] * n if i != 2 else [1, 1, 0, 0, 1, 1, 1, 0]  # a multi-turn sample
        batch.append({"tokens": list(range(4 + n)), "prompt_len": 4, "advantage": float(torch.randn(1, generator=g)),
                      "old_logp": (-torch.rand(n, generator=g, dtype=F64)).tolist(), "loss_mask": mask,
                      "token_weight": ht_prefix(n, c)})
    logp = [[x + 0.1 * float(torch.randn(1, generator=g)) for x in s["old_logp"]] for s in batch]
    bounds = [(0, 3), (3, 6)]
    cut, keep = cut_batch([dict(s) for s in batch], cuts, bounds, agg)
    assert keep == cuts
    for lo, hi in bounds:
        want, want_grad = step_loss(batch[lo:hi], logp[lo:hi], agg)
        got, got_grad = step_loss([c.data for c in cut[lo:hi]], [r[:k] for r, k in zip(logp[lo:hi], keep[lo:hi])],
                                  agg)
        assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
        for w, c, k in zip(want_grad, got_grad, keep[lo:hi]):
            assert torch.allclose(c, w[:k], rtol=1e-12, atol=1e-15)
            assert w[k:].abs().max().item() == 0.0 if len(w) > k else True


# ----------------------------------------------------------------------------- (b, c) one real learner step

LEARNER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[2])  # tests/distributed: spec_io.hf_grads
from spec_io import hf_grads
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.algorithms.nat_cut import cut_batch

spec = json.load(open(sys.argv[3]))
full, cuts, agg = spec["batch"], spec["cuts"], spec["loss_agg"]


def learner():
    return Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3), micro_batch_tokens=48, seed=0)


out = {}
first = learner()
logp = first.logprobs([s["tokens"] for s in full])
g = torch.Generator().manual_seed(0)
for s, lp in zip(full, logp):  # π_old: the learner's own log-probs, moved a little so that some ratios clip
    s["old_logp"] = (lp[s["prompt_len"] - 1:].double() + 0.3 * torch.randn(len(lp) - s["prompt_len"] + 1,
                                                                             generator=g, dtype=torch.float64)).tolist()
cut, keep = cut_batch([dict(s) for s in full], cuts, [(0, len(full))], agg)
cut = [c.data for c in cut]
for name, batch in (("full", full), ("cut", cut)):
    one = first if name == "full" else learner()
    lp = one.logprobs([s["tokens"] for s in batch])
    metrics = one.train_step(batch, "ppo", agg)
    out[name] = {"loss": metrics["loss"], "packed": metrics["packed_tokens"], "logp": lp,
                 "grads": {k: v.double() for k, v in hf_grads(one).items()}}
    one.close()
for name, batch in (("full_on_policy", full), ("cut_on_policy", cut)):  # π_old from the train forward
    one = learner()
    metrics, old = one.train_step_on_policy(batch, "ppo", agg, keep_logprobs=True)
    out[name] = {"loss": metrics["loss"], "old": old["logprobs"],
                 "grads": {k: v.double() for k, v in hf_grads(one).items()}}
    one.close()
out["keep"] = keep
torch.save(out, sys.argv[4])
"""


@pytest.mark.parametrize("agg", ["token-mean"])
def test_one_learner_step_on_the_cut_batch_equals_the_uncut_one(tmp_path, tiny_moe, agg):
    import json

    rng = np.random.default_rng(11)
    batch, cuts = [], []
    for prompt in ([5, 9, 13, 2], [7, 3, 11]):  # two groups of three: shared prefixes pack each prompt once
        for n, c in ((7, 3), (5, 5), (9, 1)):
            response = [int(x) for x in rng.integers(1, 200, n)]
            batch.append({"tokens": prompt + response, "prompt_len": len(prompt), "advantage": float(rng.normal()),
                          "token_weight": ht_prefix(n, c)})
            cuts.append(c)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"batch": batch, "cuts": cuts, "loss_agg": agg}))
    (tmp_path / "step.py").write_text(LEARNER_SCRIPT)
    out_path = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, str(tmp_path / "step.py"), str(tiny_moe), str(ROOT / "tests/distributed"),
                           str(spec), str(out_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(out_path, weights_only=False)
    keep = out["keep"]
    assert keep == cuts
    # π_old: a causal model's log-probs at the kept tokens do not read the cut ones
    for f, c, s, k in zip(out["full"]["logp"], out["cut"]["logp"], batch, keep):
        assert len(c) == s["prompt_len"] + k - 1
        assert torch.allclose(c, f[:len(c)], atol=1e-6, rtol=0)
    for f, c, k in zip(out["full_on_policy"]["old"], out["cut_on_policy"]["old"], keep):
        assert len(c) == k and torch.allclose(c, f[:k], atol=1e-6, rtol=0)
    for full, cut in (("full", "cut"), ("full_on_policy", "cut_on_policy")):
        assert out[cut]["loss"] == pytest.approx(out[full]["loss"], abs=1e-6)
        grads_f, grads_c = out[full]["grads"], out[cut]["grads"]
        assert grads_f.keys() == grads_c.keys()
        assert max((grads_f[k] - grads_c[k]).abs().max().item() for k in grads_f) < 1e-6
        assert max(grads_f[k].abs().max().item() for k in grads_f) > 1e-4  # a step that moves something
    # (c) what the learner packed: one slot fewer per dropped token, the prompts held once either way
    dropped = sum(len(s["tokens"]) - s["prompt_len"] - k for s, k in zip(batch, keep))
    assert dropped > 0 and out["cut"]["packed"] == out["full"]["packed"] - dropped
    assert out["full"]["packed"] < sum(len(s["tokens"]) for s in batch)  # shared prefixes were on


# ----------------------------------------------------------------------------- (d) config


@pytest.mark.parametrize("stage, algorithm, field, words", [
    ({"name": "nat_uniform", "keep": 0}, {}, "algorithm.stages[0]", "keep"),
    ({"name": "nat_uniform", "keep": 1.5}, {}, "algorithm.stages[0]", "keep"),
    ({"name": "nat_uniform", "keep": True}, {}, "algorithm.stages[0]", "keep"),
    ({"name": "nat_uniform", "keep": "half"}, {}, "algorithm.stages[0]", "keep"),
    ({"name": "nat_uniform", "rho": 0.5}, {}, "algorithm.stages[0]", "rho"),
    ({"name": "nat_prefix", "cut": "yes"}, {}, "algorithm.stages[0]", "cut"),
    ({"name": "nat_prefix"}, {"objective": "gspo"}, "algorithm.stages[0].cut", "sequence-level"),
    ({"name": "nat_prefix"}, {"loss_agg": "balanced"}, "algorithm.stages[0].cut", "balanced"),
])
def test_bad_options_refused_at_config_time(stage, algorithm, field, words):
    from megapo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        algorithm_configs.make_cfg(stages=[stage], **algorithm)
    assert err.value.field == field and words in str(err.value)


def test_good_options_accepted():
    assert algorithm_configs.make_cfg(stages=[{"name": "nat_uniform", "keep": 1}]).algorithm.has_stage("nat_uniform")
    cfg = algorithm_configs.make_cfg(stages=[{"name": "nat_prefix", "cut": False}], loss_agg="balanced")
    assert not cfg.algorithm.needs_old_stats()  # nat_* read no π_old statistic: on-policy runs stay fused


# ----------------------------------------------------------------------------- (e) one `megapo train` step


@pytest.mark.parametrize("stages, extra", [
    ("[{name: nat_uniform, keep: 0.5}, {name: nat_prefix}]", ()),
    ("[{name: nat_prefix}]", ("train.mini_batches=2",)),
])
def test_one_training_step(tmp_path, tiny_moe, stages, extra):
    """Both stages in one run (their weights multiply; nat_prefix then cuts the batch), on the fused on-policy path
    (the main job's one update per rollout); nat_prefix alone with two mini-batches: the separate old-log-prob pass,
    on the batch cut before it (the stability bench's cells take that pass)."""
    from train_runs import train_rows

    # ppo: the main job's gspo is sequence-level, which the cut refuses (test_bad_options_refused_at_config_time)
    rows = train_rows(tmp_path, "nat", f"model.path={tiny_moe}", "train.steps=1", "algorithm.objective=ppo",
                      f"algorithm.stages={stages}", *extra)
    row = rows[0]
    assert row["step"] == 1 and math.isfinite(row["train/loss"])
    assert math.isfinite(next(v for k, v in row.items() if k.endswith("mismatch/k3")))
    for metric in ("nat_prefix/kept_frac", "nat_prefix/kept_tokens_frac") + (("nat_uniform/kept_frac",)
                                                                             if "uniform" in stages else ()):
        key = next(k for k in row if k.endswith(metric))
        assert 0 < row[key] <= 1, (key, row[key])
    assert 0 < row["train/packed_tokens"]


# ----------------------------------------------------------------------------- (f) one draw, before the old-log-prob pass

SEED, STEP = 5, 4
REAL_CUTS = nat_prefix_cuts  # the draw itself, before a test wraps it to count its calls


def nat_groups(lengths: list[list[int]]):
    """Groups of single-turn samples with the given response lengths, μ of the engine and distinct rewards."""
    from megapo.engines.base import Sample
    from megapo.tasks.base import Example
    from megapo.trainer.rollout import Group

    rng = np.random.default_rng(23)
    groups = []
    for gi, group in enumerate(lengths):
        prompt = [20 + gi, 31, 7]
        samples = [Sample(prompt_ids=prompt, output_ids=[int(x) for x in rng.integers(3, 200, n)],
                          logprobs=[float(-0.05 - 0.5 * rng.random()) for _ in range(n)], finish_reason="stop",
                          weight_version=0, routes=None) for n in group]
        groups.append(Group(example=Example(f"{gi}+1=", str(gi + 1)), samples=samples,
                            rewards=[float((gi + i) % 3) for i in range(len(group))]))
    return groups


def documented_cuts(lengths: list[int]) -> list[int]:
    """nat_prefix's draw as documented: c ~ U{1..L} per response, the batch in order, default_rng([seed, step])."""
    rng = np.random.default_rng([SEED, STEP])
    return [int(rng.integers(1, n + 1)) if n else 0 for n in lengths]


def run_update(monkeypatch, stages: list[dict], agg: str, groups):
    """update_policy on `groups` with a recording learner (a causal stand-in model, float64): (its calls, the
    metrics, the draws of nat_prefix's cuts this step took)."""
    from megapo.algorithms import stages as st
    from megapo.trainer.metrics import StepTimer
    from megapo.trainer.update import update_policy
    from test_self_distill import CountingLearner

    draws = []

    def counting(lengths, rng):
        draws.append(list(lengths))
        return REAL_CUTS(lengths, rng)

    monkeypatch.setattr(st, "nat_prefix_cuts", counting)
    cfg = algorithm_configs.make_cfg(n_samples=3, seed=SEED, stages=stages, loss_agg=agg)
    cfg.train.mini_batches = 2
    learner = CountingLearner()
    metrics = update_policy(learner, groups, cfg, None, cfg.loss_spec(), StepTimer(), step=STEP)
    return learner.calls, metrics, draws


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("before", [[], [{"name": "nat_uniform", "keep": 0.5}]])
def test_the_cut_is_drawn_once_before_the_old_logprob_pass(monkeypatch, agg, before):
    """nat_prefix alone: the old-log-prob pass reads the kept tokens only (fewer tokens fed, π_old there the full
    pass's); beside nat_uniform (another token stage: it reads every token) that pass keeps the full responses. Either
    way one draw per step, the stage's weights and the cut at the same positions, and each train step's policy loss
    and gradient those of the uncut batch at weight 0 (cut: false), at float64."""
    lengths = [[7, 4, 9], [5, 8, 3], [6, 2, 10], [4, 7, 5]]
    flat = [n for g in lengths for n in g]
    cuts = documented_cuts(flat)
    assert any(c < n for c, n in zip(cuts, flat))
    prompt = 3
    cut_calls, metrics, draws = run_update(monkeypatch, before + [{"name": "nat_prefix"}], agg, nat_groups(lengths))
    full_calls, _, full_draws = run_update(monkeypatch, before + [{"name": "nat_prefix", "cut": False}], agg,
                                           nat_groups(lengths))
    assert draws == [flat] and full_draws == [flat]  # one draw per step, on the full responses
    passes = [c for c in cut_calls if c[0] == "logprobs"]
    full_passes = [c for c in full_calls if c[0] == "logprobs"]
    assert len(passes) == len(full_passes) == 1
    fed, fed_full = sum(len(s) for s in passes[0][1]), sum(len(s) for s in full_passes[0][1])
    assert fed_full == sum(prompt + n for n in flat)
    if not before:  # the old-log-prob pass saw each sample up to its cut
        assert fed == sum(prompt + c for c in cuts) and fed < fed_full
    else:
        assert fed == fed_full
    trained = [c[1] for c in cut_calls if c[0] == "train_step"]
    trained_full = [c[1] for c in full_calls if c[0] == "train_step"]
    assert [len(b) for b in trained] == [len(b) for b in trained_full] == [6, 6]
    cut_samples = [s for b in trained for s in b]
    full_samples = [s for b in trained_full for s in b]
    for s, f, c, n in zip(cut_samples, full_samples, cuts, flat):
        assert len(s["tokens"]) == prompt + c and len(s["old_logp"]) == c
        assert f["old_logp"] == pytest.approx(stand_in(f["tokens"])[prompt - 1:], rel=1e-12, abs=0)
        assert s["old_logp"] == pytest.approx(f["old_logp"][:c], rel=1e-12, abs=0)  # π_old at the kept tokens
        assert all(w == 0.0 for w in f["token_weight"][c:])  # the same positions: weight 0 after the cut
        assert all(w > 0.0 for w in f["token_weight"][:c]) or before
    # the normalisers' factor written out: token-mean's per train step, seq-mean-token-mean's per sample
    for lo, hi in ((0, 6), (6, 12)):
        for i in range(lo, hi):
            factor = (sum(cuts[lo:hi]) / sum(flat[lo:hi]) if agg == "token-mean" else cuts[i] / flat[i])
            want = [w * factor for w in full_samples[i]["token_weight"][:cuts[i]]]
            assert cut_samples[i]["token_weight"] == pytest.approx(want, rel=1e-14, abs=0)
    assert metrics["nat_prefix/kept_frac"] == pytest.approx(sum(cuts) / sum(flat), rel=1e-15)
    assert metrics["nat_prefix/kept_tokens_frac"] == pytest.approx(sum(cuts) / sum(flat), rel=1e-15)
    g = torch.Generator().manual_seed(9)
    for b, bf in zip(trained, trained_full):
        logp = [[x + 0.2 * float(torch.randn(1, generator=g)) for x in s["old_logp"]] for s in bf]
        want, want_grad = step_loss(bf, logp, agg)
        got, got_grad = step_loss(b, [r[:len(s["old_logp"])] for r, s in zip(logp, b)], agg)
        assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-15)
        for w, c in zip(want_grad, got_grad):
            assert torch.allclose(c, w[:len(c)], rtol=1e-12, atol=1e-15)
            assert w[len(c):].abs().max().item() == 0.0 if len(w) > len(c) else True
    if not before:  # the stability metrics of the pass: the kept tokens' k3, written out
        mu = [s.logprobs for g_ in nat_groups(lengths) for s in g_.samples]
        terms = []
        for s, m, c in zip(cut_samples, mu, cuts):
            for pi, mu_t in zip(s["old_logp"], m[:c]):
                rho = math.exp(pi - mu_t)
                terms.append(rho - 1 - (pi - mu_t))
        assert metrics["mismatch/k3"] == pytest.approx(sum(terms) / len(terms), rel=1e-12)


def stand_in(tokens):
    from test_self_distill import stand_in_logp

    return stand_in_logp(tokens).tolist()


def test_what_keeps_the_full_old_logprob_pass():
    """Another token stage, or an objective reading a batch-wide quantile of π_old: the passes keep the full
    responses (the cut after the token stages); nat_prefix alone: none."""
    from megapo.algorithms.nat_cut import early_cut_blocker

    assert early_cut_blocker(algorithm_configs.make_cfg(stages=[{"name": "nat_prefix"}])) is None
    assert early_cut_blocker(algorithm_configs.make_cfg(
        stages=[{"name": "nat_prefix"}, {"name": "stapo"}])) == "token stage stapo"
    assert "low_prob" in early_cut_blocker(algorithm_configs.make_cfg(stages=[{"name": "nat_prefix"}],
                                                                      objective="lp_reg"))

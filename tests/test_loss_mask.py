"""sample["loss_mask"] (issue 19): per response token, 1 = a policy token the model sampled, 0 = an observation /
tool token the environment inserted. Masked tokens contribute nothing to the loss or its gradient, every
normaliser counts policy tokens only, and the train-inference metrics skip them.

- a real tiny learner (one subprocess): its loss and its gradient (Megatron's main_grad) equal a reference
  written out here in plain torch, from the learner's own model run one sequence at a time with its default
  RoPE, over policy tokens only: reinforce under token-mean, seq-mean-token-mean and balanced, the batch split
  over several micro-batches (one of them only observation tokens); the metrics average over policy tokens;
  wild advantage / old_logp / rollout_logp at masked tokens (huge, NaN) change nothing (loss, grad_norm, metrics,
  the updated weights, bit for bit); an on-policy step returns every sample's log-probs;
- balanced's batch counts (_batch_counts) against the formula;
- engine_mismatch / stability_metrics / mismatch_kl against the k3 formula over policy tokens (the engine's
  rollout_logp 0.0 at observation tokens must not move them);
- bad input named: wrong length, values other than 0/1, a mixed batch, no policy token at all.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# tokens, prompt_len, advantage (scalar or per response token), loss_mask; sample 3 has observation tokens only.
# Sample 2's advantages sum to > 0 over its policy tokens but < 0 over all of them (balanced must use the former).
BATCH = [
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14], 2, 1.0, [1, 1, 0, 0, 0, 1, 1, 1]),
    ([20, 21, 22, 23, 24, 25, 26], 3, -0.5, [1, 1, 1, 1]),
    ([30, 31, 32, 33, 34, 35, 36, 37, 38], 2, [0.3, -4.0, -4.0, 0.2, 0.1, -3.0, 0.4], [1, 0, 0, 1, 1, 0, 1]),
    ([40, 41, 42, 43, 44, 45], 2, 2.0, [0, 0, 0, 0]),
    ([50, 51, 52, 53, 54, 55, 56, 57], 1, -1.5, [1, 1, 0, 1, 1, 1, 1]),
]


def policy_sets(batch=BATCH):
    """Per sample: (advantage per response token, loss_mask) as float64 tensors."""
    out = []
    for tokens, prompt_len, adv, mask in batch:
        n = len(tokens) - prompt_len
        adv = torch.tensor([adv] * n if isinstance(adv, float) else adv, dtype=torch.float64)
        out.append((adv, torch.tensor(mask, dtype=torch.float64)))
    return out


# ----------------------------------------------------------------------------- the learner (one subprocess)

LEARNER_SCRIPT = r"""
import json, sys
import torch
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner
from megapo.learner.rope import set_positions

spec = json.loads(open(sys.argv[2]).read())
batch_rows = spec["batch"]


def own_logp(learner, tokens, prompt_len):
    # the learner's model on one sequence, plain causal mask and Megatron's own RoPE (no packing, no
    # position ids): log p of each response token, differentiable
    ids = torch.tensor([tokens])
    n = len(tokens)
    set_positions(learner.model, None)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]  # True = masked
    logits = learner.model(ids, torch.arange(n)[None], causal)[0, :, :learner.spec.vocab_size].float()
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return logp[prompt_len - 1:]


def reference_loss(lps, agg):
    # reinforce: l_t = -A_t log p_t, written out over the policy tokens only (mask 1)
    terms = [(-(torch.tensor(adv) * lp) * torch.tensor(m), torch.tensor(m), torch.tensor(adv))
             for lp, (adv, m) in zip(lps, spec["adv_mask"])]
    if agg == "token-mean":
        return sum(t.sum() for t, m, _ in terms) / sum(m.sum() for _, m, _ in terms)
    if agg == "seq-mean-token-mean":
        kept = [t.sum() / m.sum() for t, m, _ in terms if m.sum() > 0]
        return sum(kept) / len(kept)
    assert agg == "balanced"
    sides = {1: [], -1: []}
    for t, m, a in terms:
        s = (a * m).sum()
        if s != 0:
            sides[1 if s > 0 else -1].append((t.sum(), m.sum()))
    n_seqs = len(sides[1]) + len(sides[-1])
    total = 0.0
    for rows in sides.values():
        if rows:
            total = total + len(rows) / n_seqs * sum(r[0] for r in rows) / sum(r[1] for r in rows)
    return total


def grads(learner):
    return torch.cat([p.main_grad.detach().reshape(-1).clone() for p in learner.module.parameters()])


def train_batch(rows, **fields):
    out = []
    for i, (tokens, prompt_len, adv, mask) in enumerate(rows):
        s = {"tokens": tokens, "prompt_len": prompt_len, "advantage": adv, "loss_mask": mask}
        for k, v in fields.items():
            s[k] = v[i]
        out.append(s)
    return out


out = {}
learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-2, grad_clip=0.0),
                  micro_batch_tokens=spec["micro_batch_tokens"])
seqs = [r[0] for r in batch_rows]
full, ent = learner.logprobs(seqs, with_entropy=True)
resp = [lp[r[1] - 1:] for lp, r in zip(full, batch_rows)]
resp_ent = [h[r[1] - 1:] for h, r in zip(ent, batch_rows)]
out["logprobs"] = [x.tolist() for x in resp]
out["entropies"] = [x.tolist() for x in resp_ent]
with torch.no_grad():
    out["own_logprobs"] = [own_logp(learner, r[0], r[1]).tolist() for r in batch_rows]

# the micro-batches' policy-token counts (one of them holds only the observation sample)
from megapo.learner.learner import _train_inputs
inputs = _train_inputs(train_batch(batch_rows, old_logp=spec["old_sane"]), learner.spec.vocab_size, need_old=True,
                       device=learner.device)
mbs = learner._micro_batches(seqs, inputs.prompt_lens - 1, inputs.lengths - 1, inputs.starts, inputs.policy)
out["mb_loss_tokens"] = [mb.loss_tokens for mb in mbs if mb.order]
out["mb_orders"] = [mb.order for mb in mbs if mb.order]

# (b) sane vs wild values at masked tokens, from the same fresh weights (two learners); ppo + balanced reads
# old_logp (ratio), advantages (signs and counts) and rollout_logp (mismatch metrics)
def step_record(lrn, old, rollout, adv_rows):
    rows = [(r[0], r[1], a, r[3]) for r, a in zip(batch_rows, adv_rows)]
    start = {k: v.tolist() for k, v in lrn.hf_state_dict()}
    m = lrn.train_step(train_batch(rows, old_logp=old, rollout_logp=rollout), "ppo", "balanced")
    weights = {k: v.tolist() for k, v in lrn.hf_state_dict()}
    moved = any(weights[k] != start[k] for k in weights)
    return {k: v for k, v in m.items() if k not in ("step_time_s", "tokens_per_s")}, weights, moved

sane_metrics, sane_weights, out["weights_moved"] = step_record(learner, spec["old_sane"], spec["rollout_sane"],
                                                               spec["adv_sane"])
learner.close()
wild = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-2, grad_clip=0.0),
               micro_batch_tokens=spec["micro_batch_tokens"])
wild_metrics, wild_weights, _ = step_record(wild, spec["old_wild"], spec["rollout_wild"], spec["adv_wild"])
out["sane_metrics"], out["wild_metrics"] = sane_metrics, wild_metrics
out["same_weights"] = all(sane_weights[k] == wild_weights[k] for k in sane_weights)

# (a), (c), balanced: the learner's loss and gradient vs the reference, at the same weights each time
out["aggs"] = {}
for agg in ("token-mean", "seq-mean-token-mean", "balanced"):
    wild.model.zero_grad_buffer()
    wild.optimizer.zero_grad()
    lps = [own_logp(wild, r[0], r[1]) for r in batch_rows]
    ref = reference_loss(lps, agg)
    ref.backward()
    ref_grad = grads(wild)
    wild.model.zero_grad_buffer()
    with torch.no_grad():
        before_lp = [lp.tolist() for lp in lps]
    m = wild.train_step(train_batch(batch_rows, old_logp=spec["old_sane"]), "reinforce", agg)
    got = grads(wild)
    out["aggs"][agg] = {"ref_loss": float(ref), "loss": m["loss"], "grad_norm": m["grad_norm"],
                        "ref_grad_norm": float(ref_grad.norm()), "max_grad_diff": float((got - ref_grad).abs().max()),
                        "max_ref_grad": float(ref_grad.abs().max()), "ratio_mean": m["ratio_mean"],
                        "logprobs": before_lp, "response_tokens": m["response_tokens"],
                        "policy_tokens": m["policy_tokens"]}

# on-policy: every sample's log-probs come back, the observation-only one included
_, old = wild.train_step_on_policy(train_batch(batch_rows), "reinforce", "token-mean", keep_logprobs=True)
out["on_policy_sizes"] = [len(x) for x in old["logprobs"]]
wild.close()
print(json.dumps(out))
"""


def _masked(values, mask, fill):
    return [v if m else fill for v, m in zip(values, mask)]


@pytest.fixture(scope="module")
def learner_run(tiny_dense, tmp_path_factory):
    """Runs LEARNER_SCRIPT once; the sane batch's old_logp / rollout_logp are near the tiny model's log-probs
    (about -6.2 for its 512-token vocabulary) with 0.0 at observation tokens (what the engine reports); the wild
    batch puts NaN old_logp, 1e6 / NaN advantages and -1e4 rollout_logp there."""
    adv_mask = [(a.tolist(), m.tolist()) for a, m in policy_sets()]
    rng = np.random.default_rng(0)
    old_sane, rollout_sane, old_wild, rollout_wild, adv_sane, adv_wild = [], [], [], [], [], []
    for (tokens, prompt_len, adv, mask), (adv_t, _) in zip(BATCH, policy_sets()):
        n = len(tokens) - prompt_len
        old = (-math.log(512) + rng.normal(0, 0.05, n)).tolist()
        old_sane.append(_masked(old, mask, 0.0))
        rollout_sane.append(_masked([o + 0.01 for o in old], mask, 0.0))
        old_wild.append(_masked(old, mask, float("nan")))
        rollout_wild.append(_masked([o + 0.01 for o in old], mask, -1e4))
        adv_sane.append(adv_t.tolist())
        adv_wild.append(_masked(adv_t.tolist(), mask, 1e6 if sum(mask) % 2 else float("nan")))
    spec = {"batch": BATCH, "micro_batch_tokens": 10, "adv_mask": adv_mask, "old_sane": old_sane,
            "rollout_sane": rollout_sane, "old_wild": old_wild, "rollout_wild": rollout_wild, "adv_sane": adv_sane,
            "adv_wild": adv_wild}
    tmp = tmp_path_factory.mktemp("loss_mask")
    (tmp / "run.py").write_text(LEARNER_SCRIPT)
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(tmp / "run.py"), str(tiny_dense), str(tmp / "spec.json")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), spec



def loss_by_hand(logps, agg, count_all=False):
    """reinforce (l_t = -A_t·log p_t) over the policy tokens (every response token with count_all), in float64
    Python: token-mean Σ l / N_policy; seq-mean-token-mean mean over samples with a policy token of Σ l / n_i;
    balanced (S₊/S)·Σ₊ l / T₊ + (S₋/S)·Σ₋ l / T₋ with signs and T± from policy tokens."""
    rows = []
    for lp, (adv, mask) in zip(logps, policy_sets()):
        m = torch.ones_like(mask) if count_all else mask
        rows.append(((-adv * torch.tensor(lp, dtype=torch.float64) * m).sum().item(), m.sum().item(),
                     (adv * m).sum().item()))
    if agg == "token-mean":
        return sum(r[0] for r in rows) / sum(r[1] for r in rows)
    if agg == "seq-mean-token-mean":
        kept = [r[0] / r[1] for r in rows if r[1] > 0]
        return sum(kept) / len(kept)
    pos = [r for r in rows if r[2] > 0]
    neg = [r for r in rows if r[2] < 0]
    total = 0.0
    for side in (pos, neg):
        if side:
            total += len(side) / (len(pos) + len(neg)) * sum(r[0] for r in side) / sum(r[1] for r in side)
    return total


def test_reference_forward_is_the_learners_and_a_micro_batch_holds_only_observations(learner_run):
    """The reference's plain forward (one sequence, Megatron's own RoPE) gives the learner's log-probs; the batch
    is split over several micro-batches and one of them has no policy token (the observation-only sample)."""
    out, _ = learner_run
    for mine, theirs in zip(out["own_logprobs"], out["logprobs"]):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
    assert len(out["mb_loss_tokens"]) >= 3
    only_obs = [order for order, n in zip(out["mb_orders"], out["mb_loss_tokens"]) if n == 0]
    assert only_obs == [[3]]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "balanced"])
def test_loss_and_gradient_equal_the_policy_token_reference(learner_run, agg):
    """The learner's loss equals the formula over policy tokens (written here from the log-probs at the step's
    weights, and in plain torch in the script, whose gradient w.r.t. every parameter the learner's matches);
    counting the masked tokens would give another loss."""
    out, _ = learner_run
    r = out["aggs"][agg]
    by_hand = loss_by_hand(r["logprobs"], agg)
    assert r["loss"] == pytest.approx(by_hand, rel=1e-5, abs=1e-7)
    assert r["ref_loss"] == pytest.approx(by_hand, rel=1e-5, abs=1e-7)
    assert abs(loss_by_hand(r["logprobs"], agg, count_all=True) - by_hand) > 1e-3 * abs(by_hand)
    assert r["max_grad_diff"] <= 1e-5 * r["max_ref_grad"]
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-4)
    assert r["ref_grad_norm"] > 0


def test_metrics_count_policy_tokens(learner_run):
    """Token-weighted metrics are means over policy tokens across micro-batches: entropy (the learner's own
    per-token entropies), ratio_mean = mean exp(log p - old_logp) (0.0 at masked tokens would pull it to ~0);
    response_tokens counts every response token, policy_tokens the policy's."""
    out, spec = learner_run
    masks = [np.asarray(m, dtype=bool) for _, m in spec["adv_mask"]]
    entropy = np.concatenate([np.asarray(h)[m] for h, m in zip(out["entropies"], masks)]).mean()
    assert out["sane_metrics"]["entropy"] == pytest.approx(entropy, rel=1e-5)
    r = out["aggs"]["token-mean"]
    ratios = np.concatenate([np.exp(np.asarray(lp) - np.asarray(old))[m]
                             for lp, old, m in zip(r["logprobs"], spec["old_sane"], masks)])
    assert r["ratio_mean"] == pytest.approx(ratios.mean(), rel=1e-5)
    assert r["response_tokens"] == sum(len(t) - p for t, p, _, _ in BATCH) == 30
    assert r["policy_tokens"] == sum(int(m.sum()) for m in masks) == 19


def test_values_at_masked_tokens_change_nothing(learner_run):
    """NaN / 1e6 advantages, NaN old_logp and -1e4 rollout_logp at the masked tokens: the same loss, grad_norm,
    metrics and updated weights, bit for bit, as the engine's 0.0 there (and the step did move the weights)."""
    out, _ = learner_run
    sane, wild = out["sane_metrics"], out["wild_metrics"]
    assert all(math.isfinite(v) for v in sane.values() if isinstance(v, float))
    assert sane == wild
    assert "mismatch_k3" in sane and sane["update_ok"]
    assert out["weights_moved"] and out["same_weights"]


def test_on_policy_step_returns_every_samples_logprobs(learner_run):
    out, _ = learner_run
    assert out["on_policy_sizes"] == [len(t) - p for t, p, _, _ in BATCH]


# ----------------------------------------------------------------------------- balanced's batch counts


def test_balanced_counts_use_policy_tokens_only():
    """S± (samples by the sign of Σ_t A_t over policy tokens) and T± (their policy tokens), against the formula;
    the observation-only sample counts in neither; without loss_mask the counts are the old ones."""
    from megapo.algorithms.aggregation import PolarityCounts
    from megapo.learner.learner import _batch_counts, _train_inputs

    batch = [{"tokens": t, "prompt_len": p, "advantage": a, "loss_mask": m} for t, p, a, m in BATCH]
    counts = _batch_counts(_train_inputs(batch, 512, need_old=False, device="cpu"), "ppo", "balanced")
    pos_seqs = neg_seqs = pos_tokens = neg_tokens = 0
    for adv, mask in policy_sets():
        total = float((adv * mask).sum())
        if total > 0:
            pos_seqs, pos_tokens = pos_seqs + 1, pos_tokens + float(mask.sum())
        elif total < 0:
            neg_seqs, neg_tokens = neg_seqs + 1, neg_tokens + float(mask.sum())
    assert counts == {"global_polarity": PolarityCounts(pos_seqs, neg_seqs, pos_tokens, neg_tokens)}
    assert (pos_seqs, neg_seqs, pos_tokens, neg_tokens) == (2, 2, 9, 10)  # sample 2 is positive, sample 3 in none
    unmasked = [{k: v for k, v in s.items() if k != "loss_mask"} for s in batch]
    old = _batch_counts(_train_inputs(unmasked, 512, need_old=False, device="cpu"), "ppo", "balanced")
    assert old == {"global_polarity": PolarityCounts(2, 3, 12, 18)}  # every token: sample 2 negative, 3 positive


# ----------------------------------------------------------------------------- train-inference metrics


def mismatch_samples(seed=1):
    """Samples whose engine log-probs are 0.0 at observation tokens, and the learner's response log-probs."""
    rng = np.random.default_rng(seed)
    samples, logps = [], []
    for tokens, prompt_len, _, mask in BATCH:
        n = len(tokens) - prompt_len
        pi = rng.normal(-2.0, 0.5, n)
        mu = pi + rng.normal(0, 0.1, n)
        samples.append({"tokens": tokens, "prompt_len": prompt_len, "loss_mask": mask,
                        "rollout_logp": [m_ if keep else 0.0 for m_, keep in zip(mu.tolist(), mask)]})
        logps.append(torch.tensor(pi, dtype=torch.float32))
    return samples, logps


def k3_by_hand(samples, logps):
    """k3 = mean(ρ - 1 - log ρ), ρ = exp(log π - log μ), and max |log π - log μ|, over policy tokens."""
    d = [float(p) - mu for s, lp in zip(samples, logps) for p, mu, keep in zip(lp, s["rollout_logp"], s["loss_mask"])
         if keep]
    return sum(math.exp(x) - 1 - x for x in d) / len(d), max(abs(x) for x in d)


def test_engine_mismatch_and_stability_metrics_skip_observation_tokens():
    from megapo.replay.modes import engine_mismatch, stability_metrics

    samples, logps = mismatch_samples()
    k3, max_abs = k3_by_hand(samples, logps)
    m = engine_mismatch(samples, logps)
    assert m["k3"] == pytest.approx(k3, rel=1e-5) and m["max_abs_dlogp"] == pytest.approx(max_abs, rel=1e-5)
    assert max_abs < 1.0  # counted, the 0.0 engine log-probs would give |Δ| ≈ 2
    s = stability_metrics(samples, logps, free_logps=logps)
    assert s["mismatch/k3"] == pytest.approx(k3, rel=1e-5) and s["mismatch/k3_free"] == pytest.approx(k3, rel=1e-5)
    plain = [{k: v for k, v in x.items() if k != "loss_mask"} for x in samples]
    assert engine_mismatch(plain, logps)["max_abs_dlogp"] > 1.0  # without a mask every token counts


def test_mismatch_kl_skips_observation_tokens():
    from megapo.replay.modes import mismatch_kl

    samples, logps = mismatch_samples(seed=2)

    class FreeLearner:  # no replay hook: logprobs of whole sequences, the response ones being `logps`
        route_hook = None

        def logprobs(self, sequences):
            return [torch.cat([torch.zeros(s["prompt_len"] - 1), lp]) for s, lp in zip(samples, logps)]

    k3, _ = k3_by_hand(samples, logps)
    assert mismatch_kl(FreeLearner(), samples)["replay/kl_k3_free"] == pytest.approx(k3, rel=1e-5)


# ----------------------------------------------------------------------------- bad input


def _batch(**changes):
    batch = [{"tokens": t, "prompt_len": p, "advantage": a, "loss_mask": list(m)} for t, p, a, m in BATCH]
    for i, mask in changes.items():
        if mask is None:
            del batch[int(i[1:])]["loss_mask"]
        else:
            batch[int(i[1:])]["loss_mask"] = mask
    return batch


@pytest.mark.parametrize("changes, words", [
    ({"s1": [1, 1, 1]}, "batch[1].loss_mask: expected 4 values (one per response token), got 3"),
    ({"s2": [1, 0.5, 0, 1, 1, 0, 1]}, "batch[2].loss_mask: must be 0 (an observation token) or 1 (a policy token), "
                                      "got 0.5 at response token 1"),
    ({"s4": [1, 1, 0, 1, 1, 1, 2]}, "batch[4].loss_mask: must be 0 (an observation token) or 1 (a policy token), "
                                    "got 2.0 at response token 6"),
    ({"s0": [1, 1, 0, float("nan"), 0, 1, 1, 1]}, "batch[0].loss_mask: must be 0"),
    ({"s0": [1, 1, 0, -1, 0, 1, 1, 1]}, "got -1.0 at response token 3"),
    ({"s3": None}, "batch[3].loss_mask: missing (other samples have it)"),
    ({"s0": [0] * 8, "s1": [0] * 4, "s2": [0] * 7, "s4": [0] * 7}, "batch: loss_mask is 0 at every response token"),
])
def test_bad_loss_mask_named(changes, words):
    from megapo.learner.learner import _train_inputs

    with pytest.raises(ValueError) as err:
        _train_inputs(_batch(**changes), 512, need_old=False, device="cpu")
    assert words in str(err.value)


def test_observation_only_sample_and_booleans_accepted():
    """A sample of observation tokens only is allowed (the learner run shows it adds nothing); True/False work."""
    from megapo.learner.learner import _train_inputs

    batch = _batch(s0=[True, True, False, False, False, True, True, True])
    inputs = _train_inputs(batch, 512, need_old=False, device="cpu")
    assert inputs.policy_counts().tolist() == [5, 4, 4, 0, 6] and "loss_mask" not in inputs.columns


def test_metrics_refuse_mixed_or_misshaped_masks():
    from megapo.replay.modes import engine_mismatch

    samples, logps = mismatch_samples()
    del samples[1]["loss_mask"]
    with pytest.raises(ValueError, match=r"samples\[1\]\.loss_mask: missing"):
        engine_mismatch(samples, logps)
    samples, logps = mismatch_samples()
    samples[0]["loss_mask"] = samples[0]["loss_mask"][:-1]
    with pytest.raises(ValueError, match="loss_mask: 29 values for 30 response tokens"):
        engine_mismatch(samples, logps)

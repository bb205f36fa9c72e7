"""loss_agg="balanced" (Zeng et al. 2026, Balanced Aggregation: Understanding and Fixing Aggregation Bias in
GRPO): the formula written out here as a loop, a float64 finite-difference gradient check, the split invariance
(4 micro-batches x 2 simulated DP shards give the single-batch gradient to 1e-12 with the global counts) and the
learner's counts."""

from __future__ import annotations

import math

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.algorithms.aggregation import PolarityCounts, polarity_counts

F64 = torch.float64


def make_seqs(seed, lengths, advantages):
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for n, a in zip(lengths, advantages):
        lp = -torch.rand(n, generator=g, dtype=F64) * 2 - 0.05
        old = lp + torch.randn(n, generator=g, dtype=F64) * 0.2
        seqs.append((lp, old, torch.full((n,), float(a), dtype=F64)))
    return seqs


def padded(seqs, width=None):
    width = width or max(s[0].numel() for s in seqs)
    out = [torch.zeros(len(seqs), width, dtype=F64) for _ in range(3)]
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = s[0].numel()
        for k in range(3):
            out[k][i, :n] = s[k]
        mask[i, :n] = True
    return out, mask


def reference(seqs, objective_token_loss):
    """The formula, one sequence and one token at a time."""
    s_pos = sum(1 for s in seqs if s[2][0] > 0)
    s_neg = sum(1 for s in seqs if s[2][0] < 0)
    t_pos = sum(s[0].numel() for s in seqs if s[2][0] > 0)
    t_neg = sum(s[0].numel() for s in seqs if s[2][0] < 0)
    pos = neg = 0.0
    for lp, old, adv in seqs:
        for t in range(lp.numel()):
            ell = objective_token_loss(lp[t].item(), old[t].item(), adv[t].item())
            if adv[t] > 0:
                pos += ell
            elif adv[t] < 0:
                neg += ell
    total = s_pos + s_neg
    return (s_pos / total) * pos / t_pos + (s_neg / total) * neg / t_neg


def reinforce_token(lp, old, adv):
    return -adv * lp


LENGTHS = [3, 7, 1, 5, 2, 6, 4, 8]
ADVS = [1.2, -0.4, 0.0, 0.7, -1.5, -0.2, 0.9, -0.8]  # one zero: counted in neither side


def test_balanced_matches_the_formula_written_out():
    seqs = make_seqs(0, LENGTHS, ADVS)
    (lp, old, adv), mask = padded(seqs)
    loss, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="balanced")
    assert loss.item() == pytest.approx(reference(seqs, reinforce_token), rel=1e-12)
    # it is neither token-mean nor seq-mean (the test can fail)
    for other in ("token-mean", "seq-mean-token-mean"):
        assert policy_loss("reinforce", lp, old, adv, mask, loss_agg=other)[0].item() != pytest.approx(loss.item())


def test_balanced_ppo_matches_the_formula_and_one_sided_batches():
    eps = 0.2

    def ppo_token(lp, old, a):
        r = math.exp(lp - old)
        return -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)

    seqs = make_seqs(1, LENGTHS, ADVS)
    (lp, old, adv), mask = padded(seqs)
    loss, _ = policy_loss("ppo", lp, old, adv, mask, loss_agg="balanced", eps_low=eps, eps_high=eps)
    assert loss.item() == pytest.approx(reference(seqs, ppo_token), rel=1e-12)
    # only positive sequences: the token mean over them
    pos = make_seqs(2, [3, 5], [0.5, 1.0])
    (lp, old, adv), mask = padded(pos)
    loss, _ = policy_loss("reinforce", lp, old, adv, mask, loss_agg="balanced")
    expect = sum(-a * l for s in pos for l, a in zip(s[0].tolist(), s[2].tolist())) / 8
    assert loss.item() == pytest.approx(expect, rel=1e-12)


def test_balanced_finite_difference_gradient():
    seqs = make_seqs(3, [3, 4, 2, 5], [0.8, -0.3, 1.1, -0.9])
    (lp, old, adv), mask = padded(seqs)

    def f(x):
        return policy_loss("ppo", x, old, adv, mask, loss_agg="balanced", eps_low=0.2, eps_high=0.28)[0]

    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8)


def test_balanced_split_invariance_4_micro_batches_x_2_dp_shards():
    seqs = make_seqs(4, LENGTHS, ADVS)
    (lp, old, adv), mask = padded(seqs)
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss("ppo", x, old, adv, mask, loss_agg="balanced")
    full.backward()
    counts = polarity_counts(torch.tensor(ADVS, dtype=F64) * torch.tensor(LENGTHS), torch.tensor(LENGTHS))
    assert counts == PolarityCounts(3, 4, 3 + 5 + 4, 7 + 2 + 6 + 8)
    total, grads = 0.0, []
    for rank in range(2):  # 2 DP shards of 4 sequences, each in 4 micro-batches of one sequence
        for mb in range(4):
            shard = [seqs[rank * 4 + mb]]
            (slp, sold, sadv), smask = padded(shard, width=9)
            sx = slp.clone().requires_grad_(True)
            loss, _ = policy_loss("ppo", sx, sold, sadv, smask, loss_agg="balanced", global_polarity=counts)
            loss.backward()
            total += loss.item()
            grads.append(sx.grad[0, : shard[0][0].numel()])
    assert total == pytest.approx(full.item(), rel=1e-12, abs=1e-14)
    for i, g in enumerate(grads):
        assert torch.allclose(g, x.grad[i, : LENGTHS[i]], rtol=1e-12, atol=1e-15)
    # without the global counts each shard normalises by its own counts (the test can fail)
    local = sum(policy_loss("ppo", *padded([s])[0], padded([s])[1], loss_agg="balanced")[0].item() for s in seqs)
    assert local != pytest.approx(full.item(), rel=1e-6)


def test_bad_global_polarity_refused():
    seqs = make_seqs(5, [2, 3], [1.0, -1.0])
    (lp, old, adv), mask = padded(seqs)
    with pytest.raises(ValueError, match="global_polarity.neg_tokens"):
        policy_loss("reinforce", lp, old, adv, mask, loss_agg="balanced",
                    global_polarity=PolarityCounts(1, 1, 2, -3))
    with pytest.raises(ValueError, match="global_polarity"):
        policy_loss("reinforce", lp, old, adv, mask, loss_agg="balanced", global_polarity={"pos_seqs": 1})


def test_learner_counts_cover_the_whole_batch():
    """The learner's once-per-step counts: per-token advantages summed per sample (float64)."""
    import numpy as np

    from megapo.learner.learner import TrainInputs, _batch_counts

    adv = torch.tensor([0.5, 0.5, -1.0, -1.0, -1.0, 0.3, -0.6, 0.0], dtype=torch.float32)  # sums 1, -3, -0.3, 0
    inputs = TrainInputs({"advantage": adv}, prompt_lens=np.array([2, 1, 3, 1]), lengths=np.array([4, 4, 5, 2]),
                         starts=np.array([0, 2, 5, 7]))
    assert _batch_counts(inputs, "ppo", "balanced") == {"global_polarity": PolarityCounts(1, 2, 2, 5)}
    assert _batch_counts(inputs, "ppo", "token-mean") == {}
    assert _batch_counts(inputs, "ppo", "auto") == {}  # ppo's own: token-mean
    assert _batch_counts(inputs, "custom", "auto") == {}  # a custom loss_fn's objective: not looked up as one


SPLIT_SCRIPT = r"""
import json, sys
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner

def local_counts(*args, global_polarity=None, **kw):  # policy_loss without the batch-global counts
    from megapo.algorithms import policy_loss
    return policy_loss(*args, **kw)

batch = [{"tokens": [5, 6, 7, 8, 9, 10], "prompt_len": 2, "advantage": 1.0, "old_logp": [-6.0] * 4},
         {"tokens": [11, 12, 13, 14], "prompt_len": 2, "advantage": -0.5, "old_logp": [-6.0] * 2},
         {"tokens": [15, 16, 17, 18, 19], "prompt_len": 1, "advantage": [0.3, -0.1, 0.2, 0.4], "old_logp": [-6.0] * 4},
         {"tokens": [20, 21, 22], "prompt_len": 1, "advantage": -2.0, "old_logp": [-6.0] * 2}]
out = {}
for name, tokens, fn in (("one", 64, None), ("split", 8, None), ("split_local", 8, local_counts)):
    learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3), micro_batch_tokens=tokens, loss_fn=fn)
    out[name] = learner.train_step(batch, "ppo", "balanced")["grad_norm"]
    learner.close()
print(json.dumps(out))
"""


def test_learner_balanced_gradient_does_not_depend_on_micro_batches(tmp_path, tiny_dense):
    """One micro-batch vs one sequence per micro-batch: the same gradient norm (float32 learner), because the
    learner passes the batch's polarity counts; without them (a loss_fn dropping global_polarity) it differs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "split.py").write_text(SPLIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "split.py"), str(tiny_dense)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["split"] == pytest.approx(out["one"], rel=1e-5)
    assert out["split_local"] != pytest.approx(out["one"], rel=1e-3)

"""Each train_step metric carries its own reduction (megapo/learner/metrics.py REDUCTIONS), checked against the
formula written here:

- reduce_metrics on hand-made micro-batches (one without policy tokens): sums of shares and counts, minimum,
  maximum, Σ n_i·v_i / N and Σ s_i / N; a name with no declared reduction is refused, naming it;
- every metric policy_loss can return (correction, token weights, KL, entropy, mismatch) is declared;
- a real tiny learner (one subprocess) on a batch cut into several micro-batches: what train_step returns equals
  the formula over the micro-batches' own values, recorded by a loss_fn wrapping policy_loss.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapo.algorithms import policy_loss
from megapo.learner.metrics import MEAN_OVER, REDUCTIONS, MicroBatchMetrics, Reduction, reduce_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_reduce_metrics_by_declared_reduction():
    parts = [MicroBatchMetrics(3, {"loss": 0.5, "entropy": 6.0, "response_tokens": 4, "pg_loss": 0.25,
                                   "ratio_min": 0.9, "ratio_max": 1.2, "ratio_mean": 1.0, "clipfrac_high": 0.5}),
             MicroBatchMetrics(0, {"response_tokens": 2}),  # observation tokens only
             MicroBatchMetrics(1, {"loss": -0.25, "entropy": 1.0, "response_tokens": 1, "pg_loss": 0.125,
                                   "ratio_min": 0.7, "ratio_max": 1.1, "ratio_mean": 2.0, "clipfrac_high": 0.0})]
    got = reduce_metrics(parts)
    assert got == {"loss": 0.5 - 0.25, "entropy": (6.0 + 1.0) / 4, "response_tokens": 4 + 2 + 1,
                   "pg_loss": 0.25 + 0.125, "ratio_min": 0.7, "ratio_max": 1.2,
                   "ratio_mean": (3 * 1.0 + 1 * 2.0) / 4, "clipfrac_high": (3 * 0.5 + 1 * 0.0) / 4}
    assert list(got)[:3] == ["loss", "entropy", "response_tokens"]  # first-seen order
    with pytest.raises(ValueError, match="'ratio_median'"):
        reduce_metrics([MicroBatchMetrics(1, {"ratio_median": 1.0})])


def test_every_policy_loss_metric_is_declared():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    old = logp - 0.1 * torch.rand(2, 5, generator=g, dtype=torch.float64)
    rollout = old - 0.1 * torch.rand(2, 5, generator=g, dtype=torch.float64)
    ones = torch.ones(2, 5, dtype=torch.float64)
    _, metrics = policy_loss("ppo", logp, old, ones, torch.ones(2, 5), rollout, correction="tis", kl_coef=0.1,
                             entropy_coef=0.01, ref_logp=old, entropy=ones, token_weight=ones, dual_clip=3.0)
    assert set(metrics) <= set(REDUCTIONS), sorted(set(metrics) - set(REDUCTIONS))
    assert {"pg_loss", "kl", "correction_weight_mean", "token_weight_mean", "mismatch_max_abs_dlogp",
            "ratio_min", "ratio_max", "clipfrac_dual"} <= set(metrics)


SCRIPT = r"""
import json, sys
import torch
from megapo.algorithms import policy_loss
from megapo.config import OptimConfig, ParallelConfig
from megapo.learner.learner import Learner

seen = []
def recording_loss(*args, **kw):  # policy_loss; keeps each micro-batch's values as the learner gets them
    loss, metrics = policy_loss(*args, **kw)
    mask = args[4]
    seen.append({"tokens": int(mask.sum()), "loss": float(loss), "metrics": {k: float(v) for k, v in metrics.items()},
                 "entropy_sum": float(kw["entropy"].detach()[mask].double().sum())})
    return loss, metrics

learner = Learner(sys.argv[1], ParallelConfig(), OptimConfig(lr=1e-3), micro_batch_tokens=12, loss_fn=recording_loss)
batch = json.loads(sys.argv[2])
m = learner.train_step(batch, "ppo", "token-mean", correction="tis", entropy_coef=0.01, eps_low=0.0001,
                       eps_high=0.0001)
print(json.dumps({"micro_batches": seen, "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))}}))
"""


def test_learner_reduces_each_metric_by_its_formula(tmp_path, tiny_dense):
    batch = []
    for i, (n_tokens, prompt_len) in enumerate([(9, 3), (7, 2), (10, 4), (6, 2), (8, 3)]):
        tokens = [10 + 7 * i + t for t in range(n_tokens)]
        n = n_tokens - prompt_len
        batch.append({"tokens": tokens, "prompt_len": prompt_len, "advantage": [0.5, -1.0][i % 2],
                      "old_logp": [-6.2 + 0.03 * ((t + i) % 5) for t in range(n)],
                      "rollout_logp": [-6.25 + 0.02 * ((t * i) % 3) for t in range(n)]})
    (tmp_path / "run.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(tiny_dense), json.dumps(batch)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    mbs, got = out["micro_batches"], out["metrics"]
    assert len(mbs) >= 3
    n_total = sum(mb["tokens"] for mb in mbs)
    assert n_total == sum(len(s["tokens"]) - s["prompt_len"] for s in batch)
    assert got["loss"] == sum(mb["loss"] for mb in mbs)
    assert got["entropy"] == pytest.approx(sum(mb["entropy_sum"] for mb in mbs) / n_total, rel=1e-6)
    assert got["response_tokens"] == n_total
    names = set(mbs[0]["metrics"]) - {"entropy"}  # policy_loss's entropy: replaced by the learner's
    assert {"pg_loss", "ratio_min", "ratio_max", "mismatch_max_abs_dlogp", "clipfrac_high",
            "correction_weight_mean"} <= names
    for name in names:
        values = [(mb["tokens"], mb["metrics"][name]) for mb in mbs]
        formula = {
            Reduction.SUM: lambda: sum(v for _, v in values),
            Reduction.MIN: lambda: min(v for _, v in values),
            Reduction.MAX: lambda: max(v for _, v in values),
            Reduction.TOKEN_MEAN: lambda: sum(n * v for n, v in values) / n_total,
            # weighted by the micro-batch's own count (the mismatch means: its mismatch_tokens)
            Reduction.COUNT_MEAN: lambda: (sum(mb["metrics"][MEAN_OVER[name]] * mb["metrics"][name] for mb in mbs)
                                           / sum(mb["metrics"][MEAN_OVER[name]] for mb in mbs)),
        }[REDUCTIONS[name]]()
        assert got[name] == pytest.approx(formula, rel=1e-12, abs=1e-15), name
    # the reductions differ on this batch: a mean of the micro-batches would not give these
    assert len({mb["metrics"]["ratio_max"] for mb in mbs}) > 1
    assert got["pg_loss"] != pytest.approx(sum(mb["metrics"]["pg_loss"] for mb in mbs) / len(mbs))

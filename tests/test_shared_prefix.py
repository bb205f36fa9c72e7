"""Shared-prefix packing (train.share_prefix) against today's packing: each prompt held once, its samples' tokens
after it, must give the same log-probs, entropies, loss and gradients.

Two launches of tests/distributed/shared_prefix_layouts.py: world 1 (TP=1 for Qwen3-MoE, DeepSeek-V3's multi-latent
attention and gpt-oss's sliding windows and sinks), world 2 (TP=2 with sequence parallel, PP=2, EP=2 x DP=2 with
the distributed optimizer, TP=2 x EP=2), each with free routing, R2 (the routes a free pass recorded) and R3
(engine routes, one group's samples disagreeing after their prompt). The reference is the same learner with
sharing off, one pass apart (the weights do not move between them).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_runs import run_layout_script  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "shared_prefix_layouts.py"
MODES = ["free", "r2", "r3"]
TOL = 1e-6


def make_batch(vocab: int = 512, seed: int = 0) -> list[dict]:
    """Three prompts x four samples (one group also shares its first two response tokens, one group's engine
    routes diverge after the prompt), two samples of prompts of their own."""
    rng = random.Random(seed)
    batch = []
    for group in range(3):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 9))]
        common = [rng.randrange(vocab) for _ in range(2)] if group == 1 else []
        for _ in range(4):
            response = common + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            batch.append(dict(tokens=prompt + response, prompt_len=len(prompt), advantage=rng.uniform(-1, 1),
                              group=group, diverges=group == 2))
    for group in (3, 4):
        batch.append(dict(tokens=[rng.randrange(vocab) for _ in range(7)], prompt_len=3, advantage=0.5, group=group))
    return batch


@pytest.fixture(scope="module")
def runs(tiny_model_factory, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared_prefix")
    models = {f: str(tiny_model_factory(f)) for f in ("qwen3_moe", "deepseek_v3", "gpt_oss")}
    one = dict(tp=1, pp=1, ep=1, dp=1)
    worlds = {
        1: [dict(name=f"{f}/tp1", model=m, layout=one) for f, m in models.items()],
        2: [dict(name=f"qwen3_moe/{n}", model=models["qwen3_moe"], layout=l) for n, l in [
            ("tp2", dict(tp=2, pp=1, ep=1, dp=1)), ("pp2", dict(tp=1, pp=2, ep=1, dp=1)),
            ("ep2dp2", dict(tp=1, pp=1, ep=2, dp=2, distributed_optimizer=True)),
            ("tp2ep2", dict(tp=2, pp=1, ep=2, dp=1))]],
    }
    results = {}
    for world, world_runs in worlds.items():
        # a 40-token micro-batch splits the larger groups into prompt-repeating parts
        spec = dict(runs=world_runs, batch=make_batch(), modes=MODES, micro_batch_tokens=40, row_tokens=0,
                    objective="gspo", strict=world == 1)
        saved = run_layout_script(SCRIPT, spec, world, tmp, timeout_s=900)
        results.update(saved)
    names = [r["name"] for w in worlds.values() for r in w]
    return dict(results=results, names=names)


def max_diff(a, b) -> float:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(max_diff(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max([max_diff(x, y) for x, y in zip(a, b)] + [0.0])
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


@pytest.mark.parametrize("mode", MODES)
def test_shared_prefix_equals_unshared_packing(runs, mode):
    for name in runs["names"]:
        off, on = runs["results"][f"{name}/{mode}/off"], runs["results"][f"{name}/{mode}/auto"]
        # the prompts were shared: fewer tokens ran (R3: the diverging group shares less)
        assert on["packed"] < off["packed"] and on["packed_logprobs"] < off["packed_logprobs"], name
        for key in ("logprobs", "entropies", "old_logprobs", "old_entropies", "loss", "entropy", "grads"):
            if key in off:
                assert max_diff(off[key], on[key]) <= TOL, (name, key, max_diff(off[key], on[key]))
        assert abs(off["grad_norm"] - on["grad_norm"]) <= TOL * max(1.0, off["grad_norm"]), name
        if mode == "r2":  # the shared pass recorded the same routes for every sample (a prompt's once)
            assert all((a == b).all() for a, b in zip(off["recorded"], on["recorded"])), name


def test_grads_are_not_trivially_equal(runs):
    """The compared gradients are real: non-zero, and different between routing modes."""
    free = runs["results"]["qwen3_moe/tp1/free/auto"]["grads"]
    r3 = runs["results"]["qwen3_moe/tp1/r3/auto"]["grads"]
    assert max(float(g.abs().max()) for g in free.values()) > 1e-3
    assert max_diff(free, r3) > 1e-4


def test_strict_mode_refuses_diverging_engine_routes(runs):
    for name in ("qwen3_moe/tp1", "deepseek_v3/tp1", "gpt_oss/tp1"):
        err = runs["results"][f"{name}/strict_error"]
        assert err is not None and "train.share_prefix=on" in err and "routes differ" in err, (name, err)


def test_packing_counts_shared_tokens():
    """packed tokens = sum over units of P' + sum(R_i + 1), written out for a small batch."""
    from megapo.learner import packing

    seqs = [[1, 2, 3, 4, 9], [1, 2, 3, 4, 8, 8], [1, 2, 3, 5, 5], [7, 7, 7]]
    units = packing.prefix_units(seqs, [4, 4, 4, 2], capacity=100)
    # 0 and 1 share [1, 2, 3, 4] (prompt) -> shared 3 tokens; 2 has another prompt; 3 alone
    assert sorted(u.members for u in units) == [(0, 1), (2,), (3,)]
    shared = next(u for u in units if len(u.members) == 2)
    assert shared.shared == 3 and shared.size == 3 + (5 - 3) + (6 - 3)

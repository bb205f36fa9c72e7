"""`megapo bench memory` (tools/bench/memory.py) against bytes per parameter written out here.

One 2-process launch of the bench's measuring function on the tiny MoE model, DP=2 with and without Megatron's
distributed optimizer, fp32 and bf16 (DP=1 runs the same worker in one process and holds what DP=2 without the
distributed optimizer holds per rank: every rank keeps everything). Expected, per rank, divided by the model's
parameter count:
- fp32: weights 4 (fp32 parameters), grads 4 (DDP's fp32 grad buffer), optimizer 8 (Adam's exp_avg + exp_avg_sq
  in fp32; the optimizer steps the model's own parameters: no separate main copy);
- bf16: weights 2 (bf16 parameters), grads 4 (the grad buffer stays fp32: grad_reduce_in_fp32), optimizer
  4 + 8 = 12 (fp32 main parameters + the two fp32 moments);
- distributed optimizer at DP=2: weights and grads as above (not sharded), the optimizer half of it on each rank
  within PADDING, and exactly all of it summed over the two ranks (each parameter's state lives on one rank);
- megapo's guard copy (optim.restore_nonfinite): the parameters + the optimizer's own parameters where separate +
  the moments (+ Adam's step counters), i.e. fp32 4 + 8, bf16 2 + 4 + 8; with the distributed optimizer the parameters whole and the
  optimizer's tensors (fp32: its shard views of the parameters too, 4 + 8) halved.
PADDING = 1% of the model's parameters: the distributed optimizer's buffers start every parameter at a multiple of
64 elements and end at a multiple of lcm(DP, 128), so the two ranks' halves differ from an exact half by at most
that padding (measured here: 192 elements of 509,376, 0.04%).
The projection's arithmetic is checked apart against numbers written out for Qwen3-30B-A3B and DeepSeek-V3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.bench import memory  # noqa: E402

EXPECTED = {"fp32": dict(weights=4, grads=4, optimizer_main=0, optimizer_moments=8),
            "bf16": dict(weights=2, grads=4, optimizer_main=4, optimizer_moments=8)}
GUARD = {"fp32": 4 + 8, "bf16": 2 + 4 + 8}  # without the distributed optimizer (fp32: Adam steps the parameters)
GUARD_SHARDED = {"fp32": 4 + 8, "bf16": 4 + 8}  # with it: the optimizer's tensors the guard copies, before sharding
PADDING = 0.01
DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}
LAYOUTS = ["dp2-fp32", "dp2-bf16", "dp2-fp32-do", "dp2-bf16-do"]


@pytest.fixture(scope="module")
def measured(tiny_moe, tmp_path_factory):
    # warm-up 1 + 1 timed step: Adam's state exists after the first, the guard copies it before the second
    return memory.measure(tiny_moe, LAYOUTS, steps=1, warmup=1, threads=1,
                          work_dir=tmp_path_factory.mktemp("bench_memory"), timeout_s=300)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_without_the_distributed_optimizer_every_rank_holds_the_written_out_bytes(measured, precision):
    r = measured[f"dp2-{precision}"]
    want = EXPECTED[precision]
    assert r["world"] == 2 and r["params_on_rank"] == [r["params_total"]] * 2
    for rank in r["bytes_per_param_per_rank"]:
        for name, value in want.items():
            assert rank[name] == value, (name, rank[name])
        assert rank["optimizer"] == want["optimizer_main"] + want["optimizer_moments"]
        assert rank["weights_storage"] == rank["weights"] and rank["grads_storage"] == rank["grads"]  # no padding
        assert rank["other_grads"] == 0
        # + Adam's step counters (one fp32 scalar per tensor: optimizer_other), which the guard copies too
        assert rank["guard_copy"] == pytest.approx(GUARD[precision] + rank["optimizer_other"], rel=1e-12)
    dtypes = r["bytes_per_rank"][0]["dtypes"]
    assert dtypes["weights"] == [DTYPES[precision]] and dtypes["grads"] == ["torch.float32"]
    assert dtypes["optimizer_moments"] == ["torch.float32"]
    assert dtypes["optimizer_main"] == ([] if precision == "fp32" else ["torch.float32"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_distributed_optimizer_halves_the_optimizer_state_at_dp2(measured, precision):
    r = measured[f"dp2-{precision}-do"]
    want = EXPECTED[precision]
    optimizer = want["optimizer_main"] + want["optimizer_moments"]
    assert r["bytes_per_rank"][0]["optimizers"] == ["DistributedOptimizer"]
    for rank in r["bytes_per_param_per_rank"]:
        assert rank["weights"] == want["weights"] and rank["grads"] == want["grads"]  # whole on every rank
        assert abs(rank["optimizer"] - optimizer / 2) <= PADDING * optimizer / 2, rank["optimizer"]
        assert abs(rank["optimizer_main"] - want["optimizer_main"] / 2) <= PADDING * want["optimizer_main"] / 2
        # the buffers' padding: more storage than tensors, by less than PADDING
        for name in ("weights", "grads"):
            assert rank[name] <= rank[f"{name}_storage"] <= (1 + PADDING) * rank[name]
        guard = want["weights"] + GUARD_SHARDED[precision] / 2
        assert abs(rank["guard_copy"] - guard) <= PADDING * guard, rank["guard_copy"]
    assert r["optimizer_bytes_per_param_summed_over_ranks"] == optimizer  # every element's state on one rank
    assert r["main_params_summed_over_ranks"] == (r["params_total"] if precision == "bf16" else 0)


def test_step_times_and_ratio_are_reported(measured):
    ratios = memory.step_ratios(measured)
    assert set(ratios) == {"dp2", "dp2_do"}
    for r in ratios.values():
        assert r["bf16_over_fp32_wall"] > 0 and r["bf16_over_fp32_cpu"] > 0
    model = memory.bytes_model(measured)
    assert model["bf16"]["optimizer"] == 12 and model["fp32"]["optimizer"] == 8
    assert abs(model["bf16"]["guard_sharded"] - GUARD_SHARDED["bf16"]) <= PADDING * GUARD_SHARDED["bf16"]


def test_projection_arithmetic():
    """GiB per GPU written out: Qwen3-30B-A3B (48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts of
    768, vocab 151936 untied): experts 48*128*3*2048*768 = 28,991,029,248; the rest 1,541,093,376. On 8 GPUs at
    EP=8, DP=8 (expert-DP 1), bf16 = 2 + 4 + 12/DP for the rest and 2 + 4 + 12 for this GPU's eighth of the experts.
    DeepSeek-V3's counts: 671B total, 37B active (model card), within 0.1% / 2%."""
    bpp = {"bf16": dict(weights=2, grads=4, optimizer=12, guard_sharded=12)}
    rows = {r["name"]: r for r in memory.project(bpp)}
    q = rows["qwen3-30b-a3b, 8 GPUs: EP=8, DP=8"]
    experts, rest = 48 * 128 * 3 * 2048 * 768, 1_541_093_376
    assert q["params_total"] == experts + rest == 30_532_122_624
    want = (rest * (2 + 4 + 12 / 8) + experts / 8 * (2 + 4 + 12)) / 2**30
    assert q["gib_per_gpu"]["bf16"]["max"] == pytest.approx(want, rel=1e-12)
    guard = want + (rest * (2 + 12 / 8) + experts / 8 * (2 + 12)) / 2**30
    assert q["gib_per_gpu"]["bf16+guard"]["max"] == pytest.approx(guard, rel=1e-12)
    d = rows["deepseek-v3, 1024 GPUs: TP=2, PP=16, EP=64, DP=32"]
    assert (d["dp"], d["expert_dp"]) == (32, 1)
    assert d["params_total"] == pytest.approx(671e9, rel=1e-3) and d["params_active"] == pytest.approx(37e9, rel=0.02)
    # the busiest stage holds 4 MoE layers: 4 x 256 experts / EP=64 of 3 x 7168 x 2048 each on this GPU
    assert d["stages"][1]["expert"] == 4 * 256 * 3 * 7168 * 2048 // 64
    assert sum(s["expert"] for s in d["stages"]) * 64 == 58 * 256 * 3 * 7168 * 2048

"""`megapo bench projection`: the model descriptions against independent references (a formula written
out here, the parameter and tensor counts of real tiny HF models, torch's FLOP counter, the published
sizes of Qwen3-30B-A3B / 235B-A22B), the time model against hand-computed cases, and argument refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megapo.config import ConfigError
from tools.bench import projection as proj
from tools.bench.projection import Hardware, Layout, ModelShape, Workload

TINY = dict(layers=2, hidden=64, experts=4, topk=2, heads=4, kv_heads=2, head_dim=16, ffn=96, moe_ffn=48, vocab=320)


def qwen3_moe_params(L, H, nh, nkv, hd, E, F, V):
    """Qwen3-MoE, written out: embed + lm_head + final norm + per layer (q, k, v, o, q/k norm,
    two RMSNorms, router, E experts of gate/up/down)."""
    attention = H * nh * hd + H * nkv * hd + H * nkv * hd + nh * hd * H + hd + hd
    return V * H + V * H + H + L * (attention + H + H + E * H + E * (H * F + H * F + F * H))


@pytest.mark.parametrize("size", [dict(L=2, H=64, nh=4, nkv=2, hd=16, E=8, k=2, F=64, V=512),
                                  dict(L=4, H=192, nh=4, nkv=2, hd=48, E=8, k=2, F=192, V=1024),
                                  dict(L=3, H=96, nh=6, nkv=3, hd=24, E=6, k=3, F=40, V=400)])
def test_tiny_descriptions_match_the_written_out_formula(size):
    s = size
    shape = ModelShape("t", layers=s["L"], hidden=s["H"], heads=s["nh"], kv_heads=s["nkv"], head_dim=s["hd"],
                       vocab=s["V"], experts=s["E"], topk=s["k"], moe_ffn=s["F"], qk_norm=True)
    total = qwen3_moe_params(s["L"], s["H"], s["nh"], s["nkv"], s["hd"], s["E"], s["F"], s["V"])
    assert shape.total_params == total
    # active: only top-k of the E experts per layer
    assert shape.active_params == total - s["L"] * (s["E"] - s["k"]) * 3 * s["H"] * s["F"]
    assert shape.expert_params == s["L"] * s["E"] * 3 * s["H"] * s["F"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2"])
def test_description_matches_a_real_tiny_hf_model(tiny_model_factory, family):
    """Parameter count vs the HF model's own numel sum; tensor count vs the safetensors file; forward
    FLOPs vs torch's FlopCounterMode (eager attention computes the full T x T scores, so context = T;
    the counter does not see transformers' fused expert kernels, so the experts' share is written out)."""
    import transformers
    from safetensors import safe_open

    folder = tiny_model_factory(family, **TINY)
    hf = json.loads((folder / "config.json").read_text())
    shape = ModelShape.from_hf_config(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert shape.hf_tensors == len(list(f.keys()))
    T = 24
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, TINY["vocab"], (1, T)))
    experts = 2 * T * TINY["layers"] * TINY["topk"] * 3 * TINY["hidden"] * TINY["moe_ffn"] if family != "qwen2" else 0
    assert counter.get_total_flops() + experts == pytest.approx(T * shape.flops_per_token(T, train=False), rel=1e-9)


def test_published_sizes_of_qwen3_models():
    """Qwen's model cards: 30.5B total / 3.3B activated; 235B total / 22B activated."""
    a3b, a22b = proj.MODELS["qwen3-30b-a3b"], proj.MODELS["qwen3-235b-a22b"]
    assert a3b.total_params / 1e9 == pytest.approx(30.5, abs=0.05)
    assert a3b.active_params / 1e9 == pytest.approx(3.3, abs=0.06)
    assert a22b.total_params / 1e9 == pytest.approx(235, abs=0.5)
    assert a22b.active_params / 1e9 == pytest.approx(22, abs=0.3)
    # HF checkpoint: per layer q,k,v,o, q/k norm, 2 norms, router, 128 x 3 expert tensors; embed, head, norm
    assert a3b.hf_tensors == 48 * (4 + 2 + 2 + 1 + 128 * 3) + 3


def test_single_gpu_projection_is_compute_over_peak():
    """One GPU, no parallelism: no communication, no bubble; compute by hand."""
    shape = proj.MODELS["qwen3-30b-a3b"]
    hw, work = Hardware(peak_tflops=1000.0, mfu=0.5), Workload(sequences=8, seq_len=1024)
    step = proj.project_step(shape, Layout(), hw, work)
    tokens = 8 * 1024
    matmul = 48 * (2048 * 32 * 128 * 2 + 2 * 2048 * 4 * 128 + 8 * 3 * 2048 * 768 + 128 * 2048) + 151936 * 2048
    flops = tokens * (6 * matmul + 12 * 48 * 32 * 128 * 512)
    assert step["train"]["compute_s"] == pytest.approx(flops / (1000e12 * 0.5), rel=1e-12)
    for key in ("tp_comm_s", "ep_comm_s", "dp_grad_comm_s", "pp_bubble_s", "pp_p2p_s"):
        assert step["train"][key] == 0.0
    assert step["train"]["total_s"] == step["train"]["compute_s"]
    assert step["old_logp"]["total_s"] == pytest.approx(step["train"]["compute_s"] / 3, rel=1e-12)


def test_ep_all_to_all_and_bubble_by_hand():
    """EP8 in one node: 4 all-to-alls per layer of each rank's tokens x top-k x hidden x 2 bytes x 7/8
    over NVLink; PP2: bubble = compute / micro-batches."""
    shape = proj.MODELS["qwen3-30b-a3b"]
    hw = Hardware(nvlink_gbps=3200.0, link_efficiency=0.5)
    work = Workload(sequences=64, seq_len=2048, micro_batch_tokens=4096)
    step = proj.project_step(shape, Layout(tp=1, pp=1, ep=8, dp=8), hw, work)
    local_tokens = 64 * 2048 / 8
    nvlink = 3200 / 8 * 1e9 * 0.5
    assert step["train"]["ep_comm_s"] == pytest.approx(4 * 48 * local_tokens * 8 * 2048 * 2 * 7 / 8 / nvlink, rel=1e-12)
    step2 = proj.project_step(shape, Layout(tp=1, pp=2, ep=4, dp=4), hw, work)
    micro = math.ceil(64 * 2048 / 4 / 4096)
    assert step2["train"]["pp_bubble_s"] == pytest.approx(step2["train"]["compute_s"] / micro, rel=1e-12)


def test_weight_sync_scales_with_bytes_and_links():
    shape = proj.MODELS["qwen3-235b-a22b"]
    layout, work = Layout(tp=4, pp=4, ep=8, dp=4), Workload()
    base = proj.project_weight_sync(shape, layout, Hardware(per_tensor_overhead_us=0.0), work)
    fast = proj.project_weight_sync(shape, layout, Hardware(per_tensor_overhead_us=0.0, ib_gbps=800.0), work)
    assert base["bytes"] == 2 * shape.total_params
    # broadcast over IB: each of the 4 stage roots sends a quarter of the model
    assert base["broadcast_ib"]["transfer_s"] == pytest.approx(base["bytes"] / 4 / (400 / 8 * 1e9 * 0.7), rel=1e-12)
    assert fast["broadcast_ib"]["transfer_s"] == pytest.approx(base["broadcast_ib"]["transfer_s"] / 2, rel=1e-12)
    # point-to-point resharding: one engine GPU receives its 1/engine_tp share, no gather
    p2p = proj.project_weight_sync(shape, layout, Hardware(per_tensor_overhead_us=0.0), work, engine_tp=8)
    assert p2p["p2p_resharded"]["total_s"] == pytest.approx(base["bytes"] / 8 / (400 / 8 * 1e9 * 0.7), rel=1e-12)
    assert p2p["p2p_resharded"]["total_if_colocated_s"] == pytest.approx(base["bytes"] / 8 / (3600 / 8 * 1e9 * 0.7),
                                                                         rel=1e-12)
    with_overhead = proj.project_weight_sync(shape, layout, Hardware(per_tensor_overhead_us=10.0), work)
    assert with_overhead["broadcast_ib"]["total_s"] - base["broadcast_ib"]["total_s"] == pytest.approx(
        shape.hf_tensors * 10e-6, rel=1e-9)


@pytest.mark.parametrize("argv, field", [
    (["--model", "qwen3-8b"], "--model"),
    (["--model", "qwen3-30b-a3b", "--gpus", "6", "--tp", "4"], "--gpus"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--ep", "3"], "--ep"),
    (["--model", "qwen3-30b-a3b", "--mfu", "1.5"], "--mfu"),
    (["--model", "qwen3-30b-a3b", "--link-gbps", "0"], "--link-gbps"),
    (["--model", "qwen3-235b-a22b", "--gpus", "48", "--tp", "3", "--pp", "1"], "--tp"),
])
def test_bad_arguments_are_refused_naming_the_argument(tmp_path, capsys, argv, field):
    out = tmp_path / "p.json"
    assert proj.main([*argv, "--out", str(out)]) == 2
    assert field in capsys.readouterr().err
    assert not out.exists()


def test_cli_writes_assumptions_and_published_comparison(tmp_path):
    from megapo.cli import main

    out = tmp_path / "p.json"
    assert main(["bench", "projection", "--model", "qwen3-30b-a3b", "--gpus", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layout"] == {"tp": 1, "pp": 1, "ep": 8, "dp": 16, "gpus": 16, "expert_tp": 1}
    assert result["assumptions"]["hardware"]["peak_tflops"] == 989.0
    # each published number is projected for its own layout: the first is NeMo-RL's 32-GPU tp2/ep8 recipe
    pub = result["published"][0]
    assert pub["layout"] == {"tp": 2, "pp": 1, "ep": 8, "gpus": 32}
    theirs = proj.project_weight_sync(proj.MODELS["qwen3-30b-a3b"], Layout(tp=2, pp=1, ep=8, dp=16), Hardware(),
                                      Workload(), engine_tp=4)
    assert pub["predicted_s"] == pytest.approx(theirs["colocated_ipc"]["total_s"], rel=1e-12)
    with pytest.raises(ConfigError):
        proj.check_projection(proj.MODELS["qwen3-30b-a3b"], Layout(tp=1, ep=128, dp=8), Hardware(), Workload())


def test_from_scaling_uses_the_measured_single_process_throughput(tmp_path):
    """--from-scaling: compute time = FLOPs / (GPUs * the train FLOP/s measured at world 1 of the largest size)."""
    results = [
        {"world_size": 1, "layout": "tp1", "size": "small", "model": {"total_params": 10, "hf_tensors": 50, "layers": 2},
         "strong": {"train_flops": 4e9, "tokens": 1000, "time_s": {"train": 2.0, "weight_sync": 0.5}}},
        {"world_size": 1, "layout": "tp1", "size": "medium", "model": {"total_params": 99, "hf_tensors": 100, "layers": 4},
         "strong": {"train_flops": 6e9, "tokens": 1000, "time_s": {"train": 3.0, "weight_sync": 0.2}}},
        {"world_size": 2, "layout": "tp2", "size": "medium", "model": {"total_params": 99, "hf_tensors": 100, "layers": 4},
         "strong": {"train_flops": 6e9, "tokens": 1000, "time_s": {"train": 1.0, "weight_sync": 0.2}}},
    ]
    scaling = tmp_path / "scaling.json"
    scaling.write_text(json.dumps({"device": "cpu", "results": results}))
    out = tmp_path / "p.json"
    assert proj.main(["--model", "qwen3-30b-a3b", "--gpus", "8", "--from-scaling", str(scaling), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    measured = result["assumptions"]["measured_from_scaling"]
    assert measured["source_size"] == "medium"  # the largest single-process model
    assert measured["achieved_tflops_per_device"] == pytest.approx(6e9 / 3.0 / 1e12)
    assert measured["sync_s_per_tensor"] == pytest.approx(0.2 / 100)
    step = result["step"]
    assert step["train"]["compute_s"] == pytest.approx(step["train_flops"] / (8 * 6e9 / 3.0), rel=1e-9)
    assert proj.main(["--model", "qwen3-30b-a3b", "--from-scaling", str(tmp_path / "none.json"), "--out", str(out)]) == 2

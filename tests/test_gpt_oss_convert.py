"""`megapo convert` on gpt_oss: HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2, with
--verify (transformers vs the learner on the converted weights). Reference: the source safetensors written by
transformers (experts fused across experts, gate/up interleaved, transposed), every tensor compared with
torch.equal; the checkpoint's attention sinks read with torch.distributed.checkpoint (no megapo code) are the
source's. Config keys the Megatron model would not reproduce are refused by name before any process starts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import (  # noqa: E402
    check_convert_refuses, check_round_trip_is_bit_exact, convert_round_trip, read_checkpoint, read_tensors)


@pytest.fixture(scope="module")
def source(tiny_model_factory):
    return Path(tiny_model_factory("gpt_oss", moe_ffn=32))


@pytest.fixture(scope="module")
def round_trip(source, tmp_path_factory):
    return convert_round_trip(source, tmp_path_factory.mktemp("oss_convert"))


def test_round_trip_is_bit_exact(round_trip):
    src = check_round_trip_is_bit_exact(round_trip)
    assert src["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # fused across the 8 experts


def test_checkpoint_holds_the_sinks_and_expert_biases(source, round_trip):
    """Megatron's layers are stacked on dim 0 (experts on dim 1); its fc2 bias of expert e is the file's
    down_proj_bias[e]."""
    src = read_tensors(source)
    stored = read_checkpoint(round_trip["ckpt"], {"decoder.layers.self_attention.core_attention.softmax_offset": (2, 4),
                                                  "decoder.layers.mlp.experts.experts.linear_fc2.bias": (2, 8, 64)})
    for layer in (0, 1):
        assert torch.equal(stored["decoder.layers.self_attention.core_attention.softmax_offset"][layer],
                           src[f"model.layers.{layer}.self_attn.sinks"])
        assert torch.equal(stored["decoder.layers.mlp.experts.experts.linear_fc2.bias"][layer],
                           src[f"model.layers.{layer}.mlp.experts.down_proj_bias"])


@pytest.mark.parametrize("change, words", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 4096, "rope_theta": 150000.0, "mscale": 1.0}),
     ["rope parameters", "mscale"]),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0}), ["YaRN", "factor"]),
    (dict(swiglu_alpha=1.0), ["swiglu_alpha=1.0"]),
    (dict(experts_per_token=4), ["experts_per_token=4", "num_experts_per_tok=2"]),
    (dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
], ids=["yarn_mscale", "yarn_without_factor", "swiglu_alpha", "experts_per_token", "unknown"])
def test_configs_it_would_not_reproduce_are_refused(source, tmp_path, capsys, change, words):
    check_convert_refuses(source, tmp_path, capsys, change, words)


def test_a_yarn_config_is_accepted(source):
    """gpt-oss's own YaRN rope parameters (and openai's initial_context_length) pass the converter's checks."""
    from megapo.convert.support import check_config

    hf = {**json.loads((source / "config.json").read_text()), "initial_context_length": 4096,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}
    _, spec = check_config(hf, "--hf")
    assert spec.yarn.factor == 32.0 and spec.rope_theta == 150000.0

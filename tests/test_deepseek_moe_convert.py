"""`megapo convert` on the two families of the DeepSeekMoE block (deepseek_v3: MLA; glm4_moe: q/k/v biases, q/k
norms, partial rotary in rope_parameters; both: dense first layer, sigmoid router with expert bias, shared
expert): HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2 (the
stages split between the dense-and-MoE first half and the MoE second half), with --verify (transformers vs the
learner on the converted weights). Reference: the source safetensors written by transformers, every tensor
compared with torch.equal, the routers' expert bias (a buffer) included; the checkpoint's expert bias read
with torch.distributed.checkpoint (no megapo code) is the source's. Config keys the Megatron model would not
reproduce are refused by name before any process starts.

gpt_oss's round trip (tests/test_gpt_oss_convert.py has its refusals) rides in the same two launches: its
checks are below."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import (  # noqa: E402
    check_convert_refuses, check_round_trip_is_bit_exact, convert_round_trips, read_checkpoint, read_tensors)

BIASES = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]


FAMILIES = ("deepseek_v3", "glm4_moe")
# the tiny models converted: both DeepSeekMoE families, and gpt_oss (its own checks at the end of this module)
TINY = {**{f: dict(layers=4, moe_ffn=32) for f in FAMILIES}, "gpt_oss": dict(moe_ffn=32)}


@pytest.fixture(scope="module")
def round_trips(tiny_model_factory, tmp_path_factory):
    """Every family's round trip in one torchrun launch per direction."""
    return convert_round_trips({f: Path(tiny_model_factory(f, **kw)) for f, kw in TINY.items()}, tmp_path_factory)


@pytest.fixture(scope="module", params=FAMILIES)
def round_trip(request, round_trips):
    return round_trips[request.param]


def test_round_trip_is_bit_exact_expert_bias_included(round_trip):
    src = check_round_trip_is_bit_exact(round_trip)
    assert all(src[b].abs().min() > 0 for b in BIASES)  # a bias left at zero would show


def test_checkpoint_holds_the_expert_bias(round_trip):
    stored = read_checkpoint(round_trip["ckpt"],
                             {f"decoder.layers.{i}.mlp.router.expert_bias": (8,) for i in (1, 2, 3)})
    src = read_tensors(round_trip["source"])
    for i, bias in zip((1, 2, 3), BIASES):
        assert torch.equal(stored[f"decoder.layers.{i}.mlp.router.expert_bias"], src[bias]), i


@pytest.mark.parametrize("family, change, words", [
    ("deepseek_v3", dict(num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token-prediction"]),
    ("deepseek_v3", dict(moe_layer_freq=2), ["moe_layer_freq=2"]),
    ("deepseek_v3", dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
    ("deepseek_v3", dict(rope_interleave=False), ["rope_interleave"]),
    ("glm4_moe", dict(num_nextn_predict_layers=1), ["num_nextn_predict_layers=1", "multi-token-prediction"]),
    ("glm4_moe", dict(some_new_switch=True), ["'some_new_switch'", "not understood"]),
    ("glm4_moe", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                       "mrope_section": [8, 8]}), ["mrope_section"]),
    ("glm4_moe", dict(partial_rotary_factor=0.3), ["partial_rotary_factor=0.3", "disagree"]),
], ids=["ds-mtp", "ds-moe_layer_freq", "ds-unknown", "ds-rope_interleave", "glm-mtp", "glm-unknown", "glm-rope_key",
        "glm-two_rotary_factors"])
def test_configs_it_would_not_reproduce_are_refused(tiny_model_factory, tmp_path, capsys, family, change, words):
    check_convert_refuses(Path(tiny_model_factory(family, layers=4, moe_ffn=32)), tmp_path, capsys, change, words)


# ----------------------------------------------------------------------------- gpt_oss (same launches)


def test_gpt_oss_round_trip_is_bit_exact(round_trips):
    """gpt_oss: HF -> torch_dist saved under TP=2xEP=2, back to HF loaded under PP=2, with --verify. Reference: the
    source safetensors written by transformers (experts fused across experts, gate/up interleaved, transposed)."""
    src = check_round_trip_is_bit_exact(round_trips["gpt_oss"])
    assert src["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # fused across the 8 experts


def test_gpt_oss_checkpoint_holds_the_sinks_and_expert_biases(round_trips):
    """Megatron's layers are stacked on dim 0 (experts on dim 1); its fc2 bias of expert e is the file's
    down_proj_bias[e]; the attention sinks read with torch.distributed.checkpoint (no megapo code) are the source's."""
    round_trip = round_trips["gpt_oss"]
    src = read_tensors(round_trip["source"])
    stored = read_checkpoint(round_trip["ckpt"], {"decoder.layers.self_attention.core_attention.softmax_offset": (2, 4),
                                                  "decoder.layers.mlp.experts.experts.linear_fc2.bias": (2, 8, 64)})
    for layer in (0, 1):
        assert torch.equal(stored["decoder.layers.self_attention.core_attention.softmax_offset"][layer],
                           src[f"model.layers.{layer}.self_attn.sinks"])
        assert torch.equal(stored["decoder.layers.mlp.experts.experts.linear_fc2.bias"][layer],
                           src[f"model.layers.{layer}.mlp.experts.down_proj_bias"])

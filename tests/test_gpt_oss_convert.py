"""`megapo convert` on gpt_oss: config keys the Megatron model would not reproduce are refused by name before any
process starts; gpt-oss's own YaRN parameters pass. Its round trip (HF -> torch_dist saved under TP=2xEP=2, back to
HF loaded under PP=2, with --verify; every tensor compared with torch.equal, the checkpoint's attention sinks and
expert biases read with torch.distributed.checkpoint) is in tests/test_deepseek_moe_convert.py, in the same two
torchrun launches as the DeepSeekMoE families'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import check_convert_refuses  # noqa: E402


@pytest.fixture(scope="module")
def source(tiny_model_factory):
    return Path(tiny_model_factory("gpt_oss", moe_ffn=32))


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

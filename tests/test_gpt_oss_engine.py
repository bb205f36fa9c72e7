"""The embedded engine (megapo/engines/torch_lm.py) on gpt_oss: its spec is the learner's (sliding window 4, then
full attention; sinks, q/k/v/o, router and expert biases; clamped GLU; that each of these changes transformers'
log-probs is shown in tests/test_gpt_oss.py), and its YaRN rope against transformers'. (Logits, log-probs with left
padding, greedy generation with the sliding-window cache and routes against transformers' and the learner's, on
sequences much longer than the window: tests/test_family_engines.py.)"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import TOL, engine_spec, hf_forward, hf_model  # noqa: E402

from megapo.engines.torch_lm import TorchCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def tiny_oss(tiny_model_factory):
    return Path(tiny_model_factory("gpt_oss", moe_ffn=32))  # (ENGINE_MODELS["gpt_oss"])


def test_spec_comes_from_the_learners_model_spec(tiny_oss):
    spec, config = engine_spec(tiny_oss)
    assert (spec.linear_bias, spec.sinks, spec.sliding_window, spec.window_layers) == (True, True, 4, (True, False))
    assert (spec.glu_clamp, spec.glu_linear_offset, spec.norm_topk) == (config["swiglu_limit"], 1.0, True)


def test_yarn_forward_matches_transformers(tiny_oss, tmp_path):
    """gpt-oss's YaRN rope (its own factor and betas, the original context shortened to 16 so that 300 tokens
    span the ramp): logits within 1e-4 of transformers'."""
    yarn = tmp_path / "yarn"
    shutil.copytree(tiny_oss, yarn)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}
    (yarn / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(2))
    ref = hf_forward(hf_model(yarn), ids)[0]
    plain = TorchCausalLM.from_pretrained(tiny_oss).logits(ids)
    assert (plain - ref).abs().max().item() > 1e-3  # YaRN changes the logits
    assert (TorchCausalLM.from_pretrained(yarn).logits(ids) - ref).abs().max().item() < TOL

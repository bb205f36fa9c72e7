"""The embedded engine (megapo/engines/torch_lm.py) on glm4_moe: its spec is the learner's (partial rotary, q/k
norms, q/k/v biases, sigmoid group-limited router with expert bias, shared expert) on the tiny glm4_moe and its
variant (tests/family_checks.py ENGINE_MODELS), and the partial rotary is in use. (Logits, log-probs, greedy
generation and routes against transformers': tests/test_family_engines.py; that the learner's own routes are
transformers' choice: tests/test_family_replay.py; the engine and the learner agree in
tests/test_deepseek_moe_train.py.)"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import engine_model, engine_spec  # noqa: E402

from megapo.engines.torch_lm import TorchCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    return {name: engine_model(name, tiny_model_factory, tmp_path_factory)
            for name in ("glm4_moe", "glm4_moe-quarter_rotary_plain")}


def test_spec_comes_from_the_learners_model_spec(models):
    expected = {"glm4_moe": (16, True, True, 2), "glm4_moe-quarter_rotary_plain": (8, False, False, 0)}
    for name, (rope_dim, qk_norm, qkv_bias, groups) in expected.items():
        spec, hf = engine_spec(models[name])
        assert (spec.rope_dim, spec.qk_norm, spec.qkv_bias, spec.router_groups) == (
            rope_dim, qk_norm, qkv_bias, groups), name
        assert spec.moe_layers == (False, True, True, True) and spec.mla is None
        assert (spec.router_score, spec.expert_bias, spec.router_scaling,
                spec.shared_ffn) == ("sigmoid", True, 2.5, hf["moe_intermediate_size"])


def test_a_full_rotary_engine_would_differ(models):
    """The partial rotary is in use: the same weights with every dim rotated give other logits."""
    model = TorchCausalLM.from_pretrained(models["glm4_moe"])
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    full = TorchCausalLM(dataclasses.replace(model.spec, rotary_percent=1.0))
    full.load((name, view) for name, view in model.weight_views.items())
    assert (full.logits(ids) - model.logits(ids)).abs().max().item() > 1e-3

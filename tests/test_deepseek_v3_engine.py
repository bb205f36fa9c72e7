"""The embedded engine (megapo/engines/torch_lm.py) on deepseek_v3: its spec is the learner's (MLA, sigmoid router
with 2 routing groups of which a token may use 1, routed scaling, shared expert) and the loaded expert bias is in
use. (Logits, log-probs, greedy generation and routes against transformers' and the learner's, on the tiny
deepseek_v3 and a variant without the q bottleneck and group-limited routing: tests/test_family_engines.py.)"""

from __future__ import annotations

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import engine_model, engine_spec, same_sets  # noqa: E402

from megapo.engines.torch_lm import TorchCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_model_factory, tmp_path_factory):
    return engine_model("deepseek_v3", tiny_model_factory, tmp_path_factory)


def test_spec_comes_from_the_learners_model_spec(tiny):
    from megapo.models.family import family_for

    engine, hf = engine_spec(tiny)
    assert engine.moe_layers == (False, True, True) and engine.num_moe_layers == 2
    assert (engine.router_score, engine.expert_bias, engine.router_groups,
            engine.router_group_topk, engine.router_scaling) == ("sigmoid", True, 2, 1, 2.5)
    assert engine.mla == family_for(hf).spec(hf).mla and engine.shared_ffn == hf["moe_intermediate_size"]


def test_the_expert_bias_is_loaded_and_chooses(tiny):
    """Zeroing the engine's expert bias changes its routes: the loaded bias is in use."""
    model = TorchCausalLM.from_pretrained(tiny)
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(1))
    _, with_bias = model.logits(ids, with_routes=True)
    for layer in model.layers:
        if layer.get("expert_bias") is not None:
            layer["expert_bias"].zero_()
    _, without = model.logits(ids, with_routes=True)
    assert not same_sets(with_bias, without).all()

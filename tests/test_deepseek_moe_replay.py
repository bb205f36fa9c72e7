"""Routing replay on the DeepSeekMoE block's mixed layers, in both families that use it (deepseek_v3: MLA;
glm4_moe: GQA with partial rotary): the tiny model here has 4 layers, dense, MoE, MoE, MoE, so routes have 3
columns, one per MoE layer, in transformers' router order. (Free, replayed and forced routes through `megapo
logprobs` at TP=1, PP=2 and TP=2xEP=2, against transformers with the routes forced and the gates recomputed as
DeepSeek-V3 and GLM-4.5 define them: tests/test_family_replay.py.)"""

from __future__ import annotations

import sys

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from family_checks import hf_model, routers  # noqa: E402

MOE_LAYERS = 3
# family -> transformers' class names of its dense and MoE MLPs
MLP_CLASSES = {"deepseek_v3": ("DeepseekV3MLP", "DeepseekV3MoE"), "glm4_moe": ("Glm4MoeMLP", "Glm4MoeMoE")}


@pytest.mark.parametrize("family", list(MLP_CLASSES))
def test_routes_have_one_column_per_moe_layer(tiny_model_factory, family):
    """The dense first layer has no router: the route columns (one per router hooked by the replay references)
    are the 3 MoE layers. (The learner's routes have those 3 columns: tests/test_family_replay.py.)"""
    dense, moe = MLP_CLASSES[family]
    hf = hf_model(tiny_model_factory(family, layers=MOE_LAYERS + 1, moe_ffn=32))
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == [dense] + [moe] * MOE_LAYERS
    assert routers(hf) == [layer.mlp.gate for layer in hf.model.layers[1:]]

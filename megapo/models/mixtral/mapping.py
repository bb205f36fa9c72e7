"""Mixtral <-> Megatron: block_sparse_moe naming (w1 gate, w3 up, w2 down); HF routes with a softmax
over all experts, top-k, then renormalises the k weights, which equals Megatron's top-k-then-softmax
(router_pre_softmax=False). Pre-softmax without renormalisation would differ by ~1e-2 in logits."""

from __future__ import annotations

from megapo.layout import num_experts
from megapo.models.config_keys import Allowed, read
from megapo.models.family import GLOBAL_RULES, HF_LAYER, Family, ModelSpec, Rule, attention_rules, transformer_fields


MOE_MODULE = "block_sparse_moe"
GATE, UP, DOWN = "w1", "w3", "w2"  # each expert's projections


def spec(hf: dict) -> ModelSpec:
    return ModelSpec(
        family="mixtral",
        **transformer_fields(hf),
        ffn_hidden_size=hf["intermediate_size"],
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["intermediate_size"],
        topk=hf["num_experts_per_tok"],
        router_pre_softmax=False,
        hf_moe_module=MOE_MODULE,
        hf_expert_names=(GATE, UP, DOWN),
    )


LAYER_RULES = {
    **attention_rules(qk_norm=False, qkv_bias=False),
    "mlp.router.weight": Rule("copy", (HF_LAYER + MOE_MODULE + ".gate.weight",)),
}

HF_EXPERT = HF_LAYER + MOE_MODULE + ".experts.{E}."
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + GATE + ".weight", HF_EXPERT + UP + ".weight")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + DOWN + ".weight",)),
}

CONFIG_KEYS = {
    **read("intermediate_size", "num_local_experts", "num_experts_per_tok"),
    "sliding_window": Allowed(lambda v: v is None, "sliding-window attention"),
}

FAMILY = Family("mixtral", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, config_keys=CONFIG_KEYS,
                tiny="megapo.models.mixtral.tiny")

"""Qwen3-MoE <-> Megatron: q/k RMSNorm per head, top-k softmax router, normalised top-k, no biases."""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.layout import num_experts
from megapo.models.config_keys import Allowed, empty_value, false_value, full_attention, one_or_unset, read
from megapo.models.family import GLOBAL_RULES, HF_LAYER, Family, ModelSpec, Rule, attention_rules, transformer_fields


def spec(hf: dict) -> ModelSpec:
    sparse_step = hf.get("decoder_sparse_step", 1)
    if sparse_step != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("model", "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                          "is not supported yet")
    if hf.get("attention_bias"):
        raise ConfigError("model", "Qwen3-MoE with attention_bias=true is not supported yet")
    return ModelSpec(
        family="qwen3_moe",
        **transformer_fields(hf),
        ffn_hidden_size=hf["moe_intermediate_size"],
        qk_norm=True,
        num_experts=num_experts(hf),  # transformers 5.x writes num_local_experts
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        topk=hf["num_experts_per_tok"],
        # norm_topk_prob: softmax over all, top-k, renormalise == top-k logits then softmax over k.
        router_pre_softmax=not hf.get("norm_topk_prob", True),
    )


LAYER_RULES = {
    **attention_rules(qk_norm=True, qkv_bias=False),
    "mlp.router.weight": Rule("copy", (HF_LAYER + "mlp.gate.weight",)),
}

HF_EXPERT = HF_LAYER + "mlp.experts.{E}."
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + "down_proj.weight",)),
}

CONFIG_KEYS = {
    **read("moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
           "intermediate_size",  # unused when every layer is MoE (checked by spec)
           "sliding_window", "max_window_layers"),  # only used with use_sliding_window
    "decoder_sparse_step": Allowed(one_or_unset, "dense layers between MoE layers"),
    "mlp_only_layers": Allowed(empty_value, "dense (mlp_only) layers"),
    "attention_bias": Allowed(false_value, "attention biases"),
    "use_sliding_window": Allowed(false_value, "sliding-window attention"),
    "layer_types": Allowed(full_attention, "sliding-window layers"),
}

FAMILY = Family("qwen3_moe", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, config_keys=CONFIG_KEYS,
                tiny="megapo.models.qwen3_moe.tiny")

"""Dense Qwen3 <-> Megatron: Qwen2's layout without QKV biases, plus per-head q/k RMSNorm (as Qwen3-MoE)."""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.models.family import Family, ModelSpec, Rule, rope_theta
from megapo.models.qwen2.mapping import GLOBAL_RULES, HF_LAYER, _layer_rules


def spec(hf: dict) -> ModelSpec:
    if hf.get("attention_bias"):
        raise ConfigError("model", "Qwen3 with attention_bias=true is not supported yet")
    return ModelSpec(
        family="qwen3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=rope_theta(hf),
        max_positions=hf.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
    )


LAYER_RULES = {
    **_layer_rules(qkv_bias=False),
    "self_attention.q_layernorm.weight": Rule("copy", (HF_LAYER + "self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule("copy", (HF_LAYER + "self_attn.k_norm.weight",)),
}

FAMILY = Family("qwen3", spec, GLOBAL_RULES, LAYER_RULES, {})

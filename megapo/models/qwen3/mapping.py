"""Dense Qwen3 <-> Megatron: Qwen2's layout without QKV biases, plus per-head q/k RMSNorm (as Qwen3-MoE)."""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.models.family import GLOBAL_RULES, Family, ModelSpec, attention_rules, transformer_fields
from megapo.models.qwen2.mapping import DENSE_MLP_RULES


def spec(hf: dict) -> ModelSpec:
    if hf.get("attention_bias"):
        raise ConfigError("model", "Qwen3 with attention_bias=true is not supported yet")
    return ModelSpec(family="qwen3", **transformer_fields(hf), ffn_hidden_size=hf["intermediate_size"], qk_norm=True)


FAMILY = Family("qwen3", spec, GLOBAL_RULES, {**attention_rules(qk_norm=True, qkv_bias=False), **DENSE_MLP_RULES}, {})

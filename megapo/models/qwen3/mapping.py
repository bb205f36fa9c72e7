"""Dense Qwen3 <-> Megatron: Qwen2's layout without QKV biases, plus per-head q/k RMSNorm (as Qwen3-MoE)."""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.models.config_keys import Allowed, false_value, read
from megapo.models.family import GLOBAL_RULES, Family, ModelSpec, attention_rules, transformer_fields
from megapo.models.qwen2.mapping import DENSE_MLP_RULES, SLIDING_WINDOW_OFF


def spec(hf: dict) -> ModelSpec:
    if hf.get("attention_bias"):
        raise ConfigError("model", "Qwen3 with attention_bias=true is not supported yet")
    return ModelSpec(family="qwen3", **transformer_fields(hf), ffn_hidden_size=hf["intermediate_size"], qk_norm=True)


CONFIG_KEYS = {**SLIDING_WINDOW_OFF, **read("intermediate_size"),
               "attention_bias": Allowed(false_value, "attention biases")}

FAMILY = Family("qwen3", spec, GLOBAL_RULES, {**attention_rules(qk_norm=True, qkv_bias=False), **DENSE_MLP_RULES}, {},
                config_keys=CONFIG_KEYS)

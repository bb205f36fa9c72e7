"""Dense Qwen2 / Llama <-> Megatron: QKV bias (Qwen2) or none (Llama), gated SiLU MLP."""

from __future__ import annotations

from megapo.models.config_keys import Allowed, false_value, full_attention, one_or_unset, read
from megapo.models.family import GLOBAL_RULES, HF_LAYER, Family, ModelSpec, Rule, attention_rules, transformer_fields


def spec(hf: dict) -> ModelSpec:
    model_type = hf.get("model_type")
    return ModelSpec(
        family=model_type,
        **transformer_fields(hf),
        ffn_hidden_size=hf["intermediate_size"],
        # Qwen2 always has q/k/v biases; Llama only with attention_bias=true.
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
    )


DENSE_MLP_RULES = {
    "mlp.linear_fc1.weight": Rule("gate_up", (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": Rule("copy", (HF_LAYER + "mlp.down_proj.weight",)),
}

SLIDING_WINDOW_OFF = {
    **read("sliding_window", "max_window_layers"),  # only used with use_sliding_window
    "use_sliding_window": Allowed(false_value, "sliding-window attention"),
    "layer_types": Allowed(full_attention, "sliding-window layers"),
}
QWEN2_KEYS = {**read("intermediate_size"), **SLIDING_WINDOW_OFF}
LLAMA_KEYS = {
    **read("intermediate_size"),
    # Llama's attention_bias also adds an o_proj bias, which the Megatron model (no linear biases) lacks.
    "attention_bias": Allowed(false_value, "attention biases (q/k/v/o)"),
    "mlp_bias": Allowed(false_value, "MLP biases"),
    "pretraining_tp": Allowed(one_or_unset, "pretraining_tp slicing"),
}

# Bias rules are listed always; a parameter that the model does not have is simply never asked for.
LAYER_RULES = {**attention_rules(qk_norm=False, qkv_bias=True), **DENSE_MLP_RULES}
FAMILY = Family("qwen2", spec, GLOBAL_RULES, LAYER_RULES, {}, config_keys=QWEN2_KEYS, tiny="megapo.models.qwen2.tiny")
# the embedded engine does not run llama (its own HF names and rope variants are not mapped there)
LLAMA = Family("llama", spec, GLOBAL_RULES, LAYER_RULES, {}, config_keys=LLAMA_KEYS, engine=False)

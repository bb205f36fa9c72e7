"""Dense Qwen2 / Llama <-> Megatron: QKV bias (Qwen2) or none (Llama), gated SiLU MLP."""

from __future__ import annotations

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

# Bias rules are listed always; a parameter that the model does not have is simply never asked for.
FAMILY = Family("qwen2", spec, GLOBAL_RULES, {**attention_rules(qk_norm=False, qkv_bias=True), **DENSE_MLP_RULES}, {})

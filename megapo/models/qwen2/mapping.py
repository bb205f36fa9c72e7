"""Dense Qwen2 / Llama <-> Megatron: QKV bias (Qwen2) or none (Llama), gated SiLU MLP."""

from __future__ import annotations

from megapo.models.family import Family, ModelSpec, Rule, rope_theta

HF_LAYER = "model.layers.{L}."


def spec(hf: dict) -> ModelSpec:
    model_type = hf.get("model_type")
    return ModelSpec(
        family=model_type,
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
        # Qwen2 always has q/k/v biases; Llama only with attention_bias=true.
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
    )


def _layer_rules(qkv_bias: bool) -> dict[str, Rule]:
    rules = {
        "input_layernorm.weight": Rule("copy", (HF_LAYER + "input_layernorm.weight",)),
        "self_attention.linear_qkv.weight": Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")),
        "self_attention.linear_proj.weight": Rule("copy", (HF_LAYER + "self_attn.o_proj.weight",)),
        "pre_mlp_layernorm.weight": Rule("copy", (HF_LAYER + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.weight": Rule("gate_up", (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": Rule("copy", (HF_LAYER + "mlp.down_proj.weight",)),
    }
    if qkv_bias:
        rules["self_attention.linear_qkv.bias"] = Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"))
    return rules


GLOBAL_RULES = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}

# Bias rules are listed always; a parameter that the model does not have is simply never asked for.
FAMILY = Family("qwen2", spec, GLOBAL_RULES, _layer_rules(qkv_bias=True), {})

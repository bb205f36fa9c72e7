"""Qwen3-MoE <-> Megatron: q/k RMSNorm per head, top-k softmax router, normalised top-k, no biases."""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.layout import num_experts
from megapo.models.family import Family, ModelSpec, Rule, rope_theta

HF_LAYER = "model.layers.{L}."


def spec(hf: dict) -> ModelSpec:
    sparse_step = hf.get("decoder_sparse_step", 1)
    if sparse_step != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("model", "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) "
                          "is not supported yet")
    if hf.get("attention_bias"):
        raise ConfigError("model", "Qwen3-MoE with attention_bias=true is not supported yet")
    return ModelSpec(
        family="qwen3_moe",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["moe_intermediate_size"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=rope_theta(hf),
        max_positions=hf.get("max_position_embeddings", 4096),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        num_experts=num_experts(hf),  # transformers 5.x writes num_local_experts
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        topk=hf["num_experts_per_tok"],
        # norm_topk_prob: softmax over all, top-k, renormalise == top-k logits then softmax over k.
        router_pre_softmax=not hf.get("norm_topk_prob", True),
    )


GLOBAL_RULES = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}

LAYER_RULES = {
    "input_layernorm.weight": Rule("copy", (HF_LAYER + "input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.q_layernorm.weight": Rule("copy", (HF_LAYER + "self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule("copy", (HF_LAYER + "self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": Rule("copy", (HF_LAYER + "self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": Rule("copy", (HF_LAYER + "post_attention_layernorm.weight",)),
    "mlp.router.weight": Rule("copy", (HF_LAYER + "mlp.gate.weight",)),
}

HF_EXPERT = HF_LAYER + "mlp.experts.{E}."
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + "down_proj.weight",)),
}

FAMILY = Family("qwen3_moe", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES)

"""Mixtral <-> Megatron: block_sparse_moe naming (w1 gate, w3 up, w2 down); HF routes with a softmax
over all experts, top-k, then renormalises the k weights, which equals Megatron's top-k-then-softmax
(router_pre_softmax=False). Pre-softmax without renormalisation would differ by ~1e-2 in logits."""

from __future__ import annotations

from megapo.layout import num_experts
from megapo.models.family import Family, ModelSpec, Rule, rope_theta

HF_LAYER = "model.layers.{L}."


def spec(hf: dict) -> ModelSpec:
    return ModelSpec(
        family="mixtral",
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
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["intermediate_size"],
        topk=hf["num_experts_per_tok"],
        router_pre_softmax=False,
    )


GLOBAL_RULES = {
    "embedding.word_embeddings.weight": Rule("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",)),
    "output_layer.weight": Rule("vocab", ("lm_head.weight",)),
}

LAYER_RULES = {
    "input_layernorm.weight": Rule("copy", (HF_LAYER + "input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Rule("qkv", tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.linear_proj.weight": Rule("copy", (HF_LAYER + "self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": Rule("copy", (HF_LAYER + "post_attention_layernorm.weight",)),
    "mlp.router.weight": Rule("copy", (HF_LAYER + "block_sparse_moe.gate.weight",)),
}

HF_EXPERT = HF_LAYER + "block_sparse_moe.experts.{E}."
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + "w1.weight", HF_EXPERT + "w3.weight")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + "w2.weight",)),
}

FAMILY = Family("mixtral", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES)

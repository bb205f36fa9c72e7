"""What the converter accepts: an HF config it fully understands, and safetensors that match it.

The converter never guesses. Every key of config.json must be either read by the family mapping,
known to be harmless metadata, or hold a value the Megatron model reproduces exactly (e.g.
`use_sliding_window: false`); anything else (a rope scaling, sliding window, shared experts or
dense layers in a family whose mapping lacks them, tied embeddings, quantisation, an unknown key) is
refused with an error that names the key. The expected HF tensor names and shapes are derived from the family's
rename table and the config, so a weights/config mismatch is found from the safetensors headers,
before any process starts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megapo.config import ConfigError
from megapo.models.family import Family, ModelSpec, family_for

# Keys that do not change the forward pass of an inference/RL model (ids, bookkeeping, training-only
# losses and noise, KV-cache switches).
METADATA_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "_name_or_path", "tokenizer_class",
}

# Keys every family reads into its ModelSpec.
COMMON_KEYS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act",
    "tie_word_embeddings",
}


SUPPORTED_ACTIVATIONS = ("silu",)


def check_config(hf: dict, arg: str) -> tuple[Family, ModelSpec]:
    """(family, spec) of an HF config.json, or ConfigError(arg, ...) naming what is not understood."""
    try:
        family = family_for(hf)
    except ConfigError as exc:
        raise ConfigError(arg, str(exc)) from None
    allowed = family.config_keys
    for key, value in hf.items():
        if key in METADATA_KEYS or key in COMMON_KEYS:
            continue
        if key not in allowed:
            raise ConfigError(arg, f"config.json key {key!r} ({value!r}) is not understood by the "
                                   f"{hf['model_type']} converter; refusing to guess what it changes")
        if not allowed[key].check(value):
            raise ConfigError(arg, f"config.json {key}={value!r}: {allowed[key].why} not supported")
    if hf.get("hidden_act", "silu") not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(arg, f"config.json hidden_act={hf['hidden_act']!r}: only {SUPPORTED_ACTIVATIONS} supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    extra_rope = set(rope) - {"rope_theta", "rope_type"} - family.rope_keys
    if extra_rope:
        raise ConfigError(arg, f"config.json rope parameters {sorted(extra_rope)} are not supported "
                               f"(only plain RoPE with rope_theta)")
    if hf.get("tie_word_embeddings"):
        raise ConfigError(arg, "config.json tie_word_embeddings=true: tied embeddings are not supported "
                               "by the converter yet")
    if "quantization_config" in hf:
        raise ConfigError(arg, "quantized checkpoints are not supported")
    try:
        spec = family.spec(hf)
    except ConfigError as exc:
        raise ConfigError(arg, str(exc)) from None
    except KeyError as exc:
        raise ConfigError(arg, f"config.json lacks {exc.args[0]!r}") from None
    return family, spec


# Full (unsharded) HF shapes produced by each Megatron parameter suffix; None: the model has no such
# parameter. Keyed by Megatron names, which are the same for every family.
def _qkv_shapes(spec: ModelSpec, *rest: int) -> list[tuple[int, ...]]:
    d = spec.head_dim
    return [(spec.num_heads * d, *rest), (spec.num_kv_heads * d, *rest), (spec.num_kv_heads * d, *rest)]


MEGATRON_SHAPES: dict[str, Callable[[ModelSpec], list[tuple[int, ...]] | None]] = {
    "embedding.word_embeddings.weight": lambda s: [(s.vocab_size, s.hidden_size)],
    "decoder.final_layernorm.weight": lambda s: [(s.hidden_size,)],
    "output_layer.weight": lambda s: None if s.tied_embeddings else [(s.vocab_size, s.hidden_size)],
    "input_layernorm.weight": lambda s: [(s.hidden_size,)],
    "pre_mlp_layernorm.weight": lambda s: [(s.hidden_size,)],
    "self_attention.linear_qkv.weight": lambda s: _qkv_shapes(s, s.hidden_size),
    "self_attention.linear_qkv.bias": lambda s: _qkv_shapes(s) if s.qkv_bias else None,
    "self_attention.q_layernorm.weight": lambda s: (([(s.mla.q_lora_rank,)] if s.mla.q_lora_rank else None) if s.mla
                                                    else [(s.head_dim,)] if s.qk_norm else None),
    "self_attention.k_layernorm.weight": lambda s: [(s.head_dim,)] if s.qk_norm else None,
    "self_attention.linear_proj.weight": lambda s: [(s.hidden_size, s.num_heads * (s.mla.v_head_dim if s.mla
                                                                                   else s.head_dim))],
    # multi-latent attention (q through a q_lora_rank bottleneck, or q_proj without one)
    "self_attention.linear_q_proj.weight": lambda s: None if s.mla.q_lora_rank else [(s.num_heads * s.head_dim,
                                                                                      s.hidden_size)],
    "self_attention.linear_q_down_proj.weight": lambda s: [(s.mla.q_lora_rank, s.hidden_size)] if s.mla.q_lora_rank else None,
    "self_attention.linear_q_up_proj.weight": lambda s: ([(s.num_heads * s.head_dim, s.mla.q_lora_rank)]
                                                         if s.mla.q_lora_rank else None),
    "self_attention.linear_kv_down_proj.weight": lambda s: [(s.mla.kv_lora_rank + s.mla.qk_rope_head_dim, s.hidden_size)],
    "self_attention.kv_layernorm.weight": lambda s: [(s.mla.kv_lora_rank,)],
    "self_attention.linear_kv_up_proj.weight": lambda s: [(s.num_heads * (s.mla.qk_nope_head_dim + s.mla.v_head_dim),
                                                           s.mla.kv_lora_rank)],
    "mlp.linear_fc1.weight": lambda s: None if s.num_experts else [(s.ffn_hidden_size, s.hidden_size)] * 2,
    "mlp.linear_fc2.weight": lambda s: None if s.num_experts else [(s.hidden_size, s.ffn_hidden_size)],
    "mlp.router.weight": lambda s: [(s.num_experts, s.hidden_size)] if s.num_experts else None,
    "mlp.router.expert_bias": lambda s: [(s.num_experts,)] if s.num_experts and s.router_expert_bias else None,
    # gpt-oss: o_proj and router biases, attention sinks (one logit per head)
    "self_attention.linear_proj.bias": lambda s: [(s.hidden_size,)] if s.linear_bias else None,
    "self_attention.core_attention.softmax_offset": lambda s: [(s.num_heads,)] if s.attention_sinks else None,
    "mlp.router.bias": lambda s: [(s.num_experts,)] if s.num_experts and s.linear_bias else None,
    "mlp.shared_experts.linear_fc1.weight": lambda s: ([(s.shared_expert_ffn, s.hidden_size)] * 2
                                                       if s.num_experts and s.shared_expert_ffn else None),
    "mlp.shared_experts.linear_fc2.weight": lambda s: ([(s.hidden_size, s.shared_expert_ffn)]
                                                       if s.num_experts and s.shared_expert_ffn else None),
}
EXPERT_SHAPES: dict[str, Callable[[ModelSpec], list[tuple[int, ...]]]] = {
    "linear_fc1.weight": lambda s: [(s.moe_ffn_hidden_size, s.hidden_size)] * 2,
    "linear_fc2.weight": lambda s: [(s.hidden_size, s.moe_ffn_hidden_size)],
    "linear_fc1.bias": lambda s: [(s.moe_ffn_hidden_size,)] * 2,
    "linear_fc2.bias": lambda s: [(s.hidden_size,)],
}


def expected_hf_tensors(family: Family, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model has, with its shape, in the order the learner exports them."""
    out: dict[str, tuple[int, ...]] = {}

    def add(rule, shapes, **where):
        if shapes is None:
            return
        for name, shape in zip(rule.hf, shapes, strict=True):
            out[name.format(**where)] = shape

    for suffix, rule in family.global_rules.items():
        add(rule, MEGATRON_SHAPES[suffix](spec))
    dense = dataclasses.replace(spec, num_experts=0)  # a dense layer of a model with MoE layers
    for layer in range(spec.num_layers):
        layer_spec = spec if spec.is_moe_layer(layer) else dense
        for suffix, rule in family.layer_rules.items():
            add(rule, MEGATRON_SHAPES[suffix](layer_spec), L=layer)
        for expert in range(layer_spec.num_experts):
            for suffix, rule in family.expert_rules.items():
                add(rule, EXPERT_SHAPES[suffix](spec), L=layer, E=expert)
    if family.pack is not None:  # the files' fused tensors, as the export writes them
        import torch

        named = ((n, torch.empty(shape, device="meta")) for n, shape in out.items())
        return {n: tuple(t.shape) for n, t in family.pack(spec, named)}
    return out

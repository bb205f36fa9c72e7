"""GLM-4.5 / 4.6 (glm4_moe) <-> Megatron.

- Attention is GQA in the Llama/Qwen naming: q/k/v biases (attention_bias; o_proj has none) are Megatron's
  linear_qkv bias (add_qkv_bias), use_qk_norm's per-head q/k RMSNorms its q/k_layernorm (before the rotary).
- Partial rotary: transformers turns the first head_dim * partial_rotary_factor dims of each head, rotate-half
  within them (not interleaved), and passes the rest; Megatron's rotary_percent does the same. The factor is
  in rope_parameters (transformers 5) or at the top level of older configs, and is 0.5 when absent.
- The MLPs are the DeepSeekMoE block (megapo/models/deepseek_moe.py, shared with deepseek_v3): sigmoid router
  with its expert bias (a buffer), group-limited top-k, routed scaling factor, shared experts, the first
  first_k_dense_replace layers dense.
- Multi-token-prediction layers (num_nextn_predict_layers) are dropped by transformers' model and by this one.
"""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.models.config_keys import Allowed, read, zero_or_unset
from megapo.models.deepseek_moe import BUFFERS, EXPERT_RULES, MLP_RULES, MOE_KEYS, check_router, moe_fields
from megapo.models.family import GLOBAL_RULES, Family, ModelSpec, attention_rules, transformer_fields

DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default


def partial_rotary_factor(hf: dict) -> float:
    """The share of each head the rotary embedding turns, where transformers reads it."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    top = hf.get("partial_rotary_factor")
    inner = rope.get("partial_rotary_factor")
    if top is not None and inner is not None and float(top) != float(inner):
        raise ConfigError("model", f"glm4_moe partial_rotary_factor={top} and rope_parameters.partial_rotary_factor="
                                   f"{inner} disagree")
    return float(next((v for v in (inner, top) if v is not None), DEFAULT_PARTIAL_ROTARY))


def _check(hf: dict, head_dim: int) -> float:
    """Refuse what the Megatron model would compute differently, naming the config.json key; the rotary share."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("model", f"glm4_moe hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    factor = partial_rotary_factor(hf)
    rotary_dims = head_dim * factor
    # transformers rotates int(head_dim * factor) dims and Megatron int(kv_channels * rotary_percent): equal,
    # and a rotate-half of whole pairs, only for an even whole number of dims
    if not 0 < factor <= 1 or rotary_dims != int(rotary_dims) or int(rotary_dims) % 2:
        raise ConfigError("model", f"glm4_moe partial_rotary_factor={factor} with head_dim={head_dim}: the rotary "
                                   f"part ({rotary_dims:g} dims) must be an even whole number of dims, at most head_dim")
    check_router(hf)
    return factor


def spec(hf: dict) -> ModelSpec:
    fields = transformer_fields(hf)  # (refuses any rope_type but the default: no rope scaling)
    factor = _check(hf, fields["head_dim"])
    return ModelSpec(
        family="glm4_moe",
        **fields,
        **moe_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        rotary_percent=factor,
    )


# Bias and q/k-norm rules are listed always; a parameter that the model does not have is never asked for.
LAYER_RULES = {**attention_rules(qk_norm=True, qkv_bias=True), **MLP_RULES}

# (spec refuses the values its Megatron model would compute differently)
CONFIG_KEYS = {
    **MOE_KEYS,
    **read("attention_bias", "use_qk_norm", "partial_rotary_factor"),
    "num_nextn_predict_layers": Allowed(zero_or_unset, "multi-token-prediction layers (dropped by transformers' Glm4Moe model)"),
}

FAMILY = Family("glm4_moe", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, buffers=BUFFERS, config_keys=CONFIG_KEYS,
                rope_keys=frozenset({"partial_rotary_factor"}), tiny="megapo.models.glm4_moe.tiny")

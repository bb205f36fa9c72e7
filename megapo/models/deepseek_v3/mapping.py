"""DeepSeek-V3 <-> Megatron.

- Attention is MLA. HF's `rope_interleave=true` layout (the rotary dims of q and of the shared rotary key
  in interleaved pairs) is the layout Megatron's MLA expects (it de-interleaves before rotating), so every
  attention tensor is a plain copy. q_a/kv_a_layernorm are Megatron's q_layernorm/kv_layernorm.
- The MLPs are the DeepSeekMoE block (megapo/models/deepseek_moe.py, shared with glm4_moe): sigmoid router
  with its expert bias, group-limited top-k (a group scored by the sum of its top-2 biased scores; Megatron
  sums its top-(topk/topk_group): equal only when that is 2, checked), gates renormalised then times
  routed_scaling_factor, shared experts, the first `first_k_dense_replace` layers dense.
"""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.models.config_keys import Allowed, false_value, one_or_unset, read, zero_or_unset
from megapo.models.deepseek_moe import BUFFERS, EXPERT_RULES, MLP_RULES, MOE_KEYS, check_router, moe_fields
from megapo.models.family import GLOBAL_RULES, HF_LAYER, Family, MLASpec, ModelSpec, Rule, transformer_fields

HF_ATTN = HF_LAYER + "self_attn."


def _check(hf: dict) -> None:
    """Refuse what the Megatron model would compute differently, naming the config.json key."""
    if not hf.get("rope_interleave", True):
        raise ConfigError("model", "deepseek_v3 with rope_interleave=false is not supported yet (Megatron's MLA "
                                   "reads the rotary dims interleaved)")
    if hf.get("attention_bias"):
        raise ConfigError("model", "deepseek_v3 with attention_bias=true is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("model", f"deepseek_v3 hidden_act={hf['hidden_act']!r}: only 'silu' is supported")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError("model", f"deepseek_v3 topk_method={hf.get('topk_method')!r} / scoring_func="
                                   f"{hf.get('scoring_func')!r}: only noaux_tc with sigmoid is supported")
    check_router(hf)


def spec(hf: dict) -> ModelSpec:
    _check(hf)
    fields = transformer_fields(hf)
    fields["head_dim"] = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]  # (HF's head_dim is the rotary part)
    return ModelSpec(
        family="deepseek_v3",
        **fields,
        **moe_fields(hf),
        mla=MLASpec(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"]),
    )


def _copy(hf_name: str) -> Rule:
    return Rule("copy", (HF_LAYER + hf_name,))


LAYER_RULES = {
    "input_layernorm.weight": _copy("input_layernorm.weight"),
    # q with a low-rank bottleneck (q_lora_rank) or without (q_proj)
    "self_attention.linear_q_proj.weight": _copy("self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": _copy("self_attn.q_a_proj.weight"),
    "self_attention.q_layernorm.weight": _copy("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": _copy("self_attn.q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": _copy("self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": _copy("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": _copy("self_attn.kv_b_proj.weight"),
    "self_attention.linear_proj.weight": _copy("self_attn.o_proj.weight"),
    "pre_mlp_layernorm.weight": _copy("post_attention_layernorm.weight"),
    **MLP_RULES,
}

# (spec refuses the values its Megatron model would compute differently)
CONFIG_KEYS = {
    **MOE_KEYS,
    **read("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
           "topk_method", "scoring_func",
           "qk_head_dim",  # qk_nope_head_dim + qk_rope_head_dim, written by transformers
           "ep_size", "aux_loss_alpha", "seq_aux"),  # (DeepSeek's own config: parallel / training-only)
    "attention_bias": Allowed(false_value, "attention biases"),
    "pretraining_tp": Allowed(one_or_unset, "pretraining_tp slicing"),
    "moe_layer_freq": Allowed(one_or_unset, "MoE layers at a frequency other than 1"),
    "num_nextn_predict_layers": Allowed(zero_or_unset, "multi-token-prediction layers (dropped by transformers' DeepseekV3 model)"),
}

FAMILY = Family("deepseek_v3", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, buffers=BUFFERS, config_keys=CONFIG_KEYS,
                tiny="megapo.models.deepseek_v3.tiny")

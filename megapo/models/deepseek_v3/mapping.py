"""DeepSeek-V3 <-> Megatron.

- Attention is MLA. HF's `rope_interleave=true` layout (the rotary dims of q and of the shared rotary key
  in interleaved pairs) is the layout Megatron's MLA expects (it de-interleaves before rotating), so every
  attention tensor is a plain copy. q_a/kv_a_layernorm are Megatron's q_layernorm/kv_layernorm.
- Router: sigmoid scores; `e_score_correction_bias` (a buffer on both sides) is added only to choose the
  experts; group-limited: the token's best `topk_group` of `n_group` groups, a group scored by the sum of
  its top-2 biased scores (Megatron sums its top-(topk/topk_group): equal only when that is 2, checked);
  the k sigmoid gates renormalised (norm_topk_prob) then multiplied by routed_scaling_factor.
- Shared experts (n_shared_experts x moe_intermediate_size wide) added to every MoE layer's output; the
  first `first_k_dense_replace` layers are dense MLPs of intermediate_size.
"""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.layout import num_experts
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
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and topk // group_topk != 2:
        raise ConfigError("model", f"deepseek_v3 num_experts_per_tok={topk} // topk_group={group_topk} must be 2: "
                                   "HF scores a group by its top-2 experts, Megatron by its top-(topk/topk_group)")
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ConfigError("model", "deepseek_v3 with norm_topk_prob=false is not supported (Megatron renormalises "
                                   "sigmoid gates over the top k)")
    if topk == 1 and hf.get("norm_topk_prob", True):
        raise ConfigError("model", "deepseek_v3 with num_experts_per_tok=1 and norm_topk_prob=true is not supported "
                                   "(transformers' gate is then 1, Megatron's the sigmoid score)")


def spec(hf: dict) -> ModelSpec:
    _check(hf)
    layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    groups = hf.get("n_group") or 1
    fields = transformer_fields(hf)
    fields["head_dim"] = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]  # (HF's head_dim is the rotary part)
    return ModelSpec(
        family="deepseek_v3",
        **fields,
        ffn_hidden_size=hf["intermediate_size"],
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        topk=hf["num_experts_per_tok"],
        router_score="sigmoid",
        router_expert_bias=True,
        router_groups=groups if groups > 1 else 0,
        router_group_topk=(hf.get("topk_group") or 1) if groups > 1 else 0,
        router_scaling=float(hf.get("routed_scaling_factor") or 1.0),
        shared_expert_ffn=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        moe_layers=tuple(i >= first_dense for i in range(layers)),
        mla=MLASpec(q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"]),
    )


def _copy(hf_name: str) -> Rule:
    return Rule("copy", (HF_LAYER + hf_name,))


def _gate_up(prefix: str) -> Rule:
    return Rule("gate_up", (HF_LAYER + prefix + "gate_proj.weight", HF_LAYER + prefix + "up_proj.weight"))


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
    # dense layers (the first first_k_dense_replace)
    "mlp.linear_fc1.weight": _gate_up("mlp."),
    "mlp.linear_fc2.weight": _copy("mlp.down_proj.weight"),
    # MoE layers
    "mlp.router.weight": _copy("mlp.gate.weight"),
    "mlp.router.expert_bias": _copy("mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": _gate_up("mlp.shared_experts."),
    "mlp.shared_experts.linear_fc2.weight": _copy("mlp.shared_experts.down_proj.weight"),
}

HF_EXPERT = HF_LAYER + "mlp.experts.{E}."
EXPERT_RULES = {
    "linear_fc1.weight": Rule("gate_up", (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight")),
    "linear_fc2.weight": Rule("copy", (HF_EXPERT + "down_proj.weight",)),
}

FAMILY = Family("deepseek_v3", spec, GLOBAL_RULES, LAYER_RULES, EXPERT_RULES, buffers=("mlp.router.expert_bias",))

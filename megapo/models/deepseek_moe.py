"""The DeepSeekMoE block shared by deepseek_v3 and glm4_moe: a sigmoid router whose expert bias
(`e_score_correction_bias`, a buffer on both sides) is added only to choose the experts, optionally
group-limited (the token's best `topk_group` of `n_group` groups), the k sigmoid gates renormalised
(norm_topk_prob) then multiplied by routed_scaling_factor; shared experts (n_shared_experts x
moe_intermediate_size wide) added to every MoE layer's output; the first `first_k_dense_replace` layers
dense MLPs of intermediate_size. Both families name these HF tensors the same way.
"""

from __future__ import annotations

from megapo.config import ConfigError
from megapo.layout import num_experts
from megapo.models.config_keys import read as _read
from megapo.models.family import HF_LAYER, Rule

# config.json keys of the DeepSeekMoE block (its spec reads and checks them)
MOE_KEYS = _read("intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                 "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "n_shared_experts")


def check_router(hf: dict) -> None:
    """Refuse the router configs Megatron would compute differently from transformers, naming the key."""
    family = hf["model_type"]
    topk, experts = hf["num_experts_per_tok"], num_experts(hf)
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if experts % groups or experts // groups < 2:
        raise ConfigError("model", f"{family} n_routed_experts={experts} must be a multiple of n_group={groups} with at "
                                   "least 2 experts per group (transformers scores a group by its top 2)")
    if group_topk > groups:
        raise ConfigError("model", f"{family} topk_group={group_topk} exceeds n_group={groups}")
    if groups > 1 and topk // group_topk != 2:
        raise ConfigError("model", f"{family} num_experts_per_tok={topk} // topk_group={group_topk} must be 2: "
                                   "HF scores a group by its top-2 experts, Megatron by its top-(topk/topk_group)")
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ConfigError("model", f"{family} with norm_topk_prob=false is not supported (Megatron renormalises "
                                   "sigmoid gates over the top k)")
    if topk == 1 and hf.get("norm_topk_prob", True):
        raise ConfigError("model", f"{family} with num_experts_per_tok=1 and norm_topk_prob=true is not supported "
                                   "(transformers' gate is then 1, Megatron's the sigmoid score)")


def moe_fields(hf: dict) -> dict:
    """The ModelSpec fields of the MLPs: dense first layers, router, shared experts (call check_router first)."""
    layers, first_dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    groups = hf.get("n_group") or 1
    return dict(
        ffn_hidden_size=hf["intermediate_size"],
        num_experts=num_experts(hf),
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        topk=hf["num_experts_per_tok"],
        router_score="sigmoid",
        router_expert_bias=True,
        # one group is no limit (transformers then keeps every expert)
        router_groups=groups if groups > 1 else 0,
        router_group_topk=(hf.get("topk_group") or 1) if groups > 1 else 0,
        router_scaling=float(hf.get("routed_scaling_factor") or 1.0),
        shared_expert_ffn=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
        moe_layers=tuple(i >= first_dense for i in range(layers)),
    )


def _copy(hf_name: str) -> Rule:
    return Rule("copy", (HF_LAYER + hf_name,))


def _gate_up(prefix: str) -> Rule:
    return Rule("gate_up", (HF_LAYER + prefix + "gate_proj.weight", HF_LAYER + prefix + "up_proj.weight"))


MLP_RULES = {
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

BUFFERS = ("mlp.router.expert_bias",)  # Megatron buffers loaded and exported like parameters


def random_expert_bias(model, generator) -> None:
    """Give every router of a transformers model a random expert bias (transformers initialises it to zero),
    so that tests see whether it is loaded."""
    import torch

    for name, buf in model.named_buffers():
        if name.endswith("gate.e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=generator) * 0.05)

"""The tiny GLM-4.5 of `megapo tiny-model --family glm4_moe` (megapo/models/tiny.py calls it): GQA with q/k/v
biases and q/k RMSNorms, partial rotary 0.5, the first layer dense, 2 routing groups of which a token may use
1, one shared expert, a routed scaling factor, no multi-token-prediction layer. transformers initialises the
expert bias and the q/k/v biases to zero and the q/k norms to one; `finish` makes them random so that tests
see whether each is loaded."""

from __future__ import annotations

from megapo.models.deepseek_moe import random_expert_bias


def config(common: dict, *, layers: int, experts: int, topk: int, hidden: int, head_dim: int, ffn: int,
           moe_ffn: int):
    import transformers

    if layers < 2:
        raise ValueError(f"--layers must be >= 2 for glm4_moe (the first layer is dense), got {layers}")
    groups = 2 if experts % 2 == 0 and experts >= 2 * topk and topk == 2 else 1
    common = {**common, "rope_parameters": {"rope_type": "default", "rope_theta": common["rope_theta"],
                                            "partial_rotary_factor": 0.5}}
    return transformers.Glm4MoeConfig(
        head_dim=head_dim, intermediate_size=ffn, moe_intermediate_size=moe_ffn, n_routed_experts=experts,
        n_shared_experts=1, num_experts_per_tok=topk, n_group=groups, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=topk > 1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        num_nextn_predict_layers=0, **{k: v for k, v in common.items() if k != "rope_theta"})


def finish(model, generator) -> None:
    """Random expert bias, q/k/v biases and q/k norm weights (transformers' init leaves them 0 or 1)."""
    import torch

    random_expert_bias(model, generator)
    for name, param in model.named_parameters():
        if name.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
            with torch.no_grad():
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))

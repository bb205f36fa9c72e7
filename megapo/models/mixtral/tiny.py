"""The tiny mixtral of `megapo tiny-model --family mixtral` (megapo/models/tiny.py calls it): Mixtral: every layer MoE (the expert width is intermediate_size)."""

from __future__ import annotations


def config(common: dict, *, layers: int, experts: int, topk: int, hidden: int, head_dim: int, ffn: int,
           moe_ffn: int):
    import transformers

    return transformers.MixtralConfig(
        head_dim=head_dim, intermediate_size=moe_ffn, num_local_experts=experts, num_experts_per_tok=topk,
        output_router_logits=False, router_aux_loss_coef=0.001, **common)

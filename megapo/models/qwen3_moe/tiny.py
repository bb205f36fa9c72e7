"""The tiny qwen3_moe of `megapo tiny-model --family qwen3_moe` (megapo/models/tiny.py calls it): Qwen3-MoE: every layer MoE, q/k norms, no attention bias."""

from __future__ import annotations


def config(common: dict, *, layers: int, experts: int, topk: int, hidden: int, head_dim: int, ffn: int,
           moe_ffn: int):
    import transformers

    return transformers.Qwen3MoeConfig(
        head_dim=head_dim, intermediate_size=ffn, moe_intermediate_size=moe_ffn, num_experts=experts,
        num_experts_per_tok=topk, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, router_aux_loss_coef=0.001, attention_bias=False, **common)

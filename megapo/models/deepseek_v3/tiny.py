"""The tiny DeepSeek-V3 of `megapo tiny-model --family deepseek_v3` (megapo/models/tiny.py calls it):
MLA with small ranks, the first layer dense, 2 routing groups of which a token may use 1, one shared
expert, and a random (non-zero) router expert bias so that tests see whether it is loaded."""

from __future__ import annotations

from megapo.models.deepseek_moe import random_expert_bias as finish  # noqa: F401 (the DeepSeekMoE block's)


def config(common: dict, *, layers: int, experts: int, topk: int, hidden: int, head_dim: int, ffn: int,
           moe_ffn: int):
    import transformers

    if layers < 2:
        raise ValueError(f"--layers must be >= 2 for deepseek_v3 (the first layer is dense), got {layers}")
    groups = 2 if experts % 2 == 0 and experts >= 2 * topk else 1
    return transformers.DeepseekV3Config(
        intermediate_size=ffn, moe_intermediate_size=moe_ffn, n_routed_experts=experts, n_shared_experts=1,
        num_experts_per_tok=topk, n_group=groups, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 2, qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim, rope_interleave=True, attention_bias=False,
        num_mtp_layers=0, **{**common, "num_key_value_heads": common["num_attention_heads"]})


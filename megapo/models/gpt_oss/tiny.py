"""The tiny gpt-oss of `megapo tiny-model --family gpt_oss` (megapo/models/tiny.py calls it): alternating
sliding-window (window 4, shorter than the test sequences) and full-attention layers, plain RoPE, a
swiglu_limit small enough that the clamps cut, and random non-zero sinks and biases (transformers
initialises the expert biases at zero) so that tests see whether each is loaded."""

from __future__ import annotations

import torch

SLIDING_WINDOW = 4
SWIGLU_LIMIT = 0.1


def config(common: dict, *, experts: int, topk: int, head_dim: int, moe_ffn: int, **_sizes: int):  # (layers, hidden, ffn: fixed here)
    import transformers

    return transformers.GptOssConfig(
        head_dim=head_dim, intermediate_size=moe_ffn, num_local_experts=experts, num_experts_per_tok=topk,
        sliding_window=SLIDING_WINDOW, swiglu_limit=SWIGLU_LIMIT, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": common["rope_theta"]},
        **{k: v for k, v in common.items() if k != "rope_theta"})


def finish(model, generator: torch.Generator) -> None:
    """Random non-zero sinks (std 1: they visibly change attention) and biases (std 0.2 on q/k/v/o, 0.05 on
    the experts, 0.5 on the router so that it changes which experts are chosen)."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=generator))
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.copy_(0.2 * torch.randn(proj.bias.shape, generator=generator))
            mlp.router.bias.copy_(0.5 * torch.randn(mlp.router.bias.shape, generator=generator))
            for bias in (mlp.experts.gate_up_proj_bias, mlp.experts.down_proj_bias):
                bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))

"""The tiny qwen2 of `megapo tiny-model --family qwen2` (megapo/models/tiny.py calls it): dense Qwen2 (q/k/v biases); the MoE sizes are not used."""

from __future__ import annotations


def config(common: dict, *, layers: int, experts: int, topk: int, hidden: int, head_dim: int, ffn: int,
           moe_ffn: int):
    import transformers

    return transformers.Qwen2Config(intermediate_size=ffn, use_sliding_window=False, **common)

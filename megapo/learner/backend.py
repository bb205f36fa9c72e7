"""Which hardware path the learner takes: CPU with gloo and Megatron's local spec, or CUDA with NCCL and, where it
imports, Transformer Engine's layer spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    device: str  # "cpu" | "cuda"
    dist_backend: str  # "gloo" | "nccl"
    use_te: bool  # Transformer Engine layer spec


def detect_backend() -> Backend:
    """TE only with a GPU: TE cannot be imported without libcuda, and on CPU it breaks megatron.core."""
    if not torch.cuda.is_available():
        return Backend("cpu", "gloo", False)
    try:
        import transformer_engine  # noqa: F401

        use_te = True
    except Exception:  # TE raises more than ImportError when its CUDA libraries are missing
        use_te = False
    return Backend("cuda", "nccl", use_te)

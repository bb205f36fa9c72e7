"""What the GPU kit's sections share inside one worker process: the checkout's root, the log-prob bounds, the
model and batch sizes (the GPU's and the dry run's), the Skip a section raises when it cannot run here, and the
Context holding the work folder, the tiny models on disk and the one Learner a process may hold.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
# |learner - transformers| per-token log-prob bounds. fp32: the same bound as `megapo convert --verify`.
# bf16: transformers in bf16 against the fp32 learner; bf16 keeps 8 significant bits (a logit of size 1 rounds by
# up to 4e-3 and each layer adds its own), so the bound is a few times the gap seen on CPU (9e-3 to 1.2e-2); the
# control column shows transformers' own fp32-vs-bf16 gap on the same device.
TOL_FP32 = 1e-4
TOL_BF16 = 5e-2
TOL_RELOAD = 1e-6  # log-probs of a learner loaded from a checkpoint vs the learner that saved it


class Skip(Exception):
    """A section that did not run, with its status ("skipped: no CUDA", "unavailable: ...")."""


@dataclass(frozen=True)
class LargeShape:
    layers: int
    experts: int
    topk: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    moe_ffn: int
    vocab: int


@dataclass(frozen=True)
class Sizes:
    large: LargeShape
    train_sequences: int  # sequences of the large model's train batch
    train_length: int  # tokens per sequence (prompt + response)
    micro_batch_tokens: int
    warmup_steps: int
    timed_steps: int
    engine_prompts: int
    engine_prompt_length: int
    engine_new_tokens: int


# 16 layers, 64 experts top-8, 1.50 B parameters (0.53 B active), Qwen3's vocabulary and head size
GPU_SIZES = Sizes(LargeShape(layers=16, experts=64, topk=8, hidden=1024, heads=16, kv_heads=4, head_dim=128,
                             moe_ffn=352, vocab=151936),
                  train_sequences=16, train_length=512, micro_batch_tokens=8192, warmup_steps=1, timed_steps=3,
                  engine_prompts=16, engine_prompt_length=64, engine_new_tokens=32)
DRY_SIZES = Sizes(LargeShape(layers=2, experts=8, topk=2, hidden=64, heads=4, kv_heads=2, head_dim=16, moe_ffn=64,
                             vocab=512),
                  train_sequences=4, train_length=32, micro_batch_tokens=128, warmup_steps=1, timed_steps=2,
                  engine_prompts=2, engine_prompt_length=8, engine_new_tokens=8)


class Context:
    """What sections share inside one worker: the work folder, sizes, tiny models on disk and the one Learner
    this process may hold (Megatron's state is per process: a new one replaces the old)."""

    def __init__(self, work: Path, dry_run: bool, peak_tflops: float):
        import torch

        self.work, self.dry_run, self.peak_tflops = work, dry_run, peak_tflops
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.sizes = DRY_SIZES if dry_run else GPU_SIZES
        self._learner = None
        self._learner_key = None

    def need_cuda(self) -> None:
        if self.device != "cuda":
            raise Skip("skipped: no CUDA")

    def tiny_model(self, family: str = "qwen3_moe") -> Path:
        from megapo.models.tiny import write_tiny_model

        out = self.work / f"tiny_{family}"
        if not (out / "config.json").is_file():  # (a restarted worker reuses what the last one wrote)
            tmp = self.work / f".tmp_tiny_{family}_{os.getpid()}"
            write_tiny_model(tmp, family)
            os.replace(tmp, out)
        return out

    def learner(self, model_dir: Path, *, fresh: bool = False, **kwargs):
        """The Learner of `model_dir` (built once and reused unless `fresh`)."""
        from megapo.config import OptimConfig, ParallelConfig
        from megapo.learner.learner import Learner

        key = (str(model_dir), tuple(sorted(kwargs.items())))
        if fresh or key != self._learner_key:
            self.release()
            parallel = kwargs.pop("parallel", None) or ParallelConfig()
            optim = kwargs.pop("optim", None) or OptimConfig(lr=1e-3)
            self._learner = Learner(model_dir, parallel, optim, **kwargs)
            self._learner_key = key
        return self._learner

    def release(self) -> None:
        import torch

        if self._learner is not None:
            self._learner.close()
        self._learner = self._learner_key = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def synchronize(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()

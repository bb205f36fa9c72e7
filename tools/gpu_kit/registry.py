"""The GPU kit's sections in the order they run, each with its own timeout; BY_NAME finds one by name."""

from __future__ import annotations

from dataclasses import dataclass

from tools.gpu_kit.broadcast import section_broadcast
from tools.gpu_kit.compat import section_compat
from tools.gpu_kit.environment import section_environment
from tools.gpu_kit.large import section_engine_decode, section_large_train
from tools.gpu_kit.learner_checks import (section_bf16_step, section_checkpoint, section_logprobs, section_te_fp8,
                                         section_train_step)
from tools.gpu_kit.nccl import section_nccl_group
from tools.gpu_kit.replay import section_routing_replay


@dataclass(frozen=True)
class Section:
    name: str
    run: object  # Callable[[Context], dict]
    timeout_s: float


SECTIONS = [
    Section("environment", section_environment, 60),
    Section("compat", section_compat, 30),
    Section("logprobs", section_logprobs, 150),
    Section("train_step", section_train_step, 90),
    Section("checkpoint", section_checkpoint, 90),
    Section("bf16_step", section_bf16_step, 90),
    Section("routing_replay", section_routing_replay, 90),
    Section("nccl_group", section_nccl_group, 60),
    Section("large_train", section_large_train, 200),
    Section("engine_decode", section_engine_decode, 150),
    Section("broadcast", section_broadcast, 180),
    Section("te_fp8", section_te_fp8, 90),
]
BY_NAME = {s.name: s for s in SECTIONS}

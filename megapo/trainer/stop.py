"""Stopping early on a signal (slurm/README.md, "Stopping: the trainer's contract").

SIGTERM / SIGUSR1 only set a flag (they may arrive several times, from Slurm and from torchrun).
The loop asks `StopFlag.agreed()` at every step boundary: an all-reduce of the flag, so every rank
stops after the same step, saves the same checkpoint and raises `TrainingStopped`; `megapo train`
then exits with EXIT_CHECKPOINTED (75) and a rerun with `--resume` continues at the next step.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import torch

EXIT_CHECKPOINTED = 75  # = launch.slurm.EXIT_CHECKPOINTED (EX_TEMPFAIL: stopped early, try again)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(Exception):
    """Raised by the loop after it saved a checkpoint because a stop was requested."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step} (checkpoint saved)")
        self.step = step


@dataclass
class StopFlag:
    requested: bool = False
    signals: list[int] = field(default_factory=list)  # what arrived, for the log

    def install(self, signals=STOP_SIGNALS) -> None:
        """Main thread only (Python delivers signals there)."""
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signals.append(signum)

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (collective when distributed)."""
        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)

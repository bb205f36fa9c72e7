"""Stopping early on a signal (slurm/README.md, "Stopping: the trainer's contract").

SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) only set a flag. The first one is enough: from then on all three are ignored,
by this process and by every process it starts while it saves (an ignored signal stays ignored in children), and
a line on stderr says so (a second Ctrl-C does not abort: SIGKILL does, losing the step). They do arrive
again: Slurm signals every process of the step and torchrun then sends SIGTERM to the worker's whole process
group, which would kill the helper process Megatron's checkpoint writer spawns, and the save with it. A signal
that lands while a save is starting such a helper, before this process's handler has run, would still reach the
helper (a spawned process starts with the default action), so the save runs with the stop signals blocked
(`signals_held`): a child inherits the blocked mask and cannot be stopped by them; this process handles them after.
The loop asks `StopFlag.agreed()` at every step boundary: an all-reduce of the flag, so every rank
stops after the same step, saves the same checkpoint and raises `TrainingStopped`; `megapo train`
then exits with EXIT_CHECKPOINTED (75) and a rerun with `--resume` continues at the next step.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field

# the launchers' exit code for "stopped early, try again" (EX_TEMPFAIL); megapo.launch.slurm reads it from here
EXIT_CHECKPOINTED = 75
# SIGINT: a terminal sends it to the whole foreground process group, like torchrun's SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextlib.contextmanager
def signals_held(signals=STOP_SIGNALS):
    """Block `signals` in this thread for the body (a checkpoint save); a signal that arrives meanwhile stays
    pending, or is taken by another thread, and the flag handler runs as usual. Every process the body starts
    inherits the blocked mask, across exec too."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class TrainingStopped(Exception):
    """Raised by the loop after it saved a checkpoint because a stop was requested."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step} (checkpoint saved)")
        self.step = step


@dataclass
class StopFlag:
    requested: bool = False
    signals: list[int] = field(default_factory=list)  # what arrived, for the log
    _installed: tuple = field(default=(), repr=False)
    _previous: dict = field(default_factory=dict, repr=False)

    def install(self, signals=STOP_SIGNALS) -> None:
        """Main thread only (Python delivers signals there)."""
        self._installed = tuple(signals)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back their handlers from before `install` (the run is over)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signals.append(signum)
        for sig in self._installed:  # the stop is decided: later signals must not reach the save's helpers
            signal.signal(sig, signal.SIG_IGN)
        os.write(2, f"megapo: {signal.Signals(signum).name}: stopping after the current step with a checkpoint "
                    f"(exit {EXIT_CHECKPOINTED}); further stop signals are ignored\n".encode())

    def agreed(self) -> bool:
        """True on every rank when any rank was asked to stop (collective when distributed)."""
        from megapo.dist import any_rank  # (torch: not imported by launchers that only read EXIT_CHECKPOINTED)

        return any_rank(self.requested)

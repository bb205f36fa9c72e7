"""torchrun without its own traceback: `python -m megapo.launch.quiet_torchrun ARGS` is `torchrun ARGS`, except
when it fails. torchrun ends a failed launch with a ChildFailedError traceback and a table of the ranks; this
ends with the first failed worker's exit code (a worker killed by signal N: 128 + N) and a stop signal to the
launcher (SIGTERM, Ctrl-C) with 128 + its number, printing nothing. Under a megapo command (MEGAPO_ERROR_DIR set,
megapo/launch/local.py) it records what it saw, for the command's last line when no worker recorded its own
error (megapo.worker_errors). The workers' output is untouched; torchrun's log lines about stopping them are
dropped unless MEGAPO_DEBUG=1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from megapo import worker_errors


def _quiet_torch_logs() -> None:
    # torch's elastic loggers set their own level (LOGLEVEL, default WARNING): lower each one that exists
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _record(message: str, code: int, rank: int = 0) -> None:
    if os.environ.get(worker_errors.ERROR_DIR):
        worker_errors.record(worker_errors.Failure(message, code, rank, time.time()), worker_errors.LAUNCHER_RECORD)


def _launch(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not worker_errors.debug():
        _quiet_torch_logs()
    os.environ[worker_errors.LAUNCHER_PID] = str(os.getpid())  # the workers are this process's children
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        if first.exitcode < 0:
            code = 128 - first.exitcode
            _record(f"rank {rank} was killed by {_signal_name(-first.exitcode)} (out of memory?) without a message; "
                    f"see the output above", worker_errors.EXIT_FAILED, rank)
        else:
            code = first.exitcode or worker_errors.EXIT_FAILED
            _record(f"rank {rank} exited with code {code} without a message; see the output above", code, rank)
        return code
    except SignalException as exc:
        number = int(exc.sigval)
        _record(f"stopped by {_signal_name(number)} (the workers were sent it too)", 128 + number)
        return 128 + number
    return 0


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))

"""Start N local processes with torchrun for a command that needs a multi-process learner.

    rc = run_torchrun(["-m", "megapo.commands.logprobs", "--worker", ...], nproc=4, timeout_s=600)

`python -m torch.distributed.run --standalone --nproc-per-node N` runs the module in N processes (the
rendezvous store binds port 0, so two launches at once never race for a port picked beforehand); the whole
process group is killed when `timeout_s` passes, so a hung collective ends with a non-zero exit code (124)
instead of hanging forever.

A command runs its workers with `run_workers` (or `run_launch`, in its own process group, for `megapo launch
local`): torchrun then runs as megapo.launch.quiet_torchrun (no ChildFailedError traceback) and the workers
record their failure in a folder of their own (megapo.worker_errors), which these raise as WorkersFailed: the
first failing rank's one-line message and exit code, for the command's last line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager

from megapo.worker_errors import ERROR_DIR, EXIT_FAILED, Failure, WorkersFailed, first_failure

TIMEOUT_EXIT = 124
TORCHRUN = "torch.distributed.run"
QUIET_TORCHRUN = "megapo.launch.quiet_torchrun"


def torchrun_command(args: list[str], nproc: int, port: int | None = None) -> list[str]:
    """torchrun on this machine: at `port` when given, else --standalone (its store binds a free port itself: a port
    picked here first could be taken by another launch before torchrun binds it)."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    where = ["--standalone"] if port is None else ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    return [sys.executable, "-m", TORCHRUN, "--nproc-per-node", str(nproc), *where, *args]


def quiet(cmd: list[str]) -> list[str]:
    """torchrun_command's `cmd` run by megapo.launch.quiet_torchrun."""
    at = cmd.index(TORCHRUN)
    return [*cmd[:at], QUIET_TORCHRUN, *cmd[at + 1:]]


def run_torchrun(args: list[str], nproc: int, *, timeout_s: float = 900, env: dict | None = None) -> int:
    """Run `args` (python arguments: script or -m module) under torchrun; return its exit code. A failure
    ends with one line `launch: <the first failing rank's message>` on stderr."""
    try:
        return run_workers(args, nproc, timeout_s=timeout_s, env=env)
    except WorkersFailed as exc:
        print(f"launch: {exc}", file=sys.stderr)
        return exc.code


def run_workers(args: list[str], nproc: int, *, timeout_s: float = 900, env: dict | None = None) -> int:
    """Run `args` under torchrun in a process group of its own, killed after `timeout_s`; 0, or WorkersFailed
    with the first failing rank's message and exit code (TIMEOUT_EXIT for the timeout)."""
    with _error_dir() as errors:
        full_env = dict(os.environ)
        full_env.setdefault("OMP_NUM_THREADS", "1")  # N processes share few cores
        full_env.update(env or {})
        full_env[ERROR_DIR] = errors
        proc = subprocess.Popen(quiet(torchrun_command(args, nproc)), env=full_env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise WorkersFailed(Failure(f"{nproc} processes still running after {timeout_s:.0f} s; killed them",
                                        TIMEOUT_EXIT)) from None
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
        return _check(rc, errors, nproc)


def run_launch(cmd: list[str], nproc: int) -> int:
    """Run torchrun_command's `cmd` quietly in this process group (`megapo launch local`): SIGTERM to this
    process reaches torchrun once (it forwards it to the workers, and the trainer checkpoints); Ctrl-C already
    reaches every process of the foreground group by itself. 0, or WorkersFailed as run_workers."""
    with _error_dir() as errors:
        proc = subprocess.Popen(quiet(cmd), env={**os.environ, ERROR_DIR: errors})
        term = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            rc = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, term)
            signal.signal(signal.SIGINT, interrupt)
        return _check(rc, errors, nproc)


@contextmanager
def _error_dir():
    with tempfile.TemporaryDirectory(prefix="megapo_errors_") as folder:
        yield folder


def _check(rc: int, errors: str, nproc: int) -> int:
    if rc == 0:
        return 0
    failure = first_failure(errors) or Failure(f"the {nproc} processes failed (exit code {rc}) without a message; "
                                               f"see the output above", rc if 0 < rc < 256 else EXIT_FAILED)
    raise WorkersFailed(failure)

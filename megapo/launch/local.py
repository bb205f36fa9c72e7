"""Start N local processes with torchrun for a command that needs a multi-process learner.

    rc = run_torchrun(["-m", "megapo.commands.logprobs", "--worker", ...], nproc=4, timeout_s=600)

`python -m torch.distributed.run --nproc-per-node N --master-port <free port>` runs the module in
N processes; the whole process group is killed when `timeout_s` passes, so a hung collective ends
with a non-zero exit code (124) instead of hanging forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from megapo.net import free_port

TIMEOUT_EXIT = 124


def torchrun_command(args: list[str], nproc: int, port: int | None = None) -> list[str]:
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port or free_port()), *args]


def run_torchrun(args: list[str], nproc: int, *, timeout_s: float = 900, env: dict | None = None) -> int:
    """Run `args` (python arguments: script or -m module) under torchrun; return its exit code."""
    cmd = torchrun_command(args, nproc)
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # N processes share few cores
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, env=full_env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"launch: {nproc} processes still running after {timeout_s:.0f} s; killing them", file=sys.stderr)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return TIMEOUT_EXIT
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise

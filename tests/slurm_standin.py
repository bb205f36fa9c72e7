"""Stand-in for `megapo train` / `megapo serve` that keeps the launch contract (slurm/README.md).

Used by tests/test_slurm_real.py through `megapo launch slurm --entry-script` until the real
trainer is plugged in. It does no learning, only what the launch relies on:

    train [--resume] CONFIG [overrides]   one process per rank under torchrun: runs train.steps
        steps of train.step_seconds each; ranks agree every step (through files) whether
        a SIGTERM arrived; if so rank 0 writes <output_dir>/checkpoints/latest.json (atomically)
        and every rank exits with EXIT_CHECKPOINTED. With --resume it continues from that file.
        Rank 0 appends one line per run to <output_dir>/runs.jsonl and writes <output_dir>/progress.
        train.crash_rank / train.crash_step make one rank fail (exit 3), as a crashing trainer would; a rank
        told to stop that then waits on a peer which never comes gives up after PEER_WAIT_AFTER_STOP_S (exit 1),
        as a collective timeout would.
    serve CONFIG --host H [--allow-remote] --port P [overrides]   an HTTP server answering GET /health
        with its Slurm node name (and the key file it was given); exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from megapo.trainer.stop import EXIT_CHECKPOINTED
from megapo.config import apply_override


def _checkpoints_folder() -> str:
    """megapo.trainer.run_dir.CHECKPOINTS, read from the module's source: importing it imports torch, seconds of CPU
    in every rank (and the torchrun agents import it too) on a 2-core machine, for one string."""
    import ast
    import importlib.util

    tree = ast.parse(Path(importlib.util.find_spec("megapo.trainer.run_dir").origin).read_text())
    [value] = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["CHECKPOINTS"]]
    return value


CHECKPOINTS = _checkpoints_folder()


def load(config: str, overrides: list[str]) -> dict:
    data = yaml.safe_load(Path(config).read_text()) or {}
    for item in overrides:
        apply_override(data, item)
    return data


def train(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="standin train")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_intermixed_args(argv)
    cfg = load(args.config, args.overrides)
    out = Path(cfg["train"]["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    steps = int(cfg["train"]["steps"])
    step_s = float(cfg["train"].get("step_seconds", 0.05))
    crash_rank = cfg["train"].get("crash_rank")  # this rank fails (exit 3) at step crash_step
    crash_step = cfg["train"].get("crash_step", 1)

    stop = {"signal": None}

    def on_term(signum, frame):  # may arrive twice (from Slurm and from torchrun): only record it
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_term)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by torchrun
    group = FileGroup(out, rank, world, stopped=lambda: stop["signal"] is not None)
    ckpt = out / CHECKPOINTS / "latest.json"
    start = 0
    if args.resume and ckpt.is_file():
        start = json.loads(ckpt.read_text())["step"]
    record = {
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "job": os.environ.get("SLURM_JOB_ID"),
        "resume_flag": args.resume,
        "start": start,
        "world_size": world,
        "overrides": args.overrides,
        # where every rank runs, and which engines the learner can reach (disaggregated launch)
        "rank_nodes": group.all_gather("nodes", os.environ.get("SLURMD_NODENAME", socket.gethostname())),
    }
    if rank == 0:
        record["servers"] = [_health(server) for server in cfg.get("rollout", {}).get("servers", [])]

    step = start
    while step < steps:
        time.sleep(step_s)  # "a training step"
        step += 1
        if rank == crash_rank and step == crash_step:
            print(f"rank {rank}: failing at step {step} as configured", flush=True)
            return 3  # the other ranks wait for it at this step until Slurm ends the step
        stop_now = any(group.all_gather(f"step{step}", stop["signal"] is not None))  # all ranks stop together
        if rank == 0:
            (out / "progress").write_text(str(step))
        if stop_now:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step}))
                os.replace(tmp, ckpt)  # a checkpoint is either complete or absent
                _append(out / "runs.jsonl", {**record, "end": step, "exit": EXIT_CHECKPOINTED})
            group.all_gather("saved", True)
            return EXIT_CHECKPOINTED
    if rank == 0:
        _append(out / "runs.jsonl", {**record, "end": step, "exit": 0})
    group.all_gather("done", True)
    return 0


class FileGroup:
    """Ranks exchange small values through files in the shared output dir.

    Enough for a stand-in (and much cheaper than importing torch in every rank on a 2-core machine);
    torchrun's own agents still rendezvous at the master address the template passes them.
    """

    # Once this rank was told to stop (SIGTERM), how long it still waits for a peer before giving up with an error,
    # as a trainer's collective timeout would: a peer that died (the crash test) never comes, and the rank ends
    # by itself instead of at Slurm's SIGKILL (KillWait, 30 s on the test cluster). A live peer that got the same
    # signal reaches the step's exchange within a step.
    PEER_WAIT_AFTER_STOP_S = 10.0

    def __init__(self, out: Path, rank: int, world: int, stopped=lambda: False):
        # one folder per launch: job and restart under Slurm; torchrun's master port for local runs
        launch_id = "-".join(os.environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "MASTER_PORT"))
        self.dir = out / ".sync" / launch_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.stopped = rank, world, stopped

    def all_gather(self, key: str, value) -> list:
        tmp = self.dir / f".{key}.{self.rank}.tmp"
        tmp.write_text(json.dumps(value))
        os.replace(tmp, self.dir / f"{key}.{self.rank}")  # readers never see a partial file
        paths = [self.dir / f"{key}.{r}" for r in range(self.world)]
        give_up_at = None
        while not all(path.exists() for path in paths):
            if give_up_at is None and self.stopped():
                give_up_at = time.monotonic() + self.PEER_WAIT_AFTER_STOP_S
            if give_up_at is not None and time.monotonic() > give_up_at:
                missing = [r for r, path in enumerate(paths) if not path.exists()]
                print(f"rank {self.rank}: stopped, and ranks {missing} never reached {key!r} within "
                      f"{self.PEER_WAIT_AFTER_STOP_S:.0f} s: giving up (exit 1)", flush=True)
                sys.exit(1)
            time.sleep(0.01)
        return [json.loads(path.read_text()) for path in paths]


def _health(server: str) -> dict:
    """GET http://host:port/health of one engine server (retrying while it starts)."""
    for _ in range(30):
        try:
            with urllib.request.urlopen(f"http://{server}/health", timeout=5) as resp:
                return {"server": server, **json.loads(resp.read())}
        except OSError:
            time.sleep(1)
    return {"server": server, "error": "unreachable"}


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="standin serve")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--allow-remote", action="store_true")
    args = ap.parse_intermixed_args(argv)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    key_file = load(args.config, args.overrides).get("rollout", {}).get("api_key_file")
    if args.host != "127.0.0.1" and not (args.allow_remote and key_file):  # megapo serve's rule
        print(f"[serve {node}] refusing --host {args.host} without --allow-remote and a key file", flush=True)
        return 2

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"node": node, "port": args.port, "api_key_file": key_file}).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *a):
            print(f"[serve {node}] " + fmt % a, flush=True)

    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))
    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"[serve {node}] listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"train": train, "serve": serve}[command](rest))

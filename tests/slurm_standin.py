"""Stand-in for `megapo train` / `megapo serve` that keeps the launch contract (slurm/README.md).

Used by tests/test_slurm_real.py through `megapo launch slurm --entry-script` until the real
trainer is plugged in. It does no learning, only what the launch relies on:

    train [--resume] CONFIG [overrides]   one process per rank under torchrun (gloo): runs
        train.steps steps of train.step_seconds each; ranks agree every step (all-reduce) whether
        a SIGTERM arrived; if so rank 0 writes <output_dir>/checkpoints/latest.json (atomically)
        and every rank exits with EXIT_CHECKPOINTED. With --resume it continues from that file.
        Rank 0 appends one line per run to <output_dir>/runs.jsonl and writes <output_dir>/progress.
        train.crash_rank / train.crash_step make one rank fail (exit 3), as a crashing trainer would.
    serve CONFIG --host H --port P [overrides]   an HTTP server answering GET /health with its
        Slurm node name; exits 0 on SIGTERM.
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

from launch.slurm import CHECKPOINT_SUBDIR, EXIT_CHECKPOINTED
from megapo.config import apply_override


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

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = out / CHECKPOINT_SUBDIR / "latest.json"
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
    }
    # where every rank runs, and which engines the learner can reach (disaggregated launch)
    nodes = [None] * world
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    record["rank_nodes"] = nodes
    if rank == 0:
        record["servers"] = [_health(server) for server in cfg.get("rollout", {}).get("servers", [])]

    step = start
    while step < steps:
        time.sleep(step_s)  # "a training step"
        step += 1
        if rank == crash_rank and step == crash_step:
            print(f"rank {rank}: failing at step {step} as configured", flush=True)
            return 3  # the other ranks hang in the all-reduce until Slurm ends the step
        flag = torch.tensor([1.0 if stop["signal"] else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks stop at the same step
        if rank == 0:
            (out / "progress").write_text(str(step))
        if flag.item() > 0:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step}))
                os.replace(tmp, ckpt)  # a checkpoint is either complete or absent
                _append(out / "runs.jsonl", {**record, "end": step, "exit": EXIT_CHECKPOINTED})
            dist.barrier()
            dist.destroy_process_group()
            return EXIT_CHECKPOINTED
    if rank == 0:
        _append(out / "runs.jsonl", {**record, "end": step, "exit": 0})
    dist.barrier()
    dist.destroy_process_group()
    return 0


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
    args = ap.parse_intermixed_args(argv)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"node": node, "port": args.port}).encode()
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

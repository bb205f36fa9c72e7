"""The GPU kit's broadcast section: the weight-sync transport between two processes of their own (a learner's
sender, an embedded engine's receiver), and the two roles those processes run (python -m tools.gpu_check --role).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tools.gpu_kit.context import REPO, Context
from tools.gpu_kit.helpers import with_checks


def section_broadcast(ctx: Context) -> dict:
    """The broadcast weight-sync transport between two processes: a learner's sender and an embedded engine's
    receiver, NCCL on one GPU (gloo in the dry run); the engine's weights must equal the learner's."""
    from safetensors.torch import load_file

    from megapo.net import free_port

    ctx.release()  # the two processes need the GPU's memory, not this one's learner
    backend = "nccl" if ctx.device == "cuda" else "gloo"
    model_dir = ctx.tiny_model()
    folder = ctx.work / "broadcast"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    port = free_port()
    roles = {role: spawn_role(role, folder, model_dir, port, backend) for role in ("send", "recv")}
    deadline = time.time() + 150
    outcome = {role: wait_role(proc, folder / f"{role}.json", deadline) for role, proc in roles.items()}
    result = {"backend": backend, "processes": 2, "device": ctx.device, "sender": outcome["send"],
              "receiver": outcome["recv"]}
    errors = [o.get("error", "") for o in outcome.values() if not o.get("ok")]
    if errors:
        text = " | ".join(errors)
        if backend == "nccl" and ("Duplicate GPU" in text or "ncclInvalidUsage" in text):
            # NCCL refuses two ranks of one communicator on one device
            result.update(status="unavailable: NCCL refused two processes on one GPU", error=text[:3000],
                          summary=f"NCCL refused two processes on one GPU: {text[:100]}")
            return result
        result.update(status="error", error=text[:2000], summary=f"{backend}: {text[:120]}")
        return result
    sent, received = load_file(str(folder / "sent.safetensors")), load_file(str(folder / "received.safetensors"))
    unequal = [n for n in sent if n not in received or not bool((sent[n] == received[n]).all())]
    result.update(tensors=len(sent), unequal_count=len(unequal), unequal=unequal[:10],
                  summary=f"{backend} 2 processes: {len(sent) - len(unequal)}/{len(sent)} tensors equal, "
                          f"{outcome['send'].get('gb_per_s', 0):.3f} GB/s")
    return with_checks(result, {"all_tensors_equal": not unequal and len(sent) > 0})


def spawn_role(role: str, folder: Path, model_dir: Path, port: int, backend: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tools.gpu_check", "--role", role, "--work", str(folder), "--model", str(model_dir),
           "--port", str(port), "--backend", backend]
    env = dict(os.environ, NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))  # NCCL's reason for a refusal
    return subprocess.Popen(cmd, cwd=REPO, env=env)  # in the worker's process group: killed with it


def wait_role(proc: subprocess.Popen, result_file: Path, deadline: float) -> dict:
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"ok": False, "error": "timed out (killed)"}
    if result_file.is_file():
        return json.loads(result_file.read_text())
    return {"ok": False, "error": f"exited with code {code} before writing its result"}


def role_main(args) -> int:
    """One end of the broadcast section, in a process of its own; writes <work>/<role>.json."""
    out = Path(args.work) / f"{args.role}.json"
    try:
        result = (broadcast_send if args.role == "send" else broadcast_receive)(args)
        result["ok"] = True
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],  # NCCL's reason is on later lines
                  "traceback": traceback.format_exc()[-3000:]}
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["ok"] else 1


def sync_address(args):
    from megapo.weights.broadcast import GroupAddress

    return GroupAddress("127.0.0.1", args.port, workers=1, backend=args.backend, timeout_s=90)


def broadcast_send(args) -> dict:
    from safetensors.torch import save_file

    from megapo.config import ParallelConfig
    from megapo.learner.learner import Learner
    from megapo.weights import bucket_bytes, sync_learner
    from megapo.weights.broadcast import BroadcastSender, BroadcastTransport, join_group

    learner = Learner(args.model, ParallelConfig())
    group = join_group(sync_address(args), 0, rank=0)
    transport = BroadcastTransport(BroadcastSender(group, device=learner.device))
    stats = sync_learner(learner, [], transport, bucket_bytes(64, "bucket_mb"), 1)
    save_file({n: t.cpu().contiguous() for n, t in learner.hf_state_dict()}, str(Path(args.work) / "sent.safetensors"))
    return {**stats.to_dict(), "device": learner.device}


def broadcast_receive(args) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megapo.engines.embedded import EmbeddedEngine
    from megapo.weights.broadcast import BroadcastReceiver, join_group

    engine = EmbeddedEngine(args.model)
    for buffer in engine.weight_buffers().values():
        buffer.zero_()  # so that only what arrives can match the sender
    device = "cuda" if args.backend == "nccl" else "cpu"
    receiver = BroadcastReceiver([join_group(sync_address(args), 0, rank=1)], device=device)
    engine.pause()
    version, moved = receiver.receive(engine.update_weights, engine.weight_buffers())
    engine.resume()
    receiver.finish(version)
    with safe_open(str(Path(args.model) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    views = engine.weight_buffers()
    save_file({n: views[n].clone().contiguous() for n in names}, str(Path(args.work) / "received.safetensors"))
    return {"version": version, "bytes": moved.bytes, "tensors": moved.tensors, "device": device}

"""The GPU kit's worker process (python -m tools.gpu_check --worker): runs its sections one after the other,
each isolated from the next by its own try, and appends a start and an end event per section to the progress
file the orchestrator watches; faults can be injected for the tests of that isolation.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from tools.gpu_kit.context import Context, Skip
from tools.gpu_kit.helpers import first_line
from tools.gpu_kit.registry import BY_NAME, Section


FAULTS_ENV = "MEGAPO_GPU_CHECK_FAULTS"  # "section=raise|hang|exit,...": tests of the isolation between sections


def injected_fault(name: str) -> None:
    faults = dict(item.split("=", 1) for item in os.environ.get(FAULTS_ENV, "").split(",") if "=" in item)
    kind = faults.get(name)
    if kind == "raise":
        raise RuntimeError(f"fault injected into {name} ({FAULTS_ENV})")
    if kind == "hang":
        time.sleep(1e6)
    if kind == "exit":
        os._exit(3)


def run_section(section: Section, ctx: Context) -> dict:
    start = time.perf_counter()
    try:
        injected_fault(section.name)
        result = section.run(ctx)
    except Skip as skip:
        result = {"status": str(skip)}
    except Exception as exc:
        result = {"status": "error", "error": first_line(exc, 2000), "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - start
    result.setdefault("summary", result.get("error", ""))
    return result


def append_event(progress: Path, event: dict) -> None:
    with progress.open("a") as f:
        f.write(json.dumps(event, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def worker_main(args) -> int:
    import torch

    torch.manual_seed(0)
    ctx = Context(Path(args.work), args.cpu_dry_run, args.peak_tflops)
    progress = Path(args.progress)
    for name in args.sections:
        append_event(progress, {"event": "start", "section": name, "time": time.time()})
        result = run_section(BY_NAME[name], ctx)
        append_event(progress, {"event": "end", "section": name, "result": result})
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']:.1f} s) {result.get('summary', '')}",
              flush=True)
    ctx.release()
    return 0

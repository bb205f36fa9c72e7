"""Running a tests/distributed script on a spec in one process or a torchrun launch, for the layout tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from megapo.launch.local import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


def run_layout_script(script: Path, spec: dict, world: int, tmp: Path, timeout_s: int = 600):
    """`script --spec S --out O` with `spec` written to tmp/spec{world}.json: a plain process for world 1, a torchrun
    launch of `world` processes otherwise; asserts it exited 0 and returns what it saved to tmp/out{world}.pt."""
    spec_path, out = tmp / f"spec{world}.json", tmp / f"out{world}.pt"
    spec_path.write_text(json.dumps(spec))
    args = [str(script), "--spec", str(spec_path), "--out", str(out)]
    if world == 1:
        rc = subprocess.run([sys.executable, *args], cwd=ROOT, timeout=timeout_s).returncode
    else:
        rc = run_torchrun(args, world, timeout_s=timeout_s)
    assert rc == 0, f"world {world}: exit code {rc}"
    return torch.load(out, weights_only=False)

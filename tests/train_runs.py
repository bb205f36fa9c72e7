"""`megapo train` of the main job's config on a tiny model, in a subprocess, for the tests that read its metrics.

    rows = train_rows(tmp_path, "run_name", f"model.path={tiny_moe}", "train.steps=2", ...)

Common settings: no SFT warm start, no evaluation or checkpoint, metrics.jsonl only, no dynamic sampling, and a
reward about half the samples earn even on a random model (the parity of the response's characters, a user reward
module written into tmp_path), so advantages are non-zero; the caller's overrides come after them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "megapo/configs/tiny_moe_addition.yaml"
PARITY = "def parity(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"


def train_rows(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    """Each step's metrics row of the run (folder tmp_path / name); the run must exit 0."""
    (tmp_path / "train_runs_parity.py").write_text(PARITY)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "megapo.cli", "train", str(CONFIG), "sft.enabled=false", f"train.output_dir={out}",
           "train.eval_every=0", "train.ckpt_every=0", "train.log=[jsonl]", "data.dynamic_sampling=false",
           "data.reward=train_runs_parity:parity", "data.truncated_reward=null", *overrides]
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

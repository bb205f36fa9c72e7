"""`megapo bench NAME ...` forwards every argument after NAME, options included, to the modules it does not own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_passthrough_reaches_the_module_parser():
    done = subprocess.run([sys.executable, "-m", "megapo.cli", "bench", "rollout", "--engine", "nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    # the error comes from tools/bench/rollout.py's own parser, so the option was forwarded untouched
    assert done.returncode == 2
    assert "argument --engine: invalid choice: 'nope'" in done.stderr


def test_unknown_benchmark_is_refused():
    done = subprocess.run([sys.executable, "-m", "megapo.cli", "bench", "nope"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr


def test_learner_passes_is_registered():
    done = subprocess.run([sys.executable, "-m", "megapo.cli", "bench", "learner-passes", "--rounds", "0", "--out",
                           "unused.json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    # tools/bench/learner_passes.py's own refusal: the name reached that module with its options
    assert done.returncode == 2
    assert "megapo bench learner-passes: error: --rounds and --steps must be >= 1" in done.stderr
    assert not (REPO / "unused.json").exists()

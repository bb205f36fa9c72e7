"""`megapo objectives` lists every registry entry with its kind, granularity and paper."""

from __future__ import annotations

import subprocess
import sys

from megapo.algorithms import entries
from megapo.cli import main


def _rows(text):
    return {tuple(line.split()[:3]) for line in text.splitlines()[1:] if line and not line.startswith(" ")}


def test_objectives_lists_every_entry(capsys):
    assert main(["objectives"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    all_entries = entries()
    assert len(all_entries) >= 30
    for e in all_entries:
        assert (e.name, e.kind, e.granularity) in rows, e.name
        assert e.paper in out
        assert e.formula, f"{e.name} has no formula docstring"
    kinds = {e.kind for e in all_entries}
    assert kinds == {"objective", "advantage", "advantage_stage", "token_weight", "correction", "aggregation", "kl",
                     "length_reward", "group_filter"}
    names = {e.name for e in entries("objective")}
    assert {"ppo", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "vespo", "ctpo", "minirl", "reinforce"} <= names
    # each objective's default aggregation (used when the config leaves loss_agg "auto") is on its row
    shown = {line.split()[0]: line.split()[3] for line in out.splitlines()[1:] if line and not line.startswith(" ")}
    assert shown["gspo"] == shown["sapo"] == "loss_agg=seq-mean-token-mean"
    assert shown["ppo"] == "loss_agg=token-mean" and shown["vespo"] == "loss_agg=seq-mean-token-sum"
    assert shown["grpo"] == "n_samples>=2"


def test_objectives_console_script_with_formulas():
    """Through the real entry point, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-m", "megapo.cli", "objectives", "--kind", "objective", "--formulas"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    for e in entries("objective"):
        assert e.name in out
        assert e.formula.splitlines()[0].strip() in out
    assert {kind for _, kind, _ in _rows(out)} == {"objective"}

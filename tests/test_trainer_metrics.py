"""Metrics JSONL, progress line, timer, missing-backend warning, and the plot command."""

import json
import time

import pytest
import torch

from megapo.trainer import metrics
from megapo.trainer.plot import plot_run, series


def test_jsonl_rows_and_progress(tmp_path, caplog):
    lines = []
    with caplog.at_level("WARNING"):
        log = metrics.MetricsLogger(tmp_path, ["jsonl", "tensorboard", "wandb"], total_steps=3, print_fn=lines.append)
    import importlib.util

    tb = importlib.util.find_spec("tensorboard") is not None
    assert ("tensorboard" in log.active) == tb
    assert tb or any("tensorboard requested but not installed" in r.message for r in caplog.records)
    timer = metrics.StepTimer()
    with timer("generate"):
        time.sleep(0.01)
    with timer("train"):
        pass
    t = timer.pop()
    assert t["time/generate"] >= 0.01 and t["time/step"] == pytest.approx(t["time/generate"] + t["time/train"])
    log.log(1, {"reward": torch.tensor(0.25), "kl": 0.001, **t}, tokens=1000)
    log.log(2, {"reward": 0.5, "eval/accuracy": 0.3, "time/step": 2.0}, tokens=1000)
    log.close()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward"] == 0.25 and rows[1]["tokens_per_s"] == 500.0
    assert rows[0]["tokens_per_s"] == pytest.approx(1000 / t["time/step"])
    assert lines[1].startswith("step 2/3 | reward 0.5") and "500 tok/s" in lines[1] and "eval acc 0.3" in lines[1]
    assert "generate" in lines[0] and "kl 0.001" in lines[0]


def test_plot_writes_png(tmp_path):
    rows = [{"step": s, "reward": s / 10, "response_len": 5, "kl": 0.0} for s in range(1, 11)]
    rows += [{"step": 5, "eval/accuracy": 0.3}, {"step": 10, "eval/accuracy": 0.6}]
    rows += [{"step": 10, "reward": 2.0}]  # resumed run wrote step 10 again: the last value wins
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert series(rows, "reward") == (list(range(1, 11)), [s / 10 for s in range(1, 10)] + [2.0])
    out = tmp_path / "curves.png"
    counts = plot_run(tmp_path, out)
    assert counts == {"reward": 10, "response_len": 10, "kl": 10, "eval/accuracy": 2}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from megapo.cli import main

    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "c2.png")]) == 0
    assert (tmp_path / "c2.png").stat().st_size > 1000

"""`megapo launch local`: torchrun on this machine. SIGTERM to the launcher reaches the trainer
(tests/slurm_standin.py keeps the trainer's contract), which checkpoints; `--resume` continues."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megapo.trainer.stop import EXIT_CHECKPOINTED

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "slurm_standin.py"


def test_local_launch_checkpoints_on_sigterm_and_resumes(tmp_path, tiny_moe):
    out_dir = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_moe)},
        "train": {"output_dir": str(out_dir), "steps": 1000, "step_seconds": 0.05},
    }))
    base = [sys.executable, "-m", "megapo.cli", "launch", "local", str(config), "--nproc", "2",
            "--entry-script", str(STANDIN)]
    proc = subprocess.Popen(base, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (out_dir / "progress").exists() or int((out_dir / "progress").read_text() or 0) < 2:
            assert proc.poll() is None, "the launcher ended before the run made progress"
            assert time.monotonic() < deadline, "no progress within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0  # torchrun reports a stop by signal as a failure; the checkpoint says the rest
    [first] = [json.loads(line) for line in (out_dir / "runs.jsonl").read_text().splitlines()]
    assert first["exit"] == EXIT_CHECKPOINTED and first["world_size"] == 2 and first["end"] >= 2
    assert json.loads((out_dir / "checkpoints" / "latest.json").read_text()) == {"step": first["end"]}

    steps = first["end"] + 3
    done = subprocess.run([*base, "--resume", f"train.steps={steps}"], cwd=REPO, timeout=180)
    assert done.returncode == 0
    records = [json.loads(line) for line in (out_dir / "runs.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert (records[1]["resume_flag"], records[1]["start"], records[1]["end"], records[1]["exit"]) == (
        True, first["end"], steps, 0)


def test_resume_and_overwrite_reach_megapo_train(tmp_path, tiny_moe, capsys):
    """--resume / --overwrite go to `megapo train` right after its name (the dry run prints the torchrun command);
    both at once are refused by the launcher's parser (exit 2) before anything starts."""
    import shlex

    import pytest

    from megapo.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tiny_moe)}, "train": {"output_dir": str(tmp_path / "o")}}))
    base = ["launch", "local", str(config), "--nproc", "1", "--dry-run", "--entry-script", str(STANDIN)]
    for flags in (["--resume"], ["--overwrite"], []):
        assert main([*base, *flags]) == 0
        cmd = shlex.split(capsys.readouterr().out)
        train = cmd.index("train")
        assert cmd[train + 1:train + 2 + len(flags)] == [*flags, str(config)], cmd
    with pytest.raises(SystemExit) as stop:
        main([*base, "--resume", "--overwrite"])
    assert stop.value.code == 2 and "not allowed with argument --resume" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

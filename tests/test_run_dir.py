"""Run-folder rules of `megapo train` (megapo.trainer.run_dir): a used train.output_dir needs --resume or
--overwrite, a resume is refused when it cannot continue the run in the folder, and nothing is written before
every check passed.

The run folders here are made by hand (a checkpoint is a `step_NNNNNNNN/` folder with trainer_state.json,
checkpoint.py's completeness mark), so each expectation -- the exit code, the field named, the files left --
is written out in the test, independent of the code under test. `megapo train` is run in-process: every
refusal comes before a model, learner or engine is built.
"""

import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest

from megapo.cli import main
from megapo.config import load_config
from megapo.trainer import run_dir
from megapo.trainer.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "megapo/configs/tiny_moe_addition.yaml"


def _overrides(out, model, *extra):
    return [f"train.output_dir={out}", f"model.path={model}", "sft.enabled=false", "train.steps=5", *extra]


def _cfg(out, model, *extra) -> RunConfig:
    return load_config(RunConfig, CONFIG, _overrides(out, model, *extra))


def _checkpoint(out: Path, step: int) -> Path:
    d = out / "checkpoints" / f"step_{step:08d}"
    (d / "learner").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"step": step, "data_cursor": {}, "weight_version": step}))
    return d


def _metrics(out: Path, steps) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in steps))


def _used_run(out: Path, model, step: int = 4, **config_edits) -> None:
    """A run folder as a run stopped at `step` leaves it: checkpoint, metrics up to that step, its config.json."""
    _checkpoint(out, step)
    _metrics(out, range(0, step + 1))
    saved = asdict(_cfg(out, model))
    for dotted, value in config_edits.items():
        section, name = dotted.split("__")
        saved[section][name] = value
    (out / "config.json").write_text(json.dumps(saved))


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _train(capsys, out, model, *extra, flags=()):
    rc = main(["train", *flags, str(CONFIG), *_overrides(out, model, *extra)])
    return rc, capsys.readouterr().err


# ----------------------------------------------------------------------------- refusals through `megapo train`


def test_used_folder_without_a_flag_is_refused_and_left_as_is(tmp_path, tiny_moe, capsys):
    out = tmp_path / "run"
    _used_run(out, tiny_moe)
    before = _snapshot(out)
    rc, err = _train(capsys, out, tiny_moe)
    assert rc == 2
    assert "megapo train: train.output_dir:" in err and "--resume" in err and "--overwrite" in err
    assert "step_00000004" in err and "metrics.jsonl up to step 4" in err
    assert _snapshot(out) == before  # nothing written, nothing removed


def test_metrics_alone_mark_a_used_folder(tmp_path, tiny_moe, capsys):
    out = tmp_path / "run"
    _metrics(out, [0, 1, 2])  # a run that logged steps and crashed before its first checkpoint
    rc, err = _train(capsys, out, tiny_moe)
    assert rc == 2 and "train.output_dir" in err and "up to step 2" in err


def test_resume_below_the_checkpoint_step_names_train_steps(tmp_path, tiny_moe, capsys):
    out = tmp_path / "run"
    _used_run(out, tiny_moe, step=4)
    before = _snapshot(out)
    rc, err = _train(capsys, out, tiny_moe, "train.steps=2", flags=["--resume"])
    assert rc == 2
    assert "megapo train: train.steps: 2 is below step 4" in err
    assert _snapshot(out) == before


@pytest.mark.parametrize("edit, field_name", [
    ({"model__path": "/elsewhere/another-model"}, "model.path"),
    ({"sft__enabled": True}, "sft.enabled"),
    ({"parallel__ep": 2}, "parallel.ep"),
])
def test_resume_with_another_model_is_refused_naming_the_difference(tmp_path, tiny_moe, capsys, edit, field_name):
    """The saved config.json says what the checkpoints were made with; the record is left untouched."""
    out = tmp_path / "run"
    _used_run(out, tiny_moe, **edit)
    before = _snapshot(out)
    rc, err = _train(capsys, out, tiny_moe, flags=["--resume"])
    assert rc == 2
    assert f"megapo train: {field_name}: --resume: the checkpoints in {out} were made with {field_name}=" in err
    assert _snapshot(out) == before  # config.json still names the run's own model


def test_resume_with_steps_logged_but_no_checkpoint_is_refused(tmp_path, tiny_moe, capsys):
    out = tmp_path / "run"
    _metrics(out, [0, 1, 2, 3])
    (out / "checkpoints" / "step_00000004.tmp").mkdir(parents=True)  # a save cut short is not a checkpoint
    rc, err = _train(capsys, out, tiny_moe, flags=["--resume"])
    assert rc == 2 and "megapo train: --resume:" in err and "steps up to 3" in err and "--overwrite" in err


def test_resume_and_overwrite_together_are_refused(tmp_path, tiny_moe, capsys):
    rc, err = _train(capsys, tmp_path / "run", tiny_moe, flags=["--resume", "--overwrite"])
    assert rc == 2 and "megapo train: --overwrite: contradicts --resume" in err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- what a start plans (reads only)


def test_resume_plans_the_newest_checkpoint(tmp_path, tiny_moe):
    out = tmp_path / "run"
    _used_run(out, tiny_moe, step=4)
    _checkpoint(out, 2)
    (out / "checkpoints" / "step_00000006.tmp").mkdir()
    start = run_dir.plan_start(_cfg(out, tiny_moe), resume=True)
    assert start.checkpoint == out / "checkpoints" / "step_00000004" and start.step == 4
    assert start.remove == ()


def test_resume_into_a_fresh_folder_starts_at_zero_with_a_warning(tmp_path, tiny_moe, caplog):
    """The Slurm templates pass --resume on every requeue; a job stopped before its first save must start."""
    out = tmp_path / "run"
    _metrics(out, [0])  # only the held-out eval before step 1
    with caplog.at_level(logging.WARNING):
        start = run_dir.plan_start(_cfg(out, tiny_moe), resume=True)
    assert start.checkpoint is None and start.step == 0
    assert any("no checkpoint" in r.message for r in caplog.records)
    run_dir.started(start, _cfg(out, tiny_moe))
    assert (out / "metrics.jsonl").read_text() == ""  # the fresh start logs step 0 again: no duplicate row


def test_resume_drops_metrics_rows_after_the_checkpoint(tmp_path, tiny_moe):
    out = tmp_path / "run"
    _used_run(out, tiny_moe, step=2)
    _metrics(out, [0, 1, 2, 3])  # step 3 was logged, then the run died before its next checkpoint
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "rew')  # and its last line was cut off
    cfg = _cfg(out, tiny_moe)
    run_dir.started(run_dir.plan_start(cfg, resume=True), cfg)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def test_overwrite_removes_the_previous_run_but_not_models_logs_or_other_files(tmp_path):
    out = tmp_path / "run"
    model = out / "base"  # model.path inside the run folder, as in the shipped config
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    _checkpoint(out, 4)
    _metrics(out, [0, 1])
    for name in ("tensorboard", "weights_sync", "logs", "sft"):
        (out / name).mkdir()
        (out / name / "f").write_text("x")
    (out / "notes.txt").write_text("mine")
    cfg = load_config(RunConfig, CONFIG, [f"train.output_dir={out}", f"model.path={tmp_path}/new-model"])
    cfg.model.path = str(model)
    saved = asdict(cfg)
    saved["sft"]["lr"] = 1.0  # the warm start in sft/ was made with another learning rate
    (out / "config.json").write_text(json.dumps(saved))
    run_dir.begin(run_dir.plan_start(cfg, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == ["base", "logs", "notes.txt"]
    assert (model / "config.json").is_file() and (out / "logs" / "f").is_file()


def test_overwrite_keeps_a_warm_start_made_from_the_same_inputs(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(RunConfig, CONFIG, [f"train.output_dir={out}", f"model.path={tmp_path}/new-model"])
    _checkpoint(out, 4)
    (out / "sft").mkdir()
    (out / "sft" / "sft_result.json").write_text("{}")
    saved = asdict(cfg)
    saved["optim"]["lr"] = 0.5  # RL settings differ; the warm start's inputs do not
    (out / "config.json").write_text(json.dumps(saved))
    run_dir.begin(run_dir.plan_start(cfg, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == ["sft"]


def test_a_fresh_folder_needs_no_flag(tmp_path, tiny_moe):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)  # the Slurm templates write their logs before the trainer starts
    (out / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)  # a first save cut short
    start = run_dir.plan_start(_cfg(out, tiny_moe))
    assert start.checkpoint is None and start.step == 0 and start.remove == ()

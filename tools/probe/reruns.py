"""Probe cases of the class 'wrong: reruns mixing runs': a used output folder, failed or bad resumes that must
write nothing, --resume with --overwrite, and --overwrite starting over.
"""

from __future__ import annotations

from tools.probe.inputs import _metrics_rows
from tools.probe.outcomes import RUN_TIMEOUT_S, classify, snapshot
from tools.probe.registry import case, refused


RERUN = "wrong: reruns mixing runs"


@case(RERUN)
def used_output_dir_without_flag(ctx):
    folder, config = ctx.copy_run("used_dir_no_flag")
    before = snapshot(folder / "run")
    out = ctx.train(config)
    return refused(ctx, out, "train.output_dir", "--resume", "--overwrite", watch=folder / "run", before=before)


@case(RERUN)
def failed_resume_keeps_config_json(ctx):
    """--resume with another model.path: refused naming model.path and both values; config.json not rewritten."""
    folder, config = ctx.copy_run("resume_other_model_path")
    before = snapshot(folder / "run")
    out = ctx.train(config, f"model.path={ctx.other_model}", "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "model.path", str(ctx.other_model), watch=folder / "run", before=before)


@case(RERUN)
def bad_config_on_resume_writes_nothing(ctx):
    folder, config = ctx.copy_run("resume_bad_config")
    before = snapshot(folder / "run")
    out = ctx.train(config, "optim.adam_beta1=2", "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "optim.adam_beta1", watch=folder / "run", before=before)


@case(RERUN)
def resume_and_overwrite_together(ctx):
    folder, config = ctx.copy_run("resume_and_overwrite")
    before = snapshot(folder / "run")
    out = ctx.train(config, flags=("--resume", "--overwrite"))
    return refused(ctx, out, "--overwrite", watch=folder / "run", before=before)


@case(RERUN, cheap=False)
def overwrite_starts_over(ctx):
    """--overwrite train.steps=1 in a used folder: the old run's checkpoints and metrics are gone, one fresh run."""
    folder, config = ctx.copy_run("overwrite")
    (folder / "run" / "notes.txt").write_text("mine")
    out = ctx.train(config, "train.steps=1", flags=("--overwrite",), timeout=RUN_TIMEOUT_S)
    steps = [r.get("step") for r in _metrics_rows(folder / "run")]
    ckpts = sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())
    if out.rc != 0:
        return out, classify(out, rc=0)
    if ckpts != ["step_00000001"] or sorted(s for s in steps if s) != [1]:
        return out, ("wrong", f"old state kept: checkpoints {ckpts}, metrics steps {steps}")
    if not (folder / "run" / "notes.txt").is_file():
        return out, ("wrong", "--overwrite removed a file that is not the run's (notes.txt)")
    return out, ("good", "exit 0; only the new run's step 1 checkpoint and metrics; other files kept")

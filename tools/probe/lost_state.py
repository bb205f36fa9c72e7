"""Probe cases of the class 'wrong: lost state': resumes from checkpoints missing their RNG state, from no
checkpoint, or with train.steps at or below the checkpoint's step.
"""

from __future__ import annotations

import shutil

from tools.probe.inputs import _metrics_rows
from tools.probe.outcomes import RUN_TIMEOUT_S, changed, classify, snapshot
from tools.probe.registry import case, refused


LOST = "wrong: lost state"


@case(LOST, cheap=False)
def checkpoint_missing_rng_state(ctx):
    folder, config = ctx.copy_run("missing_rng_state")
    step = folder / "run" / "checkpoints" / "step_00000002"
    (step / "rng.safetensors").unlink()
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "rng.safetensors", "is missing", watch=folder / "run", before=before)


@case(LOST)
def resume_without_checkpoint_but_steps_logged(ctx):
    folder, config = ctx.copy_run("resume_no_ckpt_steps_logged")
    shutil.rmtree(folder / "run" / "checkpoints")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=3", flags=("--resume",))
    return refused(ctx, out, "--resume", "metrics.jsonl", watch=folder / "run", before=before)


@case(LOST, cheap=False)
def resume_without_anything_starts_with_a_warning(ctx):
    """--resume in an empty folder (a Slurm requeue of a job stopped before its first save): step 0, with a
    warning that says no checkpoint was found."""
    folder = ctx.fresh("resume_empty")
    out = ctx.train(ctx.config(folder), "train.steps=1", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    steps = [r.get("step") for r in _metrics_rows(folder / "run")]
    if out.rc != 0:
        return out, classify(out, rc=0)
    if "no checkpoint" not in out.text:
        return out, ("wrong", "started from step 0 without a word")
    if 1 not in steps:
        return out, ("wrong", f"exit 0 but no step logged: {steps}")
    return out, ("good", "exit 0 from step 0, warning 'no checkpoint ... starting at step 0'")


@case(LOST)
def resume_with_steps_below_the_checkpoint(ctx):
    folder, config = ctx.copy_run("resume_steps_below")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=1", flags=("--resume",))
    return refused(ctx, out, "train.steps", "step 2", watch=folder / "run", before=before)


@case(LOST)
def resume_with_steps_equal_to_the_checkpoint(ctx):
    """Nothing to do: exit 0, nothing written (documented in docs/CONTRACTS.md)."""
    folder, config = ctx.copy_run("resume_steps_equal")
    before = snapshot(folder / "run")
    out = ctx.train(config, "train.steps=2", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    wrong = changed(before, snapshot(folder / "run"))
    if out.rc != 0:
        return out, classify(out, rc=0)
    return out, ("wrong", wrong) if wrong else ("good", "exit 0, nothing to do, folder unchanged")

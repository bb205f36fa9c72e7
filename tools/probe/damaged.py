"""Probe cases of the class 'poor: damaged checkpoints': missing or truncated shards, metadata and state
files, and a checkpoint of another model, refused on resume with the culprit named.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.probe.outcomes import RUN_TIMEOUT_S, snapshot
from tools.probe.registry import case, refused


DAMAGED = "poor: damaged checkpoints"


def _biggest_shard(step: Path) -> Path:
    return max((step / "learner").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _damage_case(name: str, damage, *names):
    """A copy of the base run whose newest checkpoint is damaged: `--resume` refuses (exit 2) naming the file and
    the newest earlier checkpoint that verifies (step 1), writes nothing."""
    def probe(ctx):
        folder, config = ctx.copy_run(name)
        step = folder / "run" / "checkpoints" / "step_00000002"
        hit = damage(step)
        before = snapshot(folder / "run")
        out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
        return refused(ctx, out, hit, *names, "step_00000001", watch=folder / "run", before=before)
    probe.__name__ = name
    case(DAMAGED, cheap=False)(probe)


def _unlink_shard(step):
    shard = _biggest_shard(step)
    shard.unlink()
    return f"learner/{shard.name}"


def _cut_shard(step):
    shard = _biggest_shard(step)
    _cut(shard)
    return f"learner/{shard.name}"


def _unlink(name):
    def damage(step):
        (step / name).unlink()
        return name
    return damage


def _cut_file(name):
    def damage(step):
        _cut(step / name)
        return name
    return damage


_damage_case("checkpoint_missing_shard", _unlink_shard, "is missing")


_damage_case("checkpoint_missing_metadata", _unlink("learner/.metadata"), "is missing")


_damage_case("checkpoint_truncated_shard", _cut_shard, "truncated")


_damage_case("checkpoint_truncated_trainer_state", _cut_file("trainer_state.json"), "truncated")


_damage_case("checkpoint_truncated_rng_state", _cut_file("rng.safetensors"), "truncated")


@case(DAMAGED, cheap=False)
def checkpoint_of_another_model(ctx):
    """The run folder's checkpoints come from the 2-layer model, its config.json (copied along) and this run name
    the 3-layer one: --resume refuses naming 'another model' before loading."""
    folder, config = ctx.copy_run("another_model")
    saved = folder / "run" / "config.json"
    data = json.loads(saved.read_text())
    data["model"]["path"] = str(ctx.other_model)
    saved.write_text(json.dumps(data))
    before = snapshot(folder / "run")
    out = ctx.train(config, f"model.path={ctx.other_model}", "train.steps=3", flags=("--resume",),
                    timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "another model", watch=folder / "run", before=before)

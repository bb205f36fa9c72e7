"""Probe cases of the class 'wrong: code execution from a checkpoint': pickled payloads in a checkpoint's
RNG state or torch_dist metadata, on resume and on convert, never run.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from tools.probe.outcomes import RUN_TIMEOUT_S
from tools.probe.registry import case, refused


PICKLE = "wrong: code execution from a checkpoint"


class Payload:
    """A pickle that writes a marker file when loaded (what a hostile checkpoint file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


@case(PICKLE, cheap=False)
def hostile_rng_pt_on_resume(ctx):
    """A pre-manifest checkpoint (trainer_state.json + rng.pt) whose rng.pt runs a payload when unpickled."""
    folder, config = ctx.copy_run("hostile_rng_pt")
    newest = folder / "run" / "checkpoints" / "step_00000002"
    (newest / "manifest.json").unlink()
    (newest / "rng.safetensors").unlink()
    marker = folder / "payload_ran"
    (newest / "rng.pt").write_bytes(pickle.dumps(Payload(marker)))
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "rng.pt", str(newest), forbid=(marker, folder / "run" / "checkpoints" / "step_00000003"))


def _rewrite_manifest_entry(step: Path, name: str) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


def _hostile_metadata(ctx, name):
    folder, config = ctx.copy_run(name)
    step = folder / "run" / "checkpoints" / "step_00000002"
    marker = folder / "payload_ran"
    (step / "learner" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest_entry(step, "learner/.metadata")  # the attacker makes the manifest agree
    return folder, config, step, marker


@case(PICKLE, cheap=False)
def hostile_torch_dist_metadata_on_resume(ctx):
    folder, config, step, marker = _hostile_metadata(ctx, "hostile_metadata_resume")
    out = ctx.train(config, "train.steps=3", flags=("--resume",), timeout=RUN_TIMEOUT_S)
    return refused(ctx, out, "learner/.metadata", forbid=(marker,))


@case(PICKLE)
def hostile_torch_dist_metadata_on_convert(ctx):
    folder, config, step, marker = _hostile_metadata(ctx, "hostile_metadata_convert")
    out = ctx.megapo("convert", "megatron-to-hf", "--ckpt", step, "--model", ctx.model, "--out", folder / "hf")
    return refused(ctx, out, ".metadata", forbid=(marker, folder / "hf"))

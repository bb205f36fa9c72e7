"""Trainer checkpoints: the learner's Megatron checkpoint plus the trainer's own state, made atomic.

    ckpt_root/step_00000100/
        learner/               written by learner.save(dir) (all ranks, collectively)
        trainer_state.json     step, data cursor, engine weight version, anything else the loop adds
        rng.pt                 rank 0's python / numpy / torch RNG states, plus `rng_extra` (the
                               rollout engine's sampling generator)
        rng_rank<r>.pt         the same per other rank (each rank restores its own)

Everything is written into `step_00000100.tmp/` first; `trainer_state.json` is written last, then
the folder is renamed into place. So a folder named `step_*` without `.tmp` is complete, and a crash
mid-save leaves only a `.tmp` folder that `latest_checkpoint` ignores (and the next save removes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
RNG_FILE = "rng.pt"
_NAME = re.compile(r"^step_(\d{8})$")


@dataclass
class TrainerState:
    step: int
    data_cursor: dict[str, Any]
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def rng_file(rank: int) -> str:
    return RNG_FILE if rank == 0 else f"rng_rank{rank}.pt"


def save_checkpoint(root: str | Path, state: TrainerState, save_learner: Callable[[Path], None] | None = None,
                    keep_last: int = 2, is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                    rank: int = 0, rng_extra: dict | None = None) -> Path:
    """Write checkpoint `state.step` under `root` atomically; keep the newest `keep_last`; return its folder.

    `save_learner(dir)` is called on every rank (Megatron saves collectively); only the main rank
    writes the trainer files, renames and prunes. `barrier` separates the phases across ranks.
    Each rank writes its own RNG states; `rng_extra` (tensors, e.g. the engine's generator) goes with them."""
    final = step_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash
        (tmp / "learner").mkdir(parents=True)  # dist_checkpointing needs the folder to exist
    barrier()
    if save_learner is not None:
        save_learner(tmp / "learner")
    torch.save({**rng_state(), "extra": rng_extra or {}}, tmp / rng_file(rank))
    barrier()
    if is_main:
        _write_json(tmp / STATE_FILE, asdict(state))  # last: marks the content complete
        if final.exists():  # the same step saved again (a rerun): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        prune(root, keep_last)
    barrier()
    return final


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; return what was deleted."""
    found = list_checkpoints(root)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def load_checkpoint(path: str | Path, load_learner: Callable[[Path], None] | None = None,
                    restore_rng: bool = True, rank: int = 0) -> TrainerState:
    """Read a checkpoint folder; load the learner through `load_learner(dir)` and restore this rank's
    RNG states (`rng_extra` reads what else was saved with them)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    if load_learner is not None:
        load_learner(path / "learner")
    if restore_rng and (path / rng_file(rank)).is_file():
        set_rng_state(torch.load(path / rng_file(rank), weights_only=False))
    return state


def rng_extra(path: str | Path, rank: int = 0) -> dict:
    """The `rng_extra` saved with this rank's RNG states ({} when none)."""
    f = Path(path) / rng_file(rank)
    return torch.load(f, weights_only=False).get("extra", {}) if f.is_file() else {}

"""Trainer checkpoints: the learner's Megatron checkpoint plus the trainer's own state, atomic and verified.

    ckpt_root/step_00000100/
        learner/                  written by learner.save(dir) (all ranks, collectively)
        rng.safetensors           rank 0's torch / numpy / python RNG states and `rng_extra` (the rollout
                                  engine's sampling generator): tensors, plus JSON in the header
        rng_rank<r>.safetensors   the same per other rank (each rank restores its own)
        trainer_state.json        step, data cursor, engine weight version, anything else the loop adds
        rollouts.json/.safetensors  async mode: the batches made ahead of the learner (megapo.trainer.rollout_store)
        manifest.json             written last: every other file with its size and sha256

Everything is written into `step_00000100.tmp/` first, then the folder is renamed into place, so a crash
mid-save leaves only a `.tmp` folder that `latest_checkpoint` ignores (and the next save removes).

Nothing in a checkpoint is unpickled: the RNG states are safetensors + JSON, and the one pickle Megatron
reads (learner/.metadata, torch_dist's metadata) is first read through megapo.integrity's allow-list.
Before loading, `load_checkpoint` verifies the folder against its manifest (every file present, of its
size and sha256), that its learner/ holds the model of `model_dir` (tensor names and shapes), and raises
CheckpointError (exit 2) naming what is wrong and the newest earlier checkpoint that verifies.
Checkpoints of megapo before the manifest (rng.pt, a pickle) are refused, never unpickled.

Hash: sha256 of whole files, read in 8 MiB chunks on a thread pool (hashlib releases the GIL). A sampled
hash would miss corruption inside a shard, and a non-cryptographic one saves little where sha256 runs on
the CPU's SHA instructions: with several files hashed at once the disk, not the hash, bounds the cost
(about one extra read of the checkpoint at save and at resume). On a distributed run every rank hashes
its share of the files (save and verify), so no rank waits in a collective for one rank reading all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from megapo.config import ConfigError
from megapo.dist import multi_process

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
RNG_FILE = "rng.safetensors"
OLD_RNG_FILE = "rng.pt"  # before the manifest: a pickle, never loaded
FORMAT = "megapo-trainer-checkpoint"
VERSION = 2
_NAME = re.compile(r"^step_(\d{8})$")
_PART = ".manifest.part"  # per-rank hashes while saving, merged into the manifest
_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed (damaged, of another model, of an old format): exit 2, no traceback."""

    def __init__(self, message: str):
        super().__init__("--resume", message)


@dataclass
class TrainerState:
    step: int
    data_cursor: dict[str, Any]
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step of a folder named as step_dir names it (step_00000012 -> 12), else None."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def rng_file(rank: int) -> str:
    return RNG_FILE if rank == 0 else f"rng_rank{rank}.safetensors"


# ----------------------------------------------------------------------------- RNG state without pickles


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON-able scalars) of the python / numpy / torch generators."""
    version, words, gauss_next = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
               "numpy": torch.from_numpy(key.astype(np.int64))}
    scalars = {"python": [version, gauss_next], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, scalars


def set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    version, gauss_next = scalars["python"]
    random.setstate((version, tuple(int(w) for w in tensors["python"].tolist()), gauss_next))
    kind, pos, has_gauss, cached = scalars["numpy"]
    np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])


def _save_rng(path: Path, extra: dict) -> None:
    from megapo.weights.safetensors_io import save_tensors

    tensors, scalars = rng_state()
    for name, value in extra.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"rng_extra[{name!r}]: expected a tensor, got {type(value).__name__}")
        tensors[f"extra.{name}"] = value.detach().cpu().contiguous()
    save_tensors(path, tensors, metadata={"scalars": json.dumps(scalars)})


def _load_rng(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from megapo.weights.safetensors_io import open_tensors

    with open_tensors(path) as handle:
        scalars = json.loads(handle.metadata()["scalars"])
        return {k: handle.get_tensor(k) for k in handle.keys()}, scalars


# ----------------------------------------------------------------------------- save


def save_checkpoint(root: str | Path, state: TrainerState, save_learner: Callable[[Path], None] | None = None,
                    keep_last: int = 2, is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                    rank: int = 0, rng_extra: dict | None = None,
                    write_files: Callable[[Path], None] | None = None) -> Path:
    """Write checkpoint `state.step` under `root` atomically; keep the newest `keep_last`; return its folder.

    `save_learner(dir)` is called on every rank (Megatron saves collectively; Learner.save refuses
    non-finite weights); only the main rank writes the trainer files, renames and prunes. `barrier`
    separates the phases across ranks. Each rank writes its own RNG states; `rng_extra` (tensors, e.g.
    the engine's generator) goes with them. `write_files(dir)` (main rank) adds the trainer's own files
    (they are in the manifest like the rest)."""
    final = step_dir(root, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash
        (tmp / "learner").mkdir(parents=True)  # dist_checkpointing needs the folder to exist
    barrier()
    if save_learner is not None:
        save_learner(tmp / "learner")
    _save_rng(tmp / rng_file(rank), rng_extra or {})
    if is_main and write_files is not None:
        write_files(tmp)
    barrier()
    if multi_process():  # each rank hashes its share; the main rank merges the parts into the manifest
        _write_json(tmp / f"{_PART}{torch.distributed.get_rank()}.json", _hash_files(tmp, _my_share(_files(tmp))))
    barrier()
    if is_main:
        _write_json(tmp / STATE_FILE, asdict(state))
        _write_json(tmp / MANIFEST, _manifest(tmp, state.step))  # last: marks the content complete
        if final.exists():  # the same step saved again (a rerun): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        prune(root, keep_last)
    barrier()
    return final


def _manifest(tmp: Path, step: int) -> dict:
    """The parts every rank hashed, plus what no part covers (the state file, a listing that lagged)."""
    files: dict[str, dict] = {}
    for part in sorted(tmp.glob(f"{_PART}*.json")):
        files.update(json.loads(part.read_text()))
        part.unlink()
    files.update(_hash_files(tmp, [f for f in _files(tmp) if f not in files]))
    ranks = torch.distributed.get_world_size() if multi_process() else 1
    return {"format": FORMAT, "version": VERSION, "step": step, "ranks": ranks, "hash": "sha256",
            "files": dict(sorted(files.items()))}


def _files(folder: Path) -> list[str]:
    """Relative paths of the files under `folder` (hidden ones too: torch_dist writes .metadata), sorted."""
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if not (name.startswith(_PART) or rel == MANIFEST):
                out.append(rel)
    return sorted(out)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _pooled(fn: Callable, items: list) -> list:
    """fn over items on a few threads (hashing and reading release the GIL)."""
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, items))


def _hash_files(folder: Path, names: list[str]) -> dict[str, dict]:
    def one(name: str) -> tuple[str, dict]:
        path = folder / name
        return name, {"bytes": path.stat().st_size, "sha256": _sha256(path)}

    return dict(_pooled(one, names))


def _my_share(names: list[str]) -> list[str]:
    """The files this rank hashes: every world-size-th one (all of them in a single process)."""
    if not multi_process():
        return names
    return names[torch.distributed.get_rank()::torch.distributed.get_world_size()]


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


# ----------------------------------------------------------------------------- find, prune


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under `root` (a manifest, or the state file of a pre-manifest checkpoint),
    oldest first. A listed folder may still be damaged: `load_checkpoint` verifies it."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = step_of(p)
        if step is not None and p.is_dir() and ((p / MANIFEST).is_file() or (p / STATE_FILE).is_file()):
            found.append((step, p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints; return what was deleted."""
    found = list_checkpoints(root)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        shutil.rmtree(p)
    return doomed


# ----------------------------------------------------------------------------- verify


def _role(name: str) -> str:
    """What a checkpoint file holds, for the messages."""
    base = os.path.basename(name)
    if name == STATE_FILE:
        return "the step and data cursor"
    if base.startswith("rng"):
        return "RNG state: without it the resumed run samples differently"
    if name.endswith(".distcp"):
        return "a weight / optimizer shard"
    if base in (".metadata", "metadata.json", "common.pt"):
        return "torch_dist metadata"
    return "checkpoint file"


def _check_file(folder: Path, name: str, want: dict) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing ({_role(name)})"
    size = path.stat().st_size
    if size != want["bytes"]:
        how = "truncated" if size < want["bytes"] else "grown"
        return f"{name} has {size} bytes, the manifest says {want['bytes']} ({how}; {_role(name)})"
    if _sha256(path) != want["sha256"]:
        return f"{name} differs from the manifest's sha256 (corrupted; {_role(name)})"
    return None


def _read_manifest(path: Path) -> tuple[dict | None, str | None]:
    if not (path / MANIFEST).is_file():
        if (path / STATE_FILE).is_file():
            pickled = (path / OLD_RNG_FILE).exists()
            old = f"; its {OLD_RNG_FILE} is a pickle, which megapo never loads" if pickled else ""
            return None, (f"it has no {MANIFEST}: it was written by a megapo before checkpoints were verified{old}. "
                          f"Resume it with the megapo that wrote it, or start over (--overwrite)")
        return None, f"it has no {MANIFEST} (an incomplete copy?)"
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not all({"bytes", "sha256"} <= set(v) for v in files.values()):
            raise ValueError("not a megapo trainer checkpoint manifest")
        if any(Path(n).is_absolute() or ".." in Path(n).parts for n in files):
            raise ValueError("it names files outside the checkpoint folder")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{MANIFEST} is unreadable ({exc}; truncated?)"
    if manifest.get("version") != VERSION:
        return None, f"{MANIFEST} has version {manifest.get('version')}, this megapo reads {VERSION}"
    return manifest, None


def _learner_problems(path: Path, model_dir: str | Path | None) -> list[str]:
    """Megatron's pickle through the allow-list, common.pt as weights only (the learner's and a critic's, when the
    run has one beside it), the learner's model against model_dir."""
    learner = path / "learner"
    if not (learner / "metadata.json").is_file():
        return []  # not a torch_dist learner (a stand-in's own format): its load checks itself
    from megapo.convert import inputs

    problems, stored = [], None
    for part in ("learner", "critic"):
        folder = path / part
        if part != "learner" and not (folder / "metadata.json").is_file():
            continue
        try:
            shapes = inputs.stored_model_shapes(folder)
            torch.load(folder / "common.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # UnsafePickle, a damaged file: nothing of the files' ran
            problems.append(f"{part}/: {exc}")
            continue
        stored = shapes if part == "learner" else stored
    if problems or model_dir is None:
        return problems
    from megapo.layout import read_hf_config
    from megapo.models.family import family_for

    hf = read_hf_config(model_dir)
    problem = inputs.model_mismatch(stored, family_for(hf).spec(hf), Path(model_dir))
    return [f"it holds another model than this run's: {problem}"] if problem else []


def verify_checkpoint(path: str | Path, model_dir: str | Path | None = None) -> list[str]:
    """What is wrong with checkpoint folder `path` ([] when it may be loaded): its manifest's files
    (present, size, sha256), its learner's torch_dist metadata (allow-listed pickle) and, given the
    run's `model_dir`, that it holds that model. Collective when distributed (every rank checks its
    share of the files; every rank returns the same list)."""
    path = Path(path)
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return [problem]
    files = manifest["files"]
    mine = [p for p in _pooled(lambda n: _check_file(path, n, files[n]), _my_share(sorted(files))) if p]
    problems = sorted(set(_gather(mine)))
    if STATE_FILE not in manifest["files"]:
        problems.append(f"the manifest does not list {STATE_FILE}")
    return problems or _learner_problems(path, model_dir)


def manifest_problems(path: str | Path, under: str = "") -> list[str]:
    """What is wrong with the files checkpoint folder `path`'s manifest lists under `under` (a sub-folder such as
    "learner/"; "" for all): missing, of another size or sha256, or the manifest itself. One process (`megapo
    convert` checks a trainer checkpoint's learner/ with it before reading it)."""
    path = Path(path)
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return [problem]
    files = {n: want for n, want in manifest["files"].items() if n.startswith(under)}
    if not files:
        return [f"the manifest lists no file under {under}"]
    return [p for p in _pooled(lambda n: _check_file(path, n, files[n]), sorted(files)) if p]


def _gather(items: list[str]) -> list[str]:
    """Every rank's items, on every rank."""
    if not multi_process():
        return items
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, items)
    return [x for part in everyone for x in part]


def _refusal(path: Path, problems: list[str], model_dir) -> CheckpointError:
    """The error for a checkpoint that cannot be resumed, naming the newest earlier one that verifies."""
    step = step_of(path)
    earlier = [p for p in reversed(list_checkpoints(path.parent)) if step is not None and step_of(p) < step]
    good = next((p for p in earlier if not verify_checkpoint(p, model_dir)), None)
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    if good is not None:
        offer = (f"The newest earlier checkpoint that verifies is {good}: move the damaged one aside "
                 f"(mv {path} {path}.damaged) and run again with --resume to continue from it.")
    else:
        offer = f"No earlier checkpoint under {path.parent} verifies; start over with --overwrite."
    return CheckpointError(f"cannot resume from {path}: {shown}. {offer}")


# ----------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path, load_learner: Callable[[Path], None] | None = None,
                    restore_rng: bool = True, rank: int = 0, model_dir: str | Path | None = None) -> TrainerState:
    """Verify checkpoint folder `path` (collective when distributed; CheckpointError naming what is wrong,
    and the checkpoint to fall back to), then load the learner through `load_learner(dir)` and restore
    this rank's RNG states (`rng_extra` reads what else was saved with them). `model_dir`: the run's
    model folder, to refuse a checkpoint of another model."""
    path = Path(path)
    problems = verify_checkpoint(path, model_dir)
    if problems:
        raise _refusal(path, problems, model_dir)
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    try:
        state = TrainerState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path / STATE_FILE} does not hold a trainer state ({exc})") from None
    if load_learner is not None:
        load_learner(path / "learner")
    if restore_rng:
        if rng_file(rank) in manifest["files"]:
            set_rng_state(*_load_rng(path / rng_file(rank)))  # the rng_extra tensors it also holds stay unread
        else:
            log.warning("rank %d: %s was saved by %d rank(s) and holds no RNG state for this rank; it keeps its "
                        "own seed", rank, path, manifest.get("ranks", 1))
    return state


def rng_extra(path: str | Path, rank: int = 0) -> dict:
    """The `rng_extra` tensors saved with this rank's RNG states ({} when none)."""
    f = Path(path) / rng_file(rank)
    if not f.is_file():
        return {}
    tensors, _ = _load_rng(f)
    return {k.removeprefix("extra."): v for k, v in tensors.items() if k.startswith("extra.")}

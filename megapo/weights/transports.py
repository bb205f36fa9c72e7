"""In-process transports: hand HF-named tensors to engines bucket by bucket.

- `TensorTransport`: `engine.update_weights(bucket, version)` for each bucket (colocated engines, e.g.
  the embedded engine). The bucket's tensors are often views of the learner's parameters; the engine
  copies them into its own before the next bucket is produced.
- `DiskTransport`: each bucket becomes one safetensors file in `<root>/v<version>/` (plus
  model.safetensors.index.json, and the model's config files when `config_dir` is given); then every
  engine reloads that folder with `update_weights_from_disk(path, version)`. The files are written into
  `<root>/staging/`, which is renamed to `v<version>` once complete (a folder named after a version is
  always whole). Once the new version is loaded, the oldest folder beyond `keep` becomes the next
  staging folder and the others are deleted: its files are overwritten in place by the next sync, which
  halves the cost of writing (the kernel reuses their cached pages) and takes the deletion of a model's
  worth of pages off the sync. The price: one more model copy on disk between syncs (during a sync
  there were two already). `recycle=False` deletes them instead.

A transport acts only where it is given engines: the other learner ranks still walk the stream
(it is collective) and drop it. See megapo/weights/sync.py for the entry point.
"""

from __future__ import annotations

import abc
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megapo.weights.buckets import iter_buckets, nbytes
from megapo.weights.safetensors_io import write_safetensors


@dataclass
class Moved:
    """What a transport moved (on this rank)."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    largest_bucket: int = 0  # bytes

    def add_bucket(self, n_bytes: int, n_tensors: int) -> None:
        self.bytes += n_bytes
        self.tensors += n_tensors
        self.buckets += 1
        self.largest_bucket = max(self.largest_bucket, n_bytes)


class Transport(abc.ABC):
    name: str = ""
    # True: the stream is this pipeline stage's tensors only (each stage root sends its own);
    # False: the full model on every rank.
    per_stage: bool = False

    @abc.abstractmethod
    def send(self, named: Iterable[tuple[str, torch.Tensor]], engines: Sequence, bucket_bytes: int, version: int,
             dtype: torch.dtype | None) -> Moved:
        """Move every tensor of `named` to `engines` and set their weight version."""


def drain(named: Iterable[tuple[str, torch.Tensor]]) -> Moved:
    """Walk the stream without sending (ranks that take part in the gather but own no engine):
    nothing moved from this rank."""
    for _ in named:
        pass
    return Moved()


class TensorTransport(Transport):
    name = "tensor"

    def send(self, named, engines, bucket_bytes, version, dtype) -> Moved:
        if not engines:
            return drain(named)
        moved = Moved()
        for bucket in iter_buckets(named, bucket_bytes, dtype):
            if dtype is not None:
                bucket = [(n, t.to(dtype)) for n, t in bucket]
            for engine in engines:
                engine.update_weights(bucket, version)
            moved.add_bucket(sum(nbytes(t) for _, t in bucket), len(bucket))
            del bucket  # else it stays alive while the next bucket fills: two buckets, not one
        return moved


INDEX = "model.safetensors.index.json"


class DiskTransport(Transport):
    name = "disk"
    STAGING = "staging"

    def __init__(self, root: str | Path, config_dir: str | Path | None = None, keep: int = 1, recycle: bool = True):
        if keep < 1:
            raise ValueError(f"keep: must be >= 1 (version folders kept on disk), got {keep}")
        self.root = Path(root)
        self.config_dir = Path(config_dir) if config_dir is not None else None
        if self.config_dir is not None and not (self.config_dir / "config.json").is_file():
            raise FileNotFoundError(f"config_dir: {self.config_dir} has no config.json")
        self.keep = keep
        self.recycle = recycle

    def folder(self, version: int) -> Path:
        return self.root / f"v{version}"

    def send(self, named, engines, bucket_bytes, version, dtype) -> Moved:
        if not engines:
            return drain(named)
        stage = self.root / self.STAGING  # a recycled version folder, or what an interrupted sync left
        stage.mkdir(parents=True, exist_ok=True)
        stale = {p.name for p in stage.iterdir()}
        moved, weight_map = Moved(), {}
        # no enumerate(): its cached result tuple would keep the previous bucket alive
        for bucket in iter_buckets(named, bucket_bytes, dtype):
            fname = f"model-{moved.buckets:05d}.safetensors"
            n = write_safetensors(stage / fname, bucket, dtype, metadata={"format": "pt"})
            weight_map.update({name: fname for name, _ in bucket})
            moved.add_bucket(n, len(bucket))
            stale.discard(fname)
            del bucket  # else it stays alive while the next bucket fills
        (stage / INDEX).write_text(json.dumps({"metadata": {"total_size": moved.bytes}, "weight_map": weight_map}))
        stale.discard(INDEX)
        if self.config_dir is not None:
            for f in self.config_dir.iterdir():
                if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX:
                    shutil.copy(f, stage / f.name)
                    stale.discard(f.name)
        for name in stale:  # an older version's extra shards or files
            _remove(stage / name)
        out = self.folder(version)
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        for engine in engines:
            engine.update_weights_from_disk(str(out), version)
        self._prune(version)
        return moved

    def _prune(self, version: int) -> None:
        """Drop version folders older than the newest `keep` (engines have loaded the new one): the newest
        of them becomes the next staging folder (recycle=True), the others are deleted."""
        folders = sorted((int(p.name[1:]), p) for p in self.root.glob("v*") if p.name[1:].isdigit())
        old = [p for v, p in folders[:-self.keep] if v != version]
        if old and self.recycle and not (self.root / self.STAGING).exists():
            os.replace(old.pop(), self.root / self.STAGING)
        for p in old:
            shutil.rmtree(p, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()

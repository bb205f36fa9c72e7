"""Weight sync, learner -> engines: one entry point for every transport.

    stats = sync_learner(learner, [engine], TensorTransport(), bucket_bytes(512), version=3)

Every learner rank calls it (the gather over TP/EP/PP is collective); pass the engines only on the
rank that owns them (others pass []). The learner's weights stream out as full HF-named tensors
(megapo.weights.gather), are grouped into buckets of at most `bucket_bytes`, and each transport moves
bucket after bucket, so the extra memory is about one bucket, not the model:

- tensor:    engine.update_weights(bucket, version) per bucket (colocated engines);
- disk:      one safetensors file per bucket, then engine.update_weights_from_disk(folder, version);
- broadcast: a process group per pipeline stage between its root rank and the engine workers
             (megapo.weights.broadcast); the workers apply the buckets to their engines.

The version must be larger than every engine's current one: it increments on every sync, and the
engines report it (`engine.weight_version`, a Sample's `weight_version`). Engines are paused for the
duration of the sync (a batch in flight finishes on the old weights) and resumed afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from megapo import compat
from megapo.weights.buckets import check_bucket_bytes
from megapo.weights.transports import Transport


@dataclass
class SyncStats:
    transport: str
    version: int
    bytes: int  # model bytes moved by this rank (0 where the rank only took part in the gather)
    tensors: int
    buckets: int
    largest_bucket: int  # bytes
    seconds: float  # wall time of the whole sync: gather, conversion, transport, engine load

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-12) / 1e9

    def to_dict(self) -> dict:
        return {**asdict(self), "gb_per_s": self.gb_per_s}


def _check(engines: Sequence, transport: Transport, bucket_bytes: int, version: int) -> None:
    if not isinstance(transport, Transport):
        raise TypeError(f"transport: expected a megapo.weights Transport, got {type(transport).__name__}")
    check_bucket_bytes(bucket_bytes)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version: must be an int >= 0, got {version!r}")
    for i, engine in enumerate(engines):
        if version <= engine.weight_version:
            raise ValueError(f"version: {version} is not newer than engines[{i}].weight_version = "
                             f"{engine.weight_version} (the version increments on every sync)")


def sync_named(named: Iterable[tuple[str, torch.Tensor]], engines: Sequence, transport: Transport,
               bucket_bytes: int, version: int, *, dtype: torch.dtype | None = None, pause: bool = True) -> SyncStats:
    """Sync an already-gathered stream of HF-named tensors (a learner's, or any other source)."""
    engines = list(engines)
    _check(engines, transport, bucket_bytes, version)
    start = time.perf_counter()
    if pause:
        for engine in engines:
            engine.pause()
    try:
        with compat.device_mode_suspended():
            moved = transport.send(named, engines, bucket_bytes, version, dtype)
    finally:
        if pause:
            for engine in engines:
                engine.resume()
    seconds = time.perf_counter() - start
    return SyncStats(transport.name, version, moved.bytes, moved.tensors, moved.buckets, moved.largest_bucket, seconds)


def sync_learner(learner, engines: Sequence, transport: Transport, bucket_bytes: int, version: int, *,
                 dtype: torch.dtype | None = None, pause: bool = True) -> SyncStats:
    """Sync a megapo Learner's weights to `engines` (collective over the learner's ranks)."""
    from megapo.weights import gather

    engines = list(engines)
    _check(engines, transport, bucket_bytes, version)  # before any collective starts
    module, family, spec = gather.learner_parts(learner)
    if transport.per_stage:
        named = gather.iter_stage_tensors(module, family, spec)
    else:
        named = gather.iter_model_tensors(module, family, spec)
    return sync_named(named, engines, transport, bucket_bytes, version, dtype=dtype, pause=pause)

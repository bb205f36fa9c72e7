"""Rollout batches made ahead of the learner (async mode), written into a checkpoint and read back on --resume,
so a resumed run trains the very samples the stopped one had drawn (tokens, log-probs, versions, routes,
rewards) instead of drawing them again.

Two files beside trainer_state.json (both in the checkpoint's manifest):
    rollouts.json           the batches' structure: groups, examples, samples, metrics, as JSON
    rollouts.safetensors    every array (routes) the JSON refers to by key

Nothing is unpickled: a record names its type from a fixed list (TYPES), and arrays are raw tensors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

JSON_FILE, TENSOR_FILE = "rollouts.json", "rollouts.safetensors"


def _types() -> dict[str, type]:
    """The record types a store may hold, by name (a store naming any other is refused)."""
    from megapo.engines.base import Sample
    from megapo.envs.base import Trajectory
    from megapo.tasks.base import Example
    from megapo.trainer.async_rollout import Batch
    from megapo.trainer.rollout import Group

    return {t.__name__: t for t in (Batch, Group, Example, Sample, Trajectory)}


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: self(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return {"__type__": type(value).__name__, **fields}
        if isinstance(value, (np.ndarray, torch.Tensor)):
            key = f"a{len(self.tensors)}"
            self.tensors[key] = torch.as_tensor(value).clone()  # samples' routes may be views of one buffer
            return {"__array__": key, "numpy": isinstance(value, np.ndarray)}
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"rollout store: dict keys must be strings, got {list(value)[:3]}")
            return {"__dict__": {k: self(v) for k, v in value.items()}}
        if isinstance(value, tuple):
            return {"__tuple__": [self(v) for v in value]}
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"rollout store: cannot store a {type(value).__name__}")


def _decode(value: Any, tensors: dict[str, torch.Tensor], types: dict[str, type]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, types) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value:
        t = tensors[value["__array__"]]
        return t.numpy() if value["numpy"] else t
    if "__tuple__" in value:
        return tuple(_decode(v, tensors, types) for v in value["__tuple__"])
    if "__dict__" in value:
        return {k: _decode(v, tensors, types) for k, v in value["__dict__"].items()}
    name = value.get("__type__")
    if name not in types:
        raise ValueError(f"rollout store: unknown record type {name!r}")
    return types[name](**{k: _decode(v, tensors, types) for k, v in value.items() if k != "__type__"})


def save_batches(folder: str | Path, batches: list) -> None:
    """Write `batches` (megapo.trainer.async_rollout.Batch) into `folder`."""
    from megapo.weights.safetensors_io import save_tensors

    folder = Path(folder)
    encode = _Encoder()
    records = encode(list(batches))
    (folder / JSON_FILE).write_text(json.dumps({"batches": records}), encoding="utf-8")
    save_tensors(folder / TENSOR_FILE, encode.tensors)


def load_batches(folder: str | Path) -> list:
    """The batches save_batches wrote into `folder` ([] when it wrote none)."""
    from megapo.weights.safetensors_io import open_tensors

    folder = Path(folder)
    if not (folder / JSON_FILE).is_file():
        return []
    records = json.loads((folder / JSON_FILE).read_text(encoding="utf-8"))["batches"]
    with open_tensors(folder / TENSOR_FILE) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(records, tensors, _types())

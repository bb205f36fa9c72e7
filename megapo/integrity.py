"""Checks of the weights megapo writes and of the pickles it cannot avoid reading back.

Non-finite weights are never written: `check_finite` (one process) and `check_finite_all_ranks` (every
rank raises together, so none waits in a collective for a rank that gave up) name the first tensor that
holds NaN or inf. Learner.save (trainer checkpoints) and `megapo convert` (both directions) call them.

A torch_dist checkpoint's `.metadata` is a pickle, and torch's FileSystemReader.read_metadata loads it
with plain `pickle.load` (Megatron's load does that too): a planted `.metadata` would run its payload.
`read_dist_metadata` unpickles it with an allow-list (the checkpoint-metadata dataclasses and enums of
torch.distributed.checkpoint, torch.Size, dtypes, layouts) and refuses anything else, so callers check
a folder with it before Megatron or the converter touch it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
from pathlib import Path
from typing import Iterable

import torch

from megapo.dist import any_rank

DIST_METADATA = ".metadata"
# modules whose dataclasses and enums make up a torch_dist .metadata (Metadata, TensorStorageMetadata,
# ChunkStorageMetadata, MetadataIndex, _StorageInfo, SavePlan, WriteItem, WriteItemType, ...)
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_OTHER_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class NonFiniteError(RuntimeError):
    """A tensor about to be written (or exported) holds NaN or inf, or an update left one in the model."""


class UnsafePickle(ValueError):
    """A pickle in a checkpoint refers to something outside the allow-list; it was not run."""


# ----------------------------------------------------------------------------------------- finite


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int, int] | None:
    """(name, non-finite count, numel) of the first floating tensor holding NaN/inf, else None."""
    for name, tensor in named:
        tensor = tensor.detach()
        if not tensor.is_floating_point():
            continue
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            return name, int(bad.sum()), tensor.numel()
    return None


def _message(what: str, found: tuple[str, int, int]) -> str:
    name, count, numel = found
    return f"{what}: tensor {name} holds {count} non-finite value(s) (NaN/inf) of {numel}; refusing to write it"


def check_finite(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    found = first_nonfinite(named)
    if found is not None:
        raise NonFiniteError(_message(what, found))


def check_finite_all_ranks(named: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """check_finite over each rank's own tensors; raises on every rank when any rank found one
    (collective when torch.distributed is initialized)."""
    found = first_nonfinite(named)
    if not any_rank(found is not None):
        return
    err = NonFiniteError(_message(what, found) if found is not None else
                         f"{what}: another rank holds non-finite weights (its message names the tensor); "
                         f"refusing to write them")
    err.other_rank = found is None  # megapo.worker_errors reports the rank that names the tensor
    raise err


# ----------------------------------------------------------------------------------------- pickles


def _allowed(module: str, name: str):
    """The object the pickle may use, or None."""
    if (module, name) in _OTHER_GLOBALS:
        return getattr(importlib.import_module(module), name)
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module in _DCP_MODULES:
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and obj.__module__ == module and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj  # plain records: building one runs no code of the file's choosing
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = _allowed(module, name)
        if obj is None:
            raise UnsafePickle(f"refers to {module}.{name}, which a torch_dist checkpoint's metadata never "
                               f"holds")
        return obj

    def persistent_load(self, pid):
        raise UnsafePickle("holds a persistent reference, which a torch_dist checkpoint's metadata never holds")


def read_dist_metadata(folder: str | Path):
    """The torch_dist Metadata of `folder`, unpickled through the allow-list. Raises UnsafePickle
    (nothing of the file's was run), FileNotFoundError, or ValueError for a damaged file."""
    path = Path(folder) / DIST_METADATA
    data = path.read_bytes()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafePickle as exc:
        raise UnsafePickle(f"{path} {exc}; refusing to load it (it could run code)") from None
    except Exception as exc:  # truncated or garbled: pickle raises several types
        raise ValueError(f"{path} is not a readable torch_dist metadata file ({type(exc).__name__}: {exc})") from None

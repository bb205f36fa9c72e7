"""Write HF safetensors as tensors arrive, holding at most one shard in memory.

    writer = ShardWriter(out_dir, max_shard_bytes=2 * 2**30, dtype=torch.bfloat16)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()   # model.safetensors, or model-0000K-of-0000N.safetensors + model.safetensors.index.json

Shards are first written under a temporary name and given their final `-of-N` names in close(),
when N is known; the caller writes into a temporary folder anyway (see megapo/commands/convert.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500*2**20, '123' -> 123 bytes."""
    match = _SIZE.match(str(text))
    unit = match.group(2).upper() if match else None
    if unit is not None and unit not in _UNITS and unit + "B" in _UNITS:
        unit += "B"  # '5G' means '5GB'
    if match is None or unit not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"size {text!r}: must be at least 1 byte")
    return size


class ShardWriter:
    def __init__(self, out_dir: str | Path, max_shard_bytes: int, dtype: torch.dtype):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # (temporary file, names in it)
        self.total_bytes = 0

    @property
    def shards_written(self) -> int:
        return len(self._written)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        # A fresh contiguous copy: exported q/k/v are views of one tensor, which safetensors refuses.
        out = torch.empty(tensor.shape, dtype=self.dtype)
        out.copy_(tensor)
        if self._pending and self._pending_bytes + out.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = out
        self._pending_bytes += out.nbytes
        self.total_bytes += out.nbytes

    def _flush(self) -> None:
        from megapo.weights.safetensors_io import save_tensors

        path = self.out_dir / f"shard-{len(self._written):05d}.safetensors.partial"
        save_tensors(path, self._pending, metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the files, write the index when there are several; return file names."""
        if self._pending or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            self._written[0][0].rename(self.out_dir / SINGLE)
            return [SINGLE]
        weight_map, files = {}, []
        for i, (path, names) in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(self.out_dir / final)
            files.append(final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return files

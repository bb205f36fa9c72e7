"""Write a safetensors file straight from tensors (views included), with no intermediate copy.

safetensors' own `save_file` refuses tensors that share storage, and the HF tensors of a weight sync
often do (gate and up are two halves of one Megatron parameter). The format is simple: an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes
back to back. Files written here are read by the official reader (safetensors.safe_open) in tests.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from megapo.weights.buckets import DTYPE_NAMES, nbytes


def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (cast to dtype when given) to `path`; returns the data bytes written."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors:
        d = dtype or t.dtype
        if d not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {d} cannot be written to safetensors here")
        if name in header:
            raise ValueError(f"{name}: appears twice in one file")
        n = nbytes(t, d)
        header[name] = {"dtype": DTYPE_NAMES[d], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format allows space padding; keeps the data 8-byte aligned
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, t in tensors:
            if t.numel() == 0:
                continue
            t = t.detach()
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            t = t.to("cpu").contiguous()
            # the tensor's own memory, handed to write() as a buffer: no bytes object in between
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return offset

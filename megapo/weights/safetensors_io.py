"""megapo's one safetensors module: every file megapo writes or reads in that format goes through here.

- `save_tensors` / `open_tensors` / `iter_folder`: the official writer and reader (checkpoint RNG state,
  converted HF shards, staged engine weights, model folders).
Weight sync's files, written and read with no intermediate copy:
- `write_safetensors`: straight from the tensors (views included). safetensors' own `save_file` refuses
  tensors that share storage, and the HF tensors of a weight sync often do (gate and up are two halves of
  one Megatron parameter); it also makes a bytes copy of every tensor first. A file that already exists
  is overwritten in place: rewriting pages the kernel already caches costs less than filling a new file
  (docs/measurements.md), and replacing a file by rename makes ext4 flush it to disk
  (auto_da_alloc). The caller publishes the folder atomically (DiskTransport renames its staging folder).
- `read_safetensors_into`: read each tensor straight into the engine's own weight (one read() per tensor
  from the page cache, no new tensor, no mmap page faults); tensors without a matching destination (other
  dtype, shape or name) are returned, read by the official reader, for the caller to convert or refuse.

The format is simple: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes back to back. Tests read files written here with safetensors.safe_open.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megapo.weights.buckets import DTYPE_NAMES, DTYPES, nbytes

MAX_HEADER = 100 * 2**20  # the official reader's limit


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """The official writer: contiguous tensors that share no storage; `metadata` maps str to str."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=metadata)


def open_tensors(path: str | Path):
    """The official reader of one file, a context manager: keys(), get_tensor(), get_slice(), metadata()."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def iter_folder(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the folder's *.safetensors files, in file-name order (no pickles)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(model_dir)!r}")
    for f in files:
        with open_tensors(f) as st:
            for name in st.keys():
                yield name, st.get_tensor(name)

def write_safetensors(path: str | Path, tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                      metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (cast to dtype when given) to `path`, in place if it exists; returns the data bytes."""
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
    path = Path(path)
    with open(path, "r+b" if path.is_file() else "wb") as f:
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
        f.truncate()  # a recycled file may have been longer
    return offset


def _header(fd: int, path: Path) -> tuple[dict, int]:
    """(the JSON header, the file offset where the data starts)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise ValueError(f"{path}: safetensors header of {n} bytes is larger than {MAX_HEADER}")
    head = os.pread(fd, n, 8)
    if len(head) != n:
        raise ValueError(f"{path}: truncated safetensors header")
    return json.loads(head), 8 + n


def _read_into(fd: int, dest: torch.Tensor, offset: int, path: Path, name: str) -> None:
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{path}: {name}: file ends inside the tensor's data")
        done += got


def read_safetensors_into(path: str | Path, targets: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Read every tensor of `path` whose name has a target of the same dtype and shape (contiguous, on
    the CPU) straight into it; yield (name, tensor) for the others, in new memory."""
    path = Path(path)
    rest = []
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        header, start = _header(fd, path)
        size = os.fstat(fd).st_size
        items = [(name, info) for name, info in header.items() if name != "__metadata__"]
        for name, info in sorted(items, key=lambda item: item[1]["data_offsets"][0]):  # sequential reads
            lo, hi = info["data_offsets"]
            if not 0 <= lo <= hi or start + hi > size:
                raise ValueError(f"{path}: {name}: data_offsets {lo}..{hi} lie outside the file")
            dtype, dest = DTYPES.get(info["dtype"]), targets.get(name)
            if (dtype is None or dest is None or dest.dtype != dtype or list(dest.shape) != list(info["shape"])
                    or not dest.is_contiguous() or dest.device.type != "cpu"):
                rest.append(name)  # the official reader reads it; the caller converts or refuses it
                continue
            if hi - lo != nbytes(dest):
                raise ValueError(f"{path}: {name}: {hi - lo} data bytes for shape {info['shape']} {info['dtype']}")
            if hi > lo:
                _read_into(fd, dest, start + lo, path, name)
    if rest:
        with open_tensors(path) as st:
            for name in rest:
                yield name, st.get_tensor(name)


def read_folder_into(folder: str | Path, targets: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """read_safetensors_into for every *.safetensors file of `folder`, in name order."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(folder)!r}")
    for f in files:
        yield from read_safetensors_into(f, targets)

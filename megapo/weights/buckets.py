"""Buckets: group a stream of HF-named tensors into pieces of at most `bucket_bytes`, so a weight sync
holds about one bucket of extra memory at a time, never the whole model.

- `bucket_bytes(mb)`: the validated size in bytes (`rollout.bucket_mb` in the run config).
- `iter_buckets`: lists of (name, tensor) whose bytes add up to at most bucket_bytes (a single tensor
  larger than a bucket goes alone). The tensors are whatever the source yields (often views of live
  parameters): a consumer copies them out before asking for the next bucket.
- `FlatBucket`: one preallocated byte buffer that tensors are packed into back to back (one copy,
  with an optional dtype cast), plus its metadata as JSON (names, dtypes, shapes, offsets; never
  pickles). `unpack` turns a received buffer and its metadata back into views.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

# dtype <-> wire name (the safetensors spelling); an explicit table, no eval/getattr on strings
DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                  "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                                  "U8": torch.uint8}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ALIGN = 64  # byte offset of every tensor in a FlatBucket: any dtype view of the buffer is aligned


def bucket_bytes(bucket_mb: float, name: str = "bucket_mb") -> int:
    """Megabytes (2**20) -> bytes; refuses zero, negative or non-numeric sizes with a clear error."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise ValueError(f"{name}: must be a number of megabytes > 0, got {bucket_mb!r}")
    if not bucket_mb > 0:
        raise ValueError(f"{name}: must be > 0 (megabytes per weight-sync bucket), got {bucket_mb}")
    return max(1, int(bucket_mb * 2**20))


def check_bucket_bytes(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"bucket_bytes: must be an int > 0, got {n!r}")
    return n


def nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most bucket_bytes (counted in `dtype` when given)."""
    check_bucket_bytes(bucket_bytes)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = nbytes(t, dtype)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
        del t  # only the bucket holds it
    if bucket:
        yield bucket


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class BucketSlot:
    name: str
    dtype: str  # key of DTYPES
    shape: list[int]
    offset: int  # bytes into the buffer

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass
class FlatBucket:
    """A reusable byte buffer that tensors are packed into. `capacity` bytes are allocated once."""

    capacity: int
    device: str | torch.device = "cpu"
    buffer: torch.Tensor = field(init=False, repr=False)
    entries: list[BucketSlot] = field(init=False, default_factory=list)
    used: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        check_bucket_bytes(self.capacity)
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)

    def fits(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        return _aligned(self.used) + nbytes(t, dtype) <= self.capacity

    def add(self, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Copy `t` (cast to dtype) into the buffer; the caller checked `fits`."""
        dtype = dtype or t.dtype
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {dtype} cannot be sent (known: {', '.join(map(str, DTYPE_NAMES))})")
        start = _aligned(self.used)
        n = nbytes(t, dtype)
        if start + n > self.capacity:
            raise ValueError(f"{name}: {n} bytes do not fit the bucket ({self.capacity - start} left)")
        self.buffer[start:start + n].view(dtype).view(t.shape).copy_(t)
        self.entries.append(BucketSlot(name, DTYPE_NAMES[dtype], list(t.shape), start))
        self.used = start + n

    def clear(self) -> None:
        self.entries = []
        self.used = 0

    def payload(self) -> torch.Tensor:
        return self.buffer[:self.used]

    def metadata(self) -> bytes:
        return encode_metadata(self.entries)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        return unpack(self.buffer, self.entries)


def encode_metadata(entries: list[BucketSlot], **extra) -> bytes:
    return json.dumps({"entries": [[e.name, e.dtype, e.shape, e.offset] for e in entries], **extra}).encode()


def decode_metadata(data: bytes) -> tuple[list[BucketSlot], dict]:
    obj = json.loads(data.decode())
    entries = [BucketSlot(name, dtype, list(shape), int(offset)) for name, dtype, shape, offset in obj.pop("entries")]
    for e in entries:
        if e.dtype not in DTYPES:
            raise ValueError(f"{e.name}: unknown dtype {e.dtype!r} in bucket metadata")
    return entries, obj


def unpack(buffer: torch.Tensor, entries: list[BucketSlot]) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` (uint8) for each entry: no copies."""
    out = []
    for e in entries:
        end = e.offset + e.nbytes
        if end > buffer.numel():
            raise ValueError(f"{e.name}: bucket metadata points past the buffer ({end} > {buffer.numel()})")
        out.append((e.name, buffer[e.offset:end].view(DTYPES[e.dtype]).view(e.shape)))
    return out

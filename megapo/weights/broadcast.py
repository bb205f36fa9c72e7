"""The broadcast transport: learner -> engine workers over a process group of their own.

One group per learner pipeline stage: rank 0 is that stage's root learner rank (tensor-parallel rank 0
of data-parallel replica 0), ranks 1..W are the engine workers; NCCL on GPU, gloo on CPU. The groups
are standalone (their own TCPStore), so they neither need nor disturb the learner's default group,
and the engine workers (other processes, e.g. inside a vLLM server) never join the learner's world.

Wire protocol, per bucket, all broadcasts from rank 0 (no pickles anywhere):
    int64 [3]   (kind, metadata bytes, payload bytes)     kind: 1 = bucket, 0 = this stage is done
    uint8 [m]   JSON metadata: {"entries": [[name, dtype, shape, offset], ...], "version": v}
    uint8 [p]   the packed tensors (a FlatBucket's bytes, or one tensor larger than a bucket)
After every stage is done, an all-reduce(MIN) of the weight versions is the acknowledgement: the
sender learns that every worker applied version v (a worker contributes the version it applied).

Double buffering: the sender packs bucket k+1 while bucket k's payload is in flight, and a worker
applies bucket k while k+1 arrives, so each side holds two half-size buffers: the extra memory stays
one `bucket_bytes` on each side.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapo.weights.buckets import (DTYPE_NAMES, Entry, FlatBucket, check_bucket_bytes, decode_metadata,
                                    encode_metadata, nbytes, unpack)
from megapo.weights.transports import Moved, Transport, drain

BUCKET, DONE = 1, 0
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class GroupAddress:
    """Where the weight-sync group of pipeline stage `stage` meets: host, base_port + stage."""

    host: str
    base_port: int
    workers: int  # engine workers (the group has workers + 1 ranks)
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.base_port < 65536:
            raise ValueError(f"base_port: must be in 1..65535, got {self.base_port}")
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1 (engine workers receiving weights), got {self.workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")


def join_group(address: GroupAddress, stage: int, rank: int):
    """Join stage `stage`'s weight-sync group as `rank` (0 = the learner's stage root). Blocks until all
    workers + 1 ranks have joined."""
    if not 0 <= rank <= address.workers:
        raise ValueError(f"rank: must be in 0..{address.workers}, got {rank}")
    timeout = datetime.timedelta(seconds=address.timeout_s)
    size = address.workers + 1
    store = dist.TCPStore(address.host, address.base_port + stage, size, rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"megapo-weights-{stage}", store)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _bcast(group, t: torch.Tensor, async_op: bool = False):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    work = group.broadcast([t], opts)
    if async_op:
        return work
    work.wait()
    return None


def _ack(group, version: int, device) -> int:
    t = torch.tensor([version], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    return int(t.item())


def _bytes_tensor(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


class BroadcastSender:
    """The learner stage root's end of one group."""

    def __init__(self, group, device: str | torch.device = "cpu"):
        self.group = group
        self.device = torch.device(device)

    def _send(self, entries: list[Entry], payload: torch.Tensor, version: int):
        meta = _bytes_tensor(encode_metadata(entries, version=version), self.device)
        _bcast(self.group, torch.tensor([BUCKET, meta.numel(), payload.numel()], dtype=torch.int64, device=self.device))
        _bcast(self.group, meta)
        return _bcast(self.group, payload, async_op=True)

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int,
             dtype: torch.dtype | None = None) -> Moved:
        """Send this stage's tensors; returns what was sent. Call `finish` after the last stage."""
        check_bucket_bytes(bucket_bytes)
        half = max(1, bucket_bytes // 2)
        buffers = [FlatBucket(half, self.device), FlatBucket(half, self.device)]
        inflight: list = [None, None]  # the payload broadcast reading each buffer
        moved, k = Moved(), 0

        def flush():
            nonlocal k
            buf = buffers[k % 2]
            if buf.entries:
                inflight[k % 2] = self._send(buf.entries, buf.payload(), version)
                moved.add_bucket(buf.used, len(buf.entries))
                k += 1
                nxt = k % 2
                if inflight[nxt] is not None:  # the next buffer may still be on the wire
                    inflight[nxt].wait()
                    inflight[nxt] = None
                buffers[nxt].clear()

        for name, t in named:
            d = dtype or t.dtype
            if d not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {d} cannot be sent")
            if nbytes(t, d) > half:  # larger than a half bucket: send it on its own, unpacked
                flush()
                single = t.detach().to(device=self.device, dtype=d).contiguous()
                work = self._send([Entry(name, DTYPE_NAMES[d], list(t.shape), 0)],
                                  single.reshape(-1).view(torch.uint8), version)
                work.wait()
                moved.add_bucket(single.numel() * single.element_size(), 1)
                del t, single
                continue
            buf = buffers[k % 2]
            if not buf.fits(t, d):
                flush()
                buf = buffers[k % 2]
            buf.add(name, t.detach(), d)
            del t  # packed: drop it before the stream produces the next one
        flush()
        for work in inflight:
            if work is not None:
                work.wait()
        _bcast(self.group, torch.tensor([DONE, 0, 0], dtype=torch.int64, device=self.device))
        return moved

    def finish(self, version: int) -> int:
        """Wait for every worker's acknowledgement; returns the lowest version a worker applied."""
        return _ack(self.group, version, self.device)


class BroadcastReceiver:
    """An engine worker's end: one group per learner pipeline stage, received in stage order."""

    def __init__(self, groups: list, device: str | torch.device = "cpu"):
        if not groups:
            raise ValueError("groups: need one weight-sync group per learner pipeline stage")
        self.groups = groups
        self.device = torch.device(device)
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def _buffer(self, i: int, n: int) -> torch.Tensor:
        if self._buffers[i].numel() < n:
            self._buffers[i] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free before growing
            self._buffers[i] = torch.empty(n, dtype=torch.uint8, device=self.device)
        return self._buffers[i][:n]

    def receive(self, apply: Callable[[list[tuple[str, torch.Tensor]], int], None]) -> tuple[int, Moved]:
        """Receive one full sync, calling apply(named_views, version) per bucket (the views are reused
        afterwards: apply must copy them, as Engine.update_weights does). Returns (version, moved)."""
        moved, version = Moved(), -1
        for group in self.groups:
            pending = None  # (entries, buffer, work) of the bucket on the wire
            k = 0
            while True:
                head = torch.empty(3, dtype=torch.int64, device=self.device)
                _bcast(group, head)
                kind, m, p = (int(x) for x in head.tolist())
                if kind == DONE:
                    break
                meta = torch.empty(m, dtype=torch.uint8, device=self.device)
                _bcast(group, meta)
                entries, extra = decode_metadata(bytes(meta.cpu().numpy()))
                version = int(extra["version"])
                buf = self._buffer(k % 2, p)
                work = _bcast(group, buf, async_op=True)
                if pending is not None:  # apply the previous bucket while this one arrives
                    self._apply(apply, pending, version, moved)
                pending = (entries, buf, work)
                k += 1
            if pending is not None:
                self._apply(apply, pending, version, moved)
        return version, moved

    @staticmethod
    def _apply(apply, pending, version: int, moved: Moved) -> None:
        entries, buf, work = pending
        work.wait()
        apply(unpack(buf, entries), version)
        moved.add_bucket(buf.numel(), len(entries))

    def finish(self, version: int) -> int:
        """Acknowledge `version` to every stage root (their `finish`)."""
        low = version
        for group in self.groups:
            low = min(low, _ack(group, version, self.device))
        return low


class BroadcastTransport(Transport):
    """Learner side. `sender` only on a stage root (None on the other learner ranks, which drain)."""

    name = "broadcast"
    per_stage = True

    def __init__(self, sender: BroadcastSender | None):
        self.sender = sender

    def send(self, named, engines, bucket_bytes, version, dtype) -> Moved:
        if self.sender is None:
            return drain(named)
        moved = self.sender.send(named, bucket_bytes, version, dtype)
        acked = self.sender.finish(version)
        if acked != version:
            raise RuntimeError(f"broadcast: an engine worker acknowledged weight version {acked}, expected {version}")
        return moved

"""The broadcast transport: learner -> engine workers over a process group of their own.

One group per learner pipeline stage: rank 0 is that stage's root learner rank (tensor-parallel rank 0
of data-parallel replica 0), ranks 1..W are the engine workers; NCCL on GPU, gloo on CPU. The groups
are standalone (their own TCPStore), so they neither need nor disturb the learner's default group,
and the engine workers (other processes, e.g. inside a vLLM server) never join the learner's world.

Wire protocol, per message, all broadcasts from rank 0 (no pickles anywhere):
    uint8 [HEADER_BYTES]  int64 (kind, metadata bytes m, packed bytes) then, when it fits, the metadata
                kind: 1 = message, 0 = this stage is done
                metadata: JSON {"entries": [[name, dtype, shape, offset], ...], "version": v}
                (offset >= 0: inside the packed payload; offset -1 - r: a large tensor, part of run r)
    uint8 [m]   the metadata, only when it did not fit in the header
    uint8 [p]   the small tensors, packed (a FlatBucket's bytes), if any
    then one broadcast per run of large tensors, in entry order, straight from the learner's memory and,
    when the worker passes `targets`, straight into the engine's weights (zero copies on both ends). A run
    is a sequence of large tensors that lie back to back in one storage on the sender: one broadcast
    instead of several, since every gloo broadcast costs a rendezvous and thread hand-offs on both ends
    (what many pieces cost against one broadcast of the same bytes: docs/measurements.md).
    Runs are long because both ends keep HF order in memory: a learner's parameters lie back to back in
    registration order (learner.model.contiguous_parameters: a layer's experts are gate, up, down, gate...;
    the QKV export writes q, k, v into one buffer), and the embedded engine keeps a layer's experts in one
    buffer in the same order. A message boundary does not cut a run that the next message can hold whole.
    The worker receives a run in place when its targets also lie back to back, else into a buffer.
Order on the wire: header 0 [metadata 0], then for k = 1, 2, ...: header k, payload k-1, [metadata k];
then the DONE header and the last payload. The header of the next message arrives before this message's
payload, so the worker posts the payload's receives while the previous payload is still arriving and no
message waits for a round trip (gloo sends only once the receive is posted). All broadcasts are
asynchronous on both ends; the worker waits only for headers. After every stage is done, an
all-reduce(MIN) of the weight versions is the acknowledgement: the sender learns that every worker
applied version v (a worker contributes the version it applied).

Memory: a message holds at most `bucket_bytes / (2 * slots)` packed plus as much in large tensors, and
at most `slots` messages are in flight, so the extra memory stays one `bucket_bytes` per end (large
tensors of a TP=1 learner are views of its parameters and cost nothing).
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapo.weights.buckets import (DTYPE_NAMES, DTYPES, BucketSlot, FlatBucket, check_bucket_bytes, decode_metadata,
                                    encode_metadata, nbytes, unpack)
from megapo.weights.transports import Moved, Transport, drain

BUCKET, DONE = 1, 0
HEADER_BYTES = 64 * 1024  # a message's header: 3 int64, then its metadata when it fits
DIRECT_BYTES = 256 * 1024  # tensors at least this large travel on their own, without packing
BACKENDS = ("gloo", "nccl")
# gloo worker threads per rank (its default is 2): more of them send a sync's many broadcasts faster
# (docs/measurements.md); idle threads only wait on a condition variable.
GLOO_THREADS = 16


@dataclass(frozen=True)
class GroupAddress:
    """Where the weight-sync group of pipeline stage `stage` meets: host, base_port + stage."""

    host: str
    base_port: int
    workers: int  # engine workers (the group has workers + 1 ranks)
    backend: str = "gloo"
    timeout_s: float = 600.0
    # gloo: worker threads per rank, i.e. broadcasts in progress at once. A receive is announced to the
    # sender only once a worker thread runs it, and a send waits for that announcement: with gloo's
    # default of 2, every tensor sent on its own costs a round trip. More threads post the receives
    # ahead, so the sender streams tensor after tensor (idle threads wait on a condition variable).
    threads: int = GLOO_THREADS
    # the membership this group is formed for: an elastic fleet (servers joining or dropped) forms a new group
    # under the next generation on the same rendezvous store, and the old one is aborted
    generation: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {BACKENDS}, got {self.backend!r}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1 (gloo worker threads), got {self.threads}")
        if not 0 < self.base_port < 65536:
            raise ValueError(f"base_port: must be in 1..65535, got {self.base_port}")
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1 (engine workers receiving weights), got {self.workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.generation < 0:
            raise ValueError(f"generation: must be >= 0, got {self.generation}")


def host_stores(address: GroupAddress, stages: int) -> list:
    """Serve the rendezvous stores of all `stages` groups from this process, at address.host (an address of
    this node): every stage's group then meets there, whichever node its stage root runs on, and the stage
    roots join with host_store=False. Keep the stores alive while the groups are in use."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    # no world size: the groups formed through a store change size as servers join or leave
    return [dist.TCPStore(address.host, address.base_port + stage, None, True, timeout=timeout,
                          wait_for_workers=False) for stage in range(stages)]


def join_group(address: GroupAddress, stage: int, rank: int, host_store: bool | None = None):
    """Join stage `stage`'s weight-sync group as `rank` (0 = the learner's stage root). Blocks until all
    workers + 1 ranks have joined. The rendezvous store is served by rank 0 unless host_store says otherwise
    (False: another process serves it, see host_stores)."""
    if not 0 <= rank <= address.workers:
        raise ValueError(f"rank: must be in 0..{address.workers}, got {rank}")
    timeout = datetime.timedelta(seconds=address.timeout_s)
    size = address.workers + 1
    master = rank == 0 if host_store is None else host_store
    store = dist.TCPStore(address.host, address.base_port + stage, size, master, timeout=timeout)
    store = dist.PrefixStore(f"megapo-weights-{stage}-g{address.generation}", store)
    if address.backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._threads = address.threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, size, options)
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


HEAD_INTS = 3


def _inline_size(n: int) -> bool:
    return n <= HEADER_BYTES - HEAD_INTS * 8


def _inline(meta: bytes) -> bool:
    return _inline_size(len(meta))


def _header(kind: int, meta: bytes, packed: int, device) -> torch.Tensor:
    """HEADER_BYTES: (kind, len(meta), packed) as int64, then the metadata when it fits."""
    data = struct.pack("<3q", kind, len(meta), packed) + (meta if _inline(meta) else b"")
    head = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    head[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return head.to(device)


@dataclass
class _Message:
    packed: FlatBucket
    large: list[tuple[str, torch.Tensor]]  # sent on their own after the packed bytes
    large_bytes: int = 0
    works: list | None = None  # the broadcasts in flight
    header: tuple | None = None  # their small tensors, kept alive until done
    spans: list | None = None  # one uint8 view per run of large tensors, once announced
    meta: list | None = None  # the metadata broadcast, when it does not fit the header

    def empty(self) -> bool:
        return not self.packed.entries and not self.large

    def entries(self, runs: list[int]) -> list[BucketSlot]:
        return self.packed.entries + [BucketSlot(n, DTYPE_NAMES[t.dtype], list(t.shape), -1 - r)
                                      for (n, t), r in zip(self.large, runs)]

    def wait(self) -> None:
        for work in self.works or []:
            work.wait()
        self.works = None
        self.header = None
        self.spans = None
        self.meta = None
        self.large = []
        self.large_bytes = 0
        self.packed.clear()


class BroadcastSender:
    """The learner stage root's end of one group. The packing buffers are kept between syncs
    (allocating and first-touching them again costs as much as a copy); `release()` frees them."""

    def __init__(self, group, device: str | torch.device = "cpu", slots: int = 4, direct_bytes: int = DIRECT_BYTES):
        if slots < 2:
            raise ValueError(f"slots: must be >= 2 (one filling while another is sent), got {slots}")
        if direct_bytes < 1:
            raise ValueError(f"direct_bytes: must be >= 1, got {direct_bytes}")
        self.group = group
        self.device = torch.device(device)
        self.slots = slots
        self.direct_bytes = direct_bytes
        self._messages: list[_Message] = []
        self.sizes: list[int] = []  # bytes of every broadcast of the last send, in order (for benchmarks)

    def release(self) -> None:
        self._messages = []

    def abort(self) -> None:
        """Tear the group down (after a failed send, or before the next generation's): aborted and released, which
        closes its connections, so every rank still waiting in it (the surviving workers) gets an error at once
        instead of waiting out the group's timeout (seen: 0.16 s instead of the 20 s timeout; aborting alone
        leaves the connections open). The sender is unusable afterwards."""
        import gc

        self._messages = []  # their pending works hold the group
        if self.group is not None:
            self.group.abort()
            self.group = None
            gc.collect()  # the group's destructor closes the connections

    def _slots(self, bucket_bytes: int) -> list[_Message]:
        size = max(1, bucket_bytes // (2 * self.slots))
        if not self._messages or self._messages[0].packed.capacity != size:
            self._messages = []  # free the old buffers first
            self._messages = [_Message(FlatBucket(size, self.device), []) for _ in range(self.slots)]
        for m in self._messages:
            m.wait()
        return self._messages

    def _announce(self, msg: _Message, version: int) -> None:
        """Post the message's header (its payload follows once the next message is announced)."""
        runs, msg.spans = _runs([t for _, t in msg.large])
        meta = encode_metadata(msg.entries(runs), version=version)
        head = _header(BUCKET, meta, msg.packed.used, self.device)
        msg.meta = [] if _inline(meta) else [_bytes_tensor(meta, self.device)]
        msg.header = (head, msg.meta)  # alive until the broadcasts are done
        msg.works = [_bcast(self.group, head, async_op=True)]
        self.sizes.append(head.numel())

    def _metadata(self, msg: _Message) -> None:
        msg.works += [_bcast(self.group, t, async_op=True) for t in msg.meta]
        self.sizes += [t.numel() for t in msg.meta]

    def _payload(self, msg: _Message) -> None:
        # asynchronous: the sender goes on gathering and packing while the worker catches up
        if msg.packed.used:
            msg.works.append(_bcast(self.group, msg.packed.payload(), async_op=True))
        msg.works += [_bcast(self.group, span, async_op=True) for span in msg.spans]
        self.sizes += ([msg.packed.used] if msg.packed.used else []) + [span.numel() for span in msg.spans]

    def send(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int,
             dtype: torch.dtype | None = None) -> Moved:
        """Send this stage's tensors; returns what was sent. Call `finish` after the last stage."""
        check_bucket_bytes(bucket_bytes)
        messages = self._slots(bucket_bytes)
        self.sizes = []
        size = messages[0].packed.capacity
        moved, k = Moved(), 0
        announced = None  # the last message announced, its payload not posted yet

        def flush():
            # order on the wire: header k, payload k-1, metadata k (when not inline): the worker learns what
            # message k holds while message k-1 is still arriving, and has its receives posted before the
            # sender gets to them, so no message waits for a round trip
            nonlocal k, announced
            msg = messages[k % len(messages)]
            if msg.empty():
                return
            self._announce(msg, version)
            if announced is not None:
                self._payload(announced)
            self._metadata(msg)
            announced = msg
            moved.add_bucket(msg.packed.used + msg.large_bytes, len(msg.packed.entries) + len(msg.large))
            k += 1
            messages[k % len(messages)].wait()  # the next slot may still be on the wire

        for name, t in named:
            d = dtype or t.dtype
            if d not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {d} cannot be sent")
            n = nbytes(t, d)
            msg = messages[k % len(messages)]
            if n >= self.direct_bytes or n > size:  # on its own, from its own memory when it can be
                single = t.detach()
                if single.dtype != d or single.device != self.device or not single.is_contiguous():
                    single = single.to(device=self.device, dtype=d).contiguous()
                if msg.large and msg.large_bytes + n > size:
                    carry = _run_tail(msg.large, single, size - n)  # a run is not cut if the next message holds it
                    carried = sum(nbytes(c) for _, c in carry)
                    del msg.large[len(msg.large) - len(carry):]
                    msg.large_bytes -= carried
                    flush()
                    msg = messages[k % len(messages)]
                    msg.large += carry
                    msg.large_bytes += carried
                msg.large.append((name, single))
                msg.large_bytes += n
                del t, single
                continue
            if not msg.packed.fits(t, d):
                flush()
                msg = messages[k % len(messages)]
            msg.packed.add(name, t.detach(), d)
            del t  # packed: drop it before the stream produces the next one
        flush()
        done = _bcast(self.group, _header(DONE, b"", 0, self.device), async_op=True)
        if announced is not None:
            self._payload(announced)
        for msg in messages:
            msg.wait()
        done.wait()
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

    def receive(self, apply: Callable[[list[tuple[str, torch.Tensor]], int], None],
                targets: Mapping[str, torch.Tensor] | None = None) -> tuple[int, Moved]:
        """Receive one full sync, calling apply(named_views, version) per message (the views are reused
        afterwards: apply must copy them, as Engine.update_weights does), and a last apply([], version).
        `targets` (HF name -> the engine's own weight tensor, e.g. EmbeddedEngine.weight_buffers()): a
        large tensor is received straight into its target when dtype, shape and layout match, so only
        write them while the engine is paused. Returns (version, moved)."""
        moved, version = Moved(), -1
        targets = targets or {}
        for group in self.groups:
            pending = None  # the previous message, applied while the next one arrives
            k = 0
            head = self._head(group, self._recv_header(group))
            while head is not None:
                entries, version, p = head
                # the next header comes before this message's payload (see BroadcastSender.send)
                following = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
                next_work = _bcast(group, following, async_op=True)
                packed = [e for e in entries if e.offset >= 0]
                buf = self._buffer(k % 2, p)
                works = [_bcast(group, buf, async_op=True)] if p else []
                loose = []  # large tensors without matching targets: received into new memory
                for run in _group_runs([e for e in entries if e.offset < 0]):
                    span = _span([self._target(targets, e) for e in run])
                    if span is None:  # no place for the run in the engine's memory: a buffer of its own
                        span = torch.empty(sum(e.nbytes for e in run), dtype=torch.uint8, device=self.device)
                        loose.append((span, run))
                    works.append(_bcast(group, span, async_op=True))
                if pending is not None:
                    self._apply(apply, pending, version, moved)
                pending = (packed, buf, loose, works, sum(e.nbytes for e in entries), len(entries))
                next_work.wait()
                head = self._head(group, following)
                k += 1
            if pending is not None:
                self._apply(apply, pending, version, moved)
        apply([], version)  # sets the version when every tensor went straight into its target
        return version, moved

    def _recv_header(self, group) -> torch.Tensor:
        head = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        _bcast(group, head)
        return head

    def _head(self, group, head: torch.Tensor) -> tuple[list[BucketSlot], int, int] | None:
        """A received header -> (entries, version, packed bytes), or None when the stage is done. Receives
        the metadata when it did not fit the header."""
        head = head.cpu()
        kind, m, p = (int(x) for x in head[:HEAD_INTS * 8].view(torch.int64).tolist())
        if kind == DONE:
            return None
        if _inline_size(m):
            meta = head[HEAD_INTS * 8:HEAD_INTS * 8 + m]
        else:
            meta = torch.empty(m, dtype=torch.uint8, device=self.device)
            _bcast(group, meta)
        entries, extra = decode_metadata(bytes(meta.cpu().numpy()))
        return entries, int(extra["version"]), p

    @staticmethod
    def _apply(apply, pending, version: int, moved: Moved) -> None:
        packed, buf, loose, works, n_bytes, n_tensors = pending
        for work in works:
            work.wait()
        named = unpack(buf, packed)
        for span, run in loose:
            named += _split(span, run)
        if named:
            apply(named, version)
        moved.add_bucket(n_bytes, n_tensors)

    def _target(self, targets: Mapping[str, torch.Tensor], e: BucketSlot) -> torch.Tensor | None:
        dest = targets.get(e.name)
        if (dest is not None and dest.dtype == DTYPES[e.dtype] and list(dest.shape) == e.shape
                and dest.is_contiguous() and dest.device == self.device):
            return dest
        return None

    def finish(self, version: int) -> int:
        """Acknowledge `version` to every stage root (their `finish`)."""
        low = version
        for group in self.groups:
            low = min(low, _ack(group, version, self.device))
        return low


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    """`t` starts where `prev` ends, in the same storage (both contiguous: the sender makes its large
    tensors so, the receiver takes only contiguous targets)."""
    return (t.device == prev.device and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and t.data_ptr() == prev.data_ptr() + nbytes(prev))


def _span(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One uint8 view over tensors that lie back to back in one storage, in order; None if they do not."""
    if any(t is None for t in tensors) or not all(_follows(a, b) for a, b in zip(tensors, tensors[1:])):
        return None
    return _bytes_view(tensors[0]).as_strided((sum(nbytes(t) for t in tensors),), (1,))


def _runs(tensors: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Group consecutive contiguous tensors into runs that lie back to back in one storage:
    (the run index of each tensor, one uint8 view per run)."""
    index: list[int] = []
    groups: list[list[torch.Tensor]] = []
    for t in tensors:
        if groups and _follows(groups[-1][-1], t):
            groups[-1].append(t)
        else:
            groups.append([t])
        index.append(len(groups) - 1)
    return index, [_span(g) for g in groups]


def _run_tail(large: list[tuple[str, torch.Tensor]], t: torch.Tensor, room: int) -> list[tuple[str, torch.Tensor]]:
    """The start of `t`'s run: the last tensors of `large` that `t` continues in memory, when the run starts
    after the first of `large` and they fit in `room` bytes; else [] (nothing to carry, or a run longer than
    a message, which is cut anyway)."""
    tail, nxt, used = [], t, 0
    for name, prev in reversed(large):
        if not _follows(prev, nxt):
            return tail
        used += nbytes(prev)
        if used > room:
            return []
        tail.insert(0, (name, prev))
        nxt = prev
    return []


def _group_runs(entries: list[BucketSlot]) -> list[list[BucketSlot]]:
    runs: list[list[BucketSlot]] = []
    for e in entries:
        if runs and runs[-1][-1].offset == e.offset:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _split(span: torch.Tensor, run: list[BucketSlot]) -> list[tuple[str, torch.Tensor]]:
    """The run's tensors out of its received bytes (views when aligned for their dtype, else copies)."""
    out, offset = [], 0
    for e in run:
        piece = span[offset:offset + e.nbytes]
        dtype = DTYPES[e.dtype]
        if (piece.data_ptr() % dtype.itemsize) != 0:
            piece = piece.clone()
        out.append((e.name, piece.view(dtype).view(e.shape)))
        offset += e.nbytes
    return out


class SyncFailed(RuntimeError):
    """A broadcast sync that did not reach every worker (a peer died or stalled past the group's timeout, or a
    server's receive call failed). The group is torn down; the caller forms a new one (the next generation) with
    the workers left and sends again (megapo.trainer.fleet.sync_broadcast)."""


class BroadcastTransport(Transport):
    """Learner side. `sender` only on a stage root (None on the other learner ranks, which drain). The engines
    passed to a sync, if any, are servers whose workers joined the groups (`join_weight_groups`): the sync
    calls their `receive_weights(version)`. Engine workers in other processes (tests, benchmarks) receive on
    their own and are not passed. `timeout_s`: how long a sync waits for the engines' receive calls (after the
    sender is done, or once a failed group is torn down).

    A failed send raises SyncFailed after tearing the group down (aborted and released, which closes its
    connections, so the surviving workers fail at once instead of at the group's timeout); `broken` is then
    True until `replace_sender` installs the next generation's group."""

    name = "broadcast"
    per_stage = True

    def __init__(self, sender: BroadcastSender | None, stores: list | None = None, timeout_s: float = 600.0,
                 address: GroupAddress | None = None):
        self.sender = sender
        self.stores = stores or []  # rendezvous stores this rank serves (host_stores), kept alive with it
        self.timeout_s = timeout_s
        self.address = address  # the groups' address and generation (None: not known to this transport)
        self.broken = False
        # set by megapo.trainer.fleet.form_groups: the rendezvous port, the last generation formed (or tried) and
        # rank 0's Router members the groups were formed for
        self.port = address.base_port if address is not None else 0
        self.generation = address.generation if address is not None else -1
        self.formed_for: tuple | None = None

    def replace_sender(self, sender: BroadcastSender | None, address: GroupAddress) -> None:
        """Use a new generation's group (the old one, if any, is torn down first)."""
        self.teardown()
        self.sender, self.address, self.broken = sender, address, False

    def teardown(self) -> None:
        if self.sender is not None:
            self.sender.abort()
            self.sender = None
        self.broken = True

    def send(self, named, engines, bucket_bytes, version, dtype) -> Moved:
        # engines given on this rank are servers whose workers receive (VLLMEngine, Router): each is told to
        # receive first, from its own thread (the call returns once its workers have loaded the weights)
        if self.broken:
            raise SyncFailed("broadcast: the weight-sync group was torn down by a failed sync; form the next one")
        receiving = [daemon_call(engine.receive_weights, version) for engine in engines]
        failed = None
        try:
            moved = self._send(named, bucket_bytes, version, dtype)
        except SyncFailed as err:
            failed = err
        if failed is not None:  # outside the except block: no traceback frame keeps the group alive
            self.teardown()  # the workers still in the group fail now, not at its timeout
            _settle(receiving, self.timeout_s)
            raise failed
        _settle(receiving, self.timeout_s)
        for future in receiving:
            err = None if future.done() else TimeoutError(f"no answer within {self.timeout_s:g} s")
            err = err or future.exception()
            if err is not None:
                self.teardown()
                raise SyncFailed(f"broadcast of weight version {version}: a server's receive failed: "
                                 f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}") from err
        return moved

    def _send(self, named, bucket_bytes, version, dtype) -> Moved:
        if self.sender is None:
            return drain(named)
        failure = None
        try:
            moved = self.sender.send(named, bucket_bytes, version, dtype)
            acked = self.sender.finish(version)
        except RuntimeError as err:  # gloo/NCCL (DistBackendError): a peer closed, reset or timed out
            failure = str(err).splitlines()[0][:300]
        if failure is not None:
            # raised outside the except block: the gloo error's traceback (frames holding the group) is gone, so
            # tearing the group down closes its connections (else the survivors wait out the group's timeout)
            raise SyncFailed(f"broadcast of weight version {version} failed: {failure}")
        if acked != version:
            raise RuntimeError(f"broadcast: an engine worker acknowledged weight version {acked}, expected {version}")
        return moved


def daemon_call(fn, *args, name: str = "megapo-receive"):
    """fn(*args) in a daemon thread, as a Future: a call left behind on a stalled server (its own HTTP timeout
    ends it) neither blocks a pool's worker nor keeps the process from exiting."""
    import concurrent.futures
    import threading

    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _settle(futures: list, timeout_s: float) -> None:
    """Wait at most timeout_s in all for `futures` to finish (their errors are read by the caller)."""
    import concurrent.futures

    if futures:
        concurrent.futures.wait(futures, timeout=timeout_s)

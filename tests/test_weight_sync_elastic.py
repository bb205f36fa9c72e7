"""Broadcast weight sync when a receiver dies (megapo.weights.broadcast, issue 18): two receiver processes join a
gloo group; one is SIGKILLed while the sync is on the wire. The sender fails at once with SyncFailed and tears the
group down, so the survivor's wait ends at once too (not at the group's timeout); then the next generation of the
group is formed on the same rendezvous store with the survivor alone and the resend arrives intact."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from megapo.net import free_port
from megapo.weights.broadcast import (BroadcastReceiver, BroadcastSender, BroadcastTransport, GroupAddress, SyncFailed,
                                      host_stores, join_group)

GROUP_TIMEOUT_S = 30.0  # what a survivor would wait without the teardown


def tensors():
    g = torch.Generator().manual_seed(0)
    small = [(f"layer.{i}.norm", torch.randn(64, generator=g)) for i in range(40)]
    large = [(f"layer.{i}.weight", torch.randn(256, 512, generator=g)) for i in range(8)]
    return small + large


def receiver(port, rank, workers, generation, results, timeout_s=GROUP_TIMEOUT_S):
    address = GroupAddress("127.0.0.1", port, workers, timeout_s=timeout_s, generation=generation)
    results.put((rank, generation, "joining", None, time.monotonic()))  # started (imports done): the sender may join
    group = join_group(address, 0, rank, host_store=False)
    results.put((rank, generation, "joined", None, time.monotonic()))
    got = {}
    try:
        version, _ = BroadcastReceiver([group]).receive(
            lambda named, v: got.update({n: t.clone() for n, t in named}) or time.sleep(0.005))
        BroadcastReceiver([group]).finish(version)
        # numpy arrays travel by value (torch tensors would be shared through a handle that ends with this process)
        results.put((rank, generation, "ok", {n: t.numpy() for n, t in got.items()}, time.monotonic()))
    except Exception as err:  # noqa: BLE001
        results.put((rank, generation, f"error: {str(err).splitlines()[0][:200]}", None, time.monotonic()))


def test_a_receiver_killed_mid_sync_fails_the_sync_at_once_and_the_next_generation_reaches_the_survivor(monkeypatch):
    ctx = mp.get_context("spawn")
    port = free_port("127.0.0.1")
    stores = host_stores(GroupAddress("127.0.0.1", port, 1, timeout_s=GROUP_TIMEOUT_S), 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(port, r, 2, 0, results)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        assert {results.get(timeout=120)[2] for _ in procs} == {"joining"}
        address = GroupAddress("127.0.0.1", port, 2, timeout_s=GROUP_TIMEOUT_S)
        transport = BroadcastTransport(BroadcastSender(join_group(address, 0, 0, host_store=False)), stores,
                                       timeout_s=GROUP_TIMEOUT_S, address=address)
        assert {results.get(timeout=60)[2] for _ in procs} == {"joined"}
        victim, survivor = procs
        original = BroadcastSender._payload
        killed = {}

        def kill_then_payload(self, msg):  # the first payload: headers are on the wire
            if not killed:
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(10)
                killed["at"] = time.monotonic()
            return original(self, msg)

        monkeypatch.setattr(BroadcastSender, "_payload", kill_then_payload)
        with pytest.raises(SyncFailed, match="weight version 1"):
            transport.send(iter(tensors()), [], 1 << 20, 1, None)
        failed_after = time.monotonic() - killed["at"]
        assert transport.broken and transport.sender is None
        rank, generation, status, _, at = results.get(timeout=60)
        assert (rank, generation) == (2, 0) and status.startswith("error"), status
        print(f"sender failed {failed_after:.2f} s after the kill, the survivor {at - killed['at']:.2f} s")
        assert failed_after < 5 and at - killed["at"] < 5  # not the group's 30 s timeout
        with pytest.raises(SyncFailed, match="torn down"):  # a broken transport refuses until re-formed
            transport.send(iter(tensors()), [], 1 << 20, 1, None)

        # generation 1: the survivor alone, on the same rendezvous store
        monkeypatch.setattr(BroadcastSender, "_payload", original)
        again = ctx.Process(target=receiver, args=(port, 1, 1, 1, results))
        again.start()
        procs.append(again)
        assert results.get(timeout=120)[2] == "joining"
        address = GroupAddress("127.0.0.1", port, 1, timeout_s=GROUP_TIMEOUT_S, generation=1)
        transport.replace_sender(BroadcastSender(join_group(address, 0, 0, host_store=False)), address)
        assert results.get(timeout=60)[2] == "joined"
        moved = transport.send(iter(tensors()), [], 1 << 20, 1, None)
        rank, generation, status, got, _ = results.get(timeout=60)
        assert (rank, generation, status) == (1, 1, "ok")
        sent = dict(tensors())
        assert moved.tensors == len(sent) and set(got) == set(sent)
        assert all(torch.equal(torch.from_numpy(got[n]), t) for n, t in sent.items())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def test_a_stalled_receiver_fails_the_sync_after_the_group_timeout_not_later(monkeypatch):
    """A receiver that stops answering (SIGSTOP: alive, silent) costs the sender one group operation timeout."""
    ctx = mp.get_context("spawn")
    port = free_port("127.0.0.1")
    timeout_s = 3.0
    stores = host_stores(GroupAddress("127.0.0.1", port, 1, timeout_s=timeout_s), 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(port, r, 2, 0, results, timeout_s)) for r in (1, 2)]
    for p in procs:
        p.start()
    try:
        # the group forms within timeout_s only once both receivers have started (a spawned process imports torch
        # first: seconds on a loaded machine), so the sender joins when they say they are joining
        assert {results.get(timeout=120)[2] for _ in procs} == {"joining"}
        address = GroupAddress("127.0.0.1", port, 2, timeout_s=timeout_s)
        transport = BroadcastTransport(BroadcastSender(join_group(address, 0, 0, host_store=False)), stores,
                                       timeout_s=timeout_s, address=address)
        assert {results.get(timeout=60)[2] for _ in procs} == {"joined"}
        os.kill(procs[0].pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(SyncFailed, match="weight version 1"):
            transport.send(iter(tensors()), [], 1 << 20, 1, None)
        took = time.monotonic() - start
        print(f"the sync failed {took:.2f} s after it started (group timeout {timeout_s} s)")
        assert timeout_s * 0.9 < took < timeout_s + 3
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)

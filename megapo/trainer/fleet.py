"""The elastic engine fleet (issue 18): servers join and leave a running job.

Membership lives in the Router (megapo.engines.router: `add_server` / `drop_server`; each server joining ->
serving, or dropped, with the weight version it holds; requests go only to servers holding the current version).
This module is the trainer's side of it:

- `Fleet` (rank 0): the run's servers are `rollout.servers` plus the lines of `rollout.servers_file`, which is
  read again at every weight sync (the step boundary). An address new to the fleet is checked (health, and for
  vLLM the API key of `rollout.api_key_file`) and added as joining; an address gone from both is dropped. The
  sync that follows brings the joiners to the new version before their first request: joining costs no extra
  transfer, and no request ever reaches a server holding other weights than the Router's.
- `sync_in_time` (every learner rank, collective): one weight sync, bounded by `rollout.sync_timeout_s`. The
  Router drops a server whose reload (disk) or receive (broadcast) loses its connection, fails while the server
  no longer answers its health check, or gives no answer in time. For a broadcast the weight-sync groups are
  formed for the fleet's members; a membership change forms the next generation first (every member's workers
  and every learner stage root join it on the same rendezvous stores, megapo.weights.broadcast.GroupAddress
  .generation), and a failed send tears the group down (its connections close, so the survivors fail at once),
  drops the dead servers, forms the next generation with the others and sends again. The gloo/NCCL groups time
  out each operation after a third of the timeout, so a stuck peer costs at most that; a sync that cannot
  finish in time raises SyncTimeout.

Why a file and no registration endpoint on the trainer: a file needs no second listening port on the trainer
(which would need its own key and its own exposure rules, like the servers' guard), works the same from a shell,
a Slurm job step or a cluster scheduler (append a line; delete it to retire a server), and survives a trainer
restart (`--resume` reads it again). Programs in the trainer's process call `Router.add_server` directly.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megapo.config import ConfigError
from megapo.dist import any_rank, broadcast_object, rank
from megapo.engines.base import Engine
# the servers file is read where the rollout section is checked (megapo/engines/config.py); importable from here
from megapo.engines.config import SERVERS_FILE, read_servers_file  # noqa: F401
from megapo.learner.protocol import Learner

log = logging.getLogger(__name__)


class SyncTimeout(RuntimeError):
    """A weight sync that could not complete within rollout.sync_timeout_s."""


class Fleet:
    """Rank 0's view of the fleet: keeps the Router's members equal to rollout.servers + rollout.servers_file.
    `make_client(address)` returns a checked engine client for host:port (raises when the server is not usable)."""

    def __init__(self, router, servers: list[str], servers_file: str, make_client):
        self.router, self.servers, self.servers_file, self.make_client = router, list(servers), servers_file, make_client
        self._reported = (router.joined, router.dropped)
        self._refused: dict[str, str] = {}  # address -> why it was not added (logged when the reason changes)

    def wanted(self) -> list[str] | None:
        """The addresses the fleet should hold now; None when the file cannot be read (the fleet stays as it is)."""
        if not self.servers_file:
            return list(self.servers)
        try:
            listed = read_servers_file(self.servers_file)
        except ConfigError as err:
            log.warning("fleet: %s; the fleet stays as it is", err)
            return None
        return list(dict.fromkeys(self.servers + listed))

    def refresh(self) -> None:
        """Drop the members no longer wanted, add the wanted addresses that are not members (as joining)."""
        wanted = self.wanted()
        if wanted is None:
            return
        members = {self.router.names[k]: k for k in self.router.members()}
        for name, k in members.items():
            if name not in wanted:
                self.router.drop_server(k, f"no longer in rollout.servers or {SERVERS_FILE}")
        for name in wanted:
            if name in members:
                continue
            try:
                client = self.make_client(name)
            except Exception as err:  # noqa: BLE001 - a listed server that is not up (yet): try again next sync
                why = f"{type(err).__name__}: {err}"
                if self._refused.get(name) != why:
                    log.warning("fleet: %s not added: %s", name, why)
                self._refused[name] = why
                continue
            self._refused.pop(name, None)
            self.router.add_server(client, name)

    def metrics(self) -> dict:
        """fleet/servers (serving now), fleet/joined and fleet/dropped (since the last call)."""
        joined, dropped = self.router.joined, self.router.dropped
        out = {"fleet/servers": len(self.router.serving()), "fleet/joined": joined - self._reported[0],
               "fleet/dropped": dropped - self._reported[1]}
        self._reported = (joined, dropped)
        return out


def make_fleet(cfg, model_dir: Path, engine: Engine) -> Fleet | None:
    """The fleet of a run whose engine is a Router (rank 0), else None."""
    from megapo.engines.router import Router
    from megapo.trainer.engine_setup import checked_client

    if not isinstance(engine, Router):
        return None
    return Fleet(engine, cfg.rollout.servers, cfg.rollout.servers_file,
                 lambda address: checked_client(cfg, model_dir, address))


# ----------------------------------------------------------------------------- weight sync


def group_timeout_s(cfg) -> float:
    """Each broadcast group operation's timeout: a third of rollout.sync_timeout_s, so a stuck peer is found with
    time left to form the next group and send again."""
    return max(1.0, cfg.rollout.sync_timeout_s / 3)


def sync_in_time(learner: Learner, engine: Engine, version: int, cfg, transport, fleet: Fleet | None = None) -> dict:
    """One weight sync (collective on the learner ranks; rank 0 owns the engine and the fleet), bounded by
    rollout.sync_timeout_s. Returns the sync and fleet metrics."""
    from megapo.weights import bucket_bytes, sync_named
    from megapo.weights.broadcast import BroadcastTransport

    deadline = time.monotonic() + cfg.rollout.sync_timeout_s
    router = fleet.router if fleet is not None else None
    if router is not None:
        router.deadline = deadline
    named = learner.stage_tensors if transport.per_stage else learner.hf_state_dict
    engines = [engine] if engine is not None else []
    size = bucket_bytes(cfg.rollout.bucket_mb, "rollout.bucket_mb")
    try:
        if fleet is not None:
            fleet.refresh()
        if isinstance(transport, BroadcastTransport):
            stats = _sync_broadcast(learner, engine, router, named, version, cfg, transport, size, deadline)
        else:  # a bf16 / fp16 learner's weights travel in its dtype (half of fp32's bytes, nothing rounded)
            dtype = cfg.train.precision_spec().dtype if cfg.train.precision != "fp32" else None
            stats = sync_named(named(), engines, transport, size, version, dtype=dtype)
    finally:
        if router is not None:
            router.deadline = None
    out = {"sync/bytes": stats.bytes, "sync/buckets": stats.buckets}
    if fleet is not None:
        out.update(fleet.metrics())
    return out


def _sync_broadcast(learner: Learner, engine: Engine, router, named, version, cfg, transport, size, deadline):
    from megapo.engines.router import ServersLost
    from megapo.weights import sync_named
    from megapo.weights.broadcast import SyncFailed

    attempt, last = 0, None
    while True:
        attempt += 1
        if rank() == 0:
            changed = router is not None and tuple(router.members()) != transport.formed_for
            # another attempt may wait a group timeout (a stuck peer): only start one that can end in time
            plan = (changed, deadline - time.monotonic() < (group_timeout_s(cfg) if attempt > 1 else 0))
        plan = broadcast_object(plan if rank() == 0 else None)
        if plan[1]:  # the same decision on every rank
            raise SyncTimeout(f"the weight sync of version {version} did not complete within rollout.sync_timeout_s="
                              f"{cfg.rollout.sync_timeout_s:g} s ({attempt - 1} attempt(s); last: {last})")
        failed = False
        if any_rank(plan[0] or transport.broken):
            failed = not form_groups(cfg, learner, engine, transport)
        if not any_rank(failed):
            try:
                return sync_named(named(), [engine] if engine is not None else [], transport, size, version)
            except (SyncFailed, ServersLost) as err:
                failed, last = True, f"{type(err).__name__}: {err}"
            if not any_rank(failed):  # another rank's stage failed: every rank sends again
                raise AssertionError("unreachable")
        transport.teardown()
        if router is not None:  # a stalled server (no answer) is dropped too, not only one whose connection broke
            router.drop_unhealthy("no answer to its health check after a failed weight sync")
        if rank() == 0:
            log.warning("weight sync of version %d failed (attempt %d: %s); forming the weight-sync group again with "
                        "the servers left", version, attempt, last or "another rank's group failed")


def form_groups(cfg, learner: Learner, engine: Engine, transport) -> bool:
    """Form the next generation of weight-sync groups (collective): every stage root joins its stage's group as
    rank 0 while rank 0 has the engine's workers (a Router: its members') join as ranks 1... False when it failed
    (a server that did not join is dropped by the Router; the caller tries again)."""
    from megapo.engines.router import Router
    from megapo.weights.broadcast import BroadcastSender, GroupAddress, join_group

    r = cfg.rollout
    stage, stages, root = learner.sync_stage()
    transport.generation += 1  # a generation tried once is never reused: its rendezvous keys are taken
    workers = broadcast_object(engine.workers if rank() == 0 else None)
    if workers < 1:
        from megapo.engines.router import NoLiveEngine

        raise NoLiveEngine("no server left in the fleet to receive the weights")
    address = GroupAddress(r.sync_host, transport.port, workers, timeout_s=group_timeout_s(cfg),
                           generation=transport.generation)
    transport.teardown()
    group, error = None, None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="megapo-join") as pool:
            joined = pool.submit(engine.join_weight_groups, address, 1, stages) if engine is not None else None
            try:
                group = join_group(address, stage, 0, host_store=False) if root else None
            finally:
                if joined is not None:
                    joined.result()
    except Exception as err:  # noqa: BLE001 - a server died or stalled while joining: the caller forms the next one
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
    if error is not None:
        group = None
        log.warning("weight sync: forming group generation %d failed: %s", address.generation, error)
        return False
    transport.replace_sender(BroadcastSender(group) if root else None, address)
    members = engine.group if isinstance(engine, Router) else None
    transport.formed_for = tuple(members) if members is not None else None
    log.info("weight sync: broadcast group generation %d formed on %s:%d (%d stage(s), %d engine worker(s))",
             address.generation, r.sync_host, transport.port, stages, workers)
    return True

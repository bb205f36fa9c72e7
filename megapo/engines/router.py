"""Router: one Engine over several engines (servers), balancing samples and surviving a dead server.

Every sample has an id (prompt i, sample j) and, when the batch has a seed, its own seed `seed + i*n + j` (the
seed a single VLLMEngine/vLLM server gives it). Requests carry `samples_per_request` consecutive samples of one
prompt (default: all n, one request per prompt, as fast as a plain client; 1: one request per sample); a request
for samples j0.. is sent with seed `seed + i*n + j0`, and vLLM/SGLang seed its k-th sample with that + k, so a
sample does not depend on which server ran it. Each request goes to the live engine with the fewest requests in
flight. A request that gets no answer (connection refused/reset/timed out) marks its engine dead and is sent
again to a live one; a result is accepted once per sample id, so the batch returns every sample exactly once.
Dead engines are health-checked again at the start of every batch.

Sessions (multi-turn rollouts, megapo/envs/rollout.py): `generate(..., sessions=keys)` gives each prompt a key;
a key's requests go to the engine that served its first one while that engine lives (its prefix cache holds the
trajectory so far), and to the least busy live one otherwise (then that one keeps it). `end_sessions(keys)`
forgets them.

Weight updates, pause, resume and preempt (partial rollouts: each engine continues its own cut samples) go to every
live engine; max_versions is set on every engine, joining ones included.

Membership (the elastic fleet, megapo.trainer.fleet): engines can join (`add_server`) and leave (`drop_server`) a
running Router. Each has a state -- joining (added, not holding the Router's weights yet), serving, dropped -- and
the weight version it holds; requests go only to live serving engines that hold the Router's current version, so
a joining server is used only after a weight update reached it. A weight update that fails on a dead server
(connection lost, or no answer within `sync_timeout_s`) drops that server with a warning and completes for the
others; a dropped server never takes requests again (it may join anew under its address).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from megapo.engines.base import Engine, EngineCapabilities, Sample, SamplingParams, check_prompts
from megapo.engines.http import ConnectionLost
from megapo.weights.broadcast import daemon_call

log = logging.getLogger(__name__)

JOINING, SERVING, DROPPED = "joining", "serving", "dropped"


class NoLiveEngine(RuntimeError):
    pass


class ServersLost(RuntimeError):
    """A weight update that did not reach some servers: they are dropped (`dropped`: their indices) and the update
    stands for the others; for a broadcast the group has to be formed again without them."""

    def __init__(self, message: str, dropped: list[int]):
        super().__init__(message)
        self.dropped = dropped


class Router(Engine):

    def __init__(self, engines: list[Engine], *, max_in_flight_per_engine: int = 64, weight_version: int = 0,
                 samples_per_request: int | None = None, names: list[str] | None = None, sync_timeout_s: float = 600.0):
        """engines: the servers at the start, serving `weight_version`. names: their addresses (host:port, for logs
        and the fleet; default their urls). sync_timeout_s: the longest a weight update waits for a server before
        dropping it."""
        if not engines:
            raise ValueError("engines must be a non-empty list")
        if sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s must be > 0, got {sync_timeout_s}")
        if names is not None and len(names) != len(engines):
            raise ValueError(f"names: {len(names)} for {len(engines)} engines")
        if samples_per_request is not None and samples_per_request < 1:
            raise ValueError(f"samples_per_request must be >= 1 or None, got {samples_per_request}")
        self.samples_per_request = samples_per_request
        if max_in_flight_per_engine < 1:
            raise ValueError(f"max_in_flight_per_engine must be >= 1, got {max_in_flight_per_engine}")
        # one entry per engine ever added, in order (indices stay valid after a drop)
        self.engines = list(engines)
        self.names = list(names) if names is not None else [getattr(e, "url", f"engine{k}") for k, e in enumerate(engines)]
        self.in_flight = [0] * len(engines)
        self.alive = [True] * len(engines)
        self.served = [0] * len(engines)  # samples accepted per engine (for tests and logs)
        self.state = [SERVING] * len(engines)
        self.versions = [int(weight_version)] * len(engines)  # the weight version each engine holds (-1: unknown)
        self.retries = 0
        self.joined = self.dropped = 0  # engines added / dropped since the start
        self.sync_timeout_s = float(sync_timeout_s)
        self.group: list[int] | None = None  # broadcast: the members whose workers formed the weight-sync groups
        self.deadline: float | None = None  # time.monotonic() by which a weight update ends (set by the trainer)
        self._sessions: dict = {}  # session key -> the engine serving it
        self._max_versions = 0  # partial rollouts (the max_versions property)
        self.weight_version = int(weight_version)
        self._lock = threading.Lock()
        self._per_engine = max_in_flight_per_engine
        self._capacity = threading.Semaphore(max_in_flight_per_engine * len(engines))
        self._pool = ThreadPoolExecutor(max_in_flight_per_engine * len(engines), thread_name_prefix="megapo-router")

    # ------------------------------------------------------------------------------------------ membership
    def add_server(self, engine: Engine, name: str | None = None) -> int:
        """A server joins: it takes requests once a weight update gives it the Router's current version (the
        trainer's next sync). Returns its index."""
        with self._lock:
            self.engines.append(engine)
            if self._max_versions:  # set by a partial-rollout run (only on engines that declare partial)
                engine.max_versions = self._max_versions
            self.names.append(name or getattr(engine, "url", f"engine{len(self.engines) - 1}"))
            self.in_flight.append(0)
            self.alive.append(True)
            self.served.append(0)
            self.state.append(JOINING)
            self.versions.append(-1)
            self.joined += 1
            self._pool._max_workers += self._per_engine  # noqa: SLF001 - threads start lazily up to this
            self._capacity.release(self._per_engine)
            k = len(self.engines) - 1
        log.info("fleet: %s joins (serves once it holds the current weights)", self.names[k])
        return k

    def drop_server(self, k: int, reason: str) -> None:
        """Take engine k out of the fleet for good (warns with `reason`); its client is closed."""
        with self._lock:
            if self.state[k] == DROPPED:
                return
            self.state[k] = DROPPED
            self.alive[k] = False
            self.dropped += 1
            self._sessions = {key: e for key, e in self._sessions.items() if e != k}
        log.warning("fleet: dropped %s: %s", self.names[k], reason)
        try:
            self.engines[k].close()
        except Exception:  # noqa: BLE001 - a dead server's client may fail to close; it is gone either way
            pass

    def drop_unhealthy(self, reason: str) -> list[int]:
        """Health-check every member at once and drop those that do not answer; returns their indices."""
        ks = self.members()
        if not ks:
            return []
        with ThreadPoolExecutor(len(ks), thread_name_prefix="megapo-router-health") as pool:
            healthy = list(pool.map(self._healthy, ks))
        bad = [k for k, ok in zip(ks, healthy) if not ok]
        for k in bad:
            self.drop_server(k, reason)
        return bad

    def members(self) -> list[int]:
        """Engines in the fleet (joining or serving, not dropped), in order."""
        return [k for k in range(len(self.engines)) if self.state[k] != DROPPED]

    def serving(self) -> list[int]:
        """Engines that take requests now: live, serving, holding the current weights."""
        return [k for k in range(len(self.engines)) if self._eligible(k)]

    def _eligible(self, k: int) -> bool:
        return self.alive[k] and self.state[k] == SERVING and self.versions[k] == self.weight_version

    def _loaded(self, ks: list[int], version: int) -> None:
        with self._lock:
            for k in ks:
                if self.state[k] != DROPPED:
                    self.versions[k] = int(version)
                    self.state[k] = SERVING
            self.weight_version = int(version)

    @property
    def capabilities(self) -> EngineCapabilities:
        """What every engine behind it can do, and sessions (each trajectory stays on one server)."""
        caps = [e.capabilities for e in self.engines]
        routes = "yes" if all(c.routes == "yes" for c in caps) else \
            "cuda" if all(c.routes in ("yes", "cuda") for c in caps) else "no"
        return EngineCapabilities(
            weight_syncs=tuple(s for s in caps[0].weight_syncs if all(s in c.weight_syncs for c in caps)),
            routes=routes, routes_note="; ".join(sorted({c.routes_note for c in caps if c.routes_note})),
            api_key=any(c.api_key for c in caps), sessions=True, partial=all(c.partial for c in caps),
            router_noise=all(c.router_noise for c in caps), default_dtype=caps[0].default_dtype)

    @property
    def max_versions(self) -> int:
        """Partial rollouts: the most weight versions one sample may span (0: no bound), on every engine."""
        return self._max_versions

    @max_versions.setter
    def max_versions(self, value: int) -> None:
        self._max_versions = int(value)
        for engine in self.engines:
            engine.max_versions = self._max_versions

    # ------------------------------------------------------------------------------------------ routing
    def _acquire(self, exclude: set[int], prefer: int | None = None) -> int:
        with self._lock:
            live = [k for k in range(len(self.engines)) if self._eligible(k) and k not in exclude]
            if not live:
                live = [k for k in range(len(self.engines)) if self._eligible(k)]
            if not live:
                raise NoLiveEngine("no live engine left to serve the batch")
            k = prefer if prefer in live else min(live, key=lambda e: self.in_flight[e])
            self.in_flight[k] += 1
            return k

    def _release(self, k: int) -> None:
        with self._lock:
            self.in_flight[k] -= 1

    def _mark_dead(self, k: int) -> None:
        with self._lock:
            self.alive[k] = False

    def _run(self, prompt: list[int], params: SamplingParams, prefer: int | None = None) -> tuple[int, list[Sample]]:
        """One request (params.n samples of one prompt), retried on another engine while engines die under it;
        `prefer`: the engine to ask first (a session's) while it is alive."""
        tried: set[int] = set()
        while True:
            k = self._acquire(tried, prefer)
            try:
                [samples] = self.engines[k].generate([prompt], params)
                if len(samples) != params.n:
                    raise RuntimeError(f"engine {k} returned {len(samples)} samples for n={params.n}")
                return k, samples
            except Exception as err:  # noqa: BLE001 - decide below whether the engine or the request failed
                if not isinstance(err, ConnectionLost) and self._healthy(k):
                    raise  # the engine is up and rejected the request: a real error, not a dead server
                self._mark_dead(k)
                tried.add(k)
                with self._lock:
                    self.retries += 1
            finally:
                self._release(k)

    def _healthy(self, k: int) -> bool:
        try:
            return bool(self.engines[k].health())
        except Exception:  # noqa: BLE001
            return False

    def revive(self) -> None:
        """Health-check engines marked dead; those that answer take requests again."""
        for k in range(len(self.engines)):
            if not self.alive[k] and self.state[k] != DROPPED and self._healthy(k):
                with self._lock:
                    self.alive[k] = True

    def end_sessions(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._sessions.pop(key, None)

    def generate(self, prompts: list[list[int]], params: SamplingParams, sessions: list | None = None
                 ) -> list[list[Sample]]:
        check_prompts(prompts)
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"sessions: {len(sessions)} keys for {len(prompts)} prompts")
        self.revive()
        n = params.n
        results: dict[tuple[int, int], Sample] = {}
        accept = threading.Lock()

        def task(i: int, j0: int, count: int) -> None:
            seed = None if params.seed is None else params.seed + i * n + j0
            key = None if sessions is None else sessions[i]
            try:
                k, samples = self._run(list(prompts[i]), replace(params, n=count, seed=seed), self._sessions.get(key))
            finally:
                self._capacity.release()
            if key is not None:  # the engine that served it (the preferred one unless that one died)
                with self._lock:
                    self._sessions[key] = k
            with accept:
                for j, sample in zip(range(j0, j0 + count), samples):
                    if (i, j) not in results:  # a result is accepted once per id
                        results[(i, j)] = sample
                        self.served[k] += 1

        chunk = self.samples_per_request or n
        futures = []
        for i in range(len(prompts)):
            for j0 in range(0, n, chunk):
                self._capacity.acquire()
                futures.append(self._pool.submit(task, i, j0, min(chunk, n - j0)))
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        missing = [(i, j) for i in range(len(prompts)) for j in range(n) if (i, j) not in results]
        if missing:
            raise RuntimeError(f"router lost samples {missing[:5]}")
        return [[results[(i, j)] for j in range(n)] for i in range(len(prompts))]

    # ------------------------------------------------------------------------------------------ weights
    def _live(self) -> list[int]:
        live = [k for k in self.members() if self.alive[k]]
        if not live:
            raise NoLiveEngine("no live engine")
        return live

    def _wait_s(self) -> float:
        """How long a weight-update call may wait: sync_timeout_s, or less when the trainer set a deadline."""
        if self.deadline is None:
            return self.sync_timeout_s
        return max(0.0, min(self.sync_timeout_s, self.deadline - time.monotonic()))

    def _each(self, ks: list[int], call, what: str, refuse: bool = True) -> tuple[list[int], list[int]]:
        """call(engine, k) on engines `ks` at once, waiting at most _wait_s(): (those that returned, those dropped).
        An engine whose call lost its connection, or that gave no answer in time, or that failed and no longer
        answers its health check, is dropped with a warning; a live engine that refused the call raises (with
        refuse=False it only counts as not done)."""
        if not ks:
            return [], []
        futures = {k: daemon_call(call, self.engines[k], k, name="megapo-router-sync") for k in ks}
        concurrent.futures.wait(futures.values(), timeout=self._wait_s())  # a call still running is left behind
        done, lost, refused = [], [], None
        for k, future in futures.items():
            if not future.done():
                lost.append((k, f"no answer to {what} in time (sync_timeout_s={self.sync_timeout_s:g} s)"))
                continue
            err = future.exception()
            if err is None:
                done.append(k)
            elif isinstance(err, ConnectionLost) or not self._healthy(k):
                lost.append((k, f"{what} failed ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"))
            else:
                refused = refused or err
        for k, why in lost:
            self.drop_server(k, why)
        if refused is not None and refuse:
            raise refused
        return done, [k for k, _ in lost]

    def _update(self, call, version: int, what: str) -> None:
        done, dropped = self._each(self._live(), call, what)
        if not done:
            raise NoLiveEngine(f"no server took weight version {version}: every one was dropped")
        self._loaded(done, version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        tensors = list(named_tensors)  # every engine reads the same tensors
        self._update(lambda e, k: e.update_weights(tensors, version), version, f"the update to weight version {version}")

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self._update(lambda e, k: e.update_weights_from_disk(path, version), version,
                     f"the reload of weight version {version}")

    # broadcast: the workers of every member are ranks of the learner's weight-sync groups, member after member
    # (the order of `group`). A membership change (a server joins or is dropped) forms new groups under the next
    # generation: megapo.trainer.run.broadcast_sync.
    @property
    def workers(self) -> int:
        return sum(self._worker_counts(self.members()))

    def _worker_counts(self, ks: list[int]) -> list[int]:
        return [getattr(self.engines[k], "workers", 1) for k in ks]

    def join_weight_groups(self, address, rank_offset: int, stages: int) -> None:
        """The members' workers join `address`'s groups (blocks until the group is whole). A member that fails to
        join is dropped and ServersLost raised: the learner forms the groups again without it."""
        ks = self.members()
        counts = self._worker_counts(ks)
        offsets = {k: rank_offset + sum(counts[:i]) for i, k in enumerate(ks)}
        self.group = ks  # the members whose workers hold the groups, in rank order
        _, dropped = self._each(ks, lambda e, k: e.join_weight_groups(address, offsets[k], stages),
                                f"joining weight-sync group generation {address.generation}")
        if dropped:
            raise ServersLost(f"{len(dropped)} server(s) failed to join the weight-sync group", dropped)

    def receive_weights(self, version: int) -> None:
        """Every member of the group receives one broadcast sync. Members that fail are dropped (ServersLost):
        the others may hold a partial update, so the learner forms the groups again and sends again."""
        ks = [k for k in (self.group if self.group is not None else self.members()) if self.state[k] != DROPPED]
        done, dropped = self._each(ks, lambda e, k: e.receive_weights(version), f"the broadcast of weight version {version}",
                                   refuse=False)
        if dropped or len(done) < len(ks):
            raise ServersLost(f"the broadcast of weight version {version} reached {len(done)} of {len(ks)} server(s) "
                              f"({len(dropped)} dropped)", dropped)
        self._loaded(done, version)

    def pause(self) -> None:
        self._each(self._live(), lambda e, k: e.pause(), "pause")

    def resume(self) -> None:
        live = [k for k in self.members() if self.alive[k]]  # after a sync that dropped every server: nothing
        self._each(live, lambda e, k: e.resume(), "resume")

    def preempt(self) -> None:
        """Partial rollouts: every live engine cuts its requests in flight; each continues its own samples once
        resumed (the trainer's weight update follows)."""
        self._each(self._live(), lambda e, k: e.preempt(), "preempt")

    def health(self) -> bool:
        return any(self._healthy(k) for k in self.members())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for k in self.members():
            self.engines[k].close()

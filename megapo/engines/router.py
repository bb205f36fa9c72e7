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

Weight updates, pause and resume go to every live engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from megapo.engines.base import Engine, EngineCapabilities, Sample, SamplingParams, check_prompts
from megapo.engines.http import ConnectionLost


class NoLiveEngine(RuntimeError):
    pass


class Router(Engine):

    def __init__(self, engines: list[Engine], *, max_in_flight_per_engine: int = 64, weight_version: int = 0,
                 samples_per_request: int | None = None):
        if not engines:
            raise ValueError("engines must be a non-empty list")
        if samples_per_request is not None and samples_per_request < 1:
            raise ValueError(f"samples_per_request must be >= 1 or None, got {samples_per_request}")
        self.samples_per_request = samples_per_request
        if max_in_flight_per_engine < 1:
            raise ValueError(f"max_in_flight_per_engine must be >= 1, got {max_in_flight_per_engine}")
        self.engines = list(engines)
        self.in_flight = [0] * len(engines)
        self.alive = [True] * len(engines)
        self.served = [0] * len(engines)  # samples accepted per engine (for tests and logs)
        self.retries = 0
        self._sessions: dict = {}  # session key -> the engine serving it
        self.weight_version = int(weight_version)
        self._lock = threading.Lock()
        self._capacity = threading.Semaphore(max_in_flight_per_engine * len(engines))
        self._pool = ThreadPoolExecutor(max_in_flight_per_engine * len(engines), thread_name_prefix="megapo-router")

    @property
    def capabilities(self) -> EngineCapabilities:
        """What every engine behind it can do, and sessions (each trajectory stays on one server)."""
        caps = [e.capabilities for e in self.engines]
        routes = "yes" if all(c.routes == "yes" for c in caps) else \
            "cuda" if all(c.routes in ("yes", "cuda") for c in caps) else "no"
        return EngineCapabilities(
            weight_syncs=tuple(s for s in caps[0].weight_syncs if all(s in c.weight_syncs for c in caps)),
            routes=routes, routes_note="; ".join(sorted({c.routes_note for c in caps if c.routes_note})),
            api_key=any(c.api_key for c in caps), sessions=True, default_dtype=caps[0].default_dtype)

    # ------------------------------------------------------------------------------------------ routing
    def _acquire(self, exclude: set[int], prefer: int | None = None) -> int:
        with self._lock:
            live = [k for k in range(len(self.engines)) if self.alive[k] and k not in exclude]
            if not live:
                live = [k for k in range(len(self.engines)) if self.alive[k]]
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
            if not self.alive[k] and self._healthy(k):
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

    # ------------------------------------------------------------------------------------------ broadcast
    def _live(self) -> list[Engine]:
        live = [e for k, e in enumerate(self.engines) if self.alive[k]]
        if not live:
            raise NoLiveEngine("no live engine")
        return live

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        tensors = list(named_tensors)  # every engine reads the same tensors
        for engine in self._live():
            engine.update_weights(tensors, version)
        self.weight_version = int(version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        for engine in self._live():
            engine.update_weights_from_disk(path, version)
        self.weight_version = int(version)

    # broadcast: every engine's workers are ranks of the learner's weight-sync groups, engine after engine.
    # The group is fixed when joined: a server that dies stops the broadcast (its gloo timeout), use `disk`
    # for servers that come and go.
    @property
    def workers(self) -> int:
        return sum(self._worker_counts())

    def _worker_counts(self) -> list[int]:
        return [getattr(e, "workers", 1) for e in self.engines]

    def join_weight_groups(self, address, rank_offset: int, stages: int) -> None:
        counts = self._worker_counts()
        self._all(lambda e, k: e.join_weight_groups(address, rank_offset + sum(counts[:k]), stages))

    def receive_weights(self, version: int) -> None:
        self._all(lambda e, k: e.receive_weights(version))
        self.weight_version = int(version)

    def _all(self, call) -> None:
        """call(engine, index) on every engine at once (each blocks until the whole group takes part)."""
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="megapo-router-sync") as pool:
            for future in [pool.submit(call, e, k) for k, e in enumerate(self.engines)]:
                future.result()

    def pause(self) -> None:
        for engine in self._live():
            engine.pause()

    def resume(self) -> None:
        for engine in self._live():
            engine.resume()

    def health(self) -> bool:
        return any(self._healthy(k) for k in range(len(self.engines)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines:
            engine.close()

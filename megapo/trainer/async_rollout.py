"""Asynchronous rollouts (`train.mode=async`): a background thread generates the batches of upcoming
steps while the learner trains on the current one.

Staleness k (`train.staleness`), a fixed schedule: batch b (the batch of step b + 1, counted over the whole
run, resumed or not) is generated entirely on the weights after step b - k (the first k batches on the
initial weights). The producer starts batch b once step b - k has synced (`mark_synced`), and the learner
syncs step s only once the last batch that needs the weights before it, batch s - 1 + k, is made
(`wait_made`). So while the learner trains on batch b, the engine generates batch b + k; every sample is
at most k weight versions older than the learner that trains on it (k = 0 is sync mode with a thread in
between); and which weights made which batch never depends on timing, so an async run is as reproducible
as a sync one. A sample records the version that produced it (Sample.weight_version); the loop measures
staleness = learner version - sample version and drops groups beyond the bound.

With partial rollouts (`rollout.partial`) the learner does not wait: its sync preempts the batch in flight,
whose samples continue on the new weights (the engine records each token's version), so a batch may span
versions and the schedule depends on timing again.

Checkpoints lose nothing: `made_ahead` waits until the producer has made every batch the synced weights
allow, and returns them; the checkpoint stores them (megapo.trainer.rollout_store) with the prompt cursor
and the engine's RNG state after them, and a resumed run's producer starts with them (`start(ready=)`).

Weight sync stays in the learner's thread (megapo.weights.sync_learner): it pauses the engine, which
waits for the generate call in flight to finish on the old weights, so no batch sees half-updated
weights; the producer's next generate call starts on the new version.

Why a thread and not a process: the embedded engine lives in the trainer's process, and torch ops
release the GIL, so generation and training run at the same time. The producer thread limits its
own intra-op threads (`generate_threads`) so that the two do not oversubscribe the cores.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Batch:
    """One step's rollouts, as made by the producer."""

    groups: list
    metrics: dict
    tokens: int
    generate_s: float  # producer wall time spent making this batch
    start_version: int  # engine weight version when generation started


class AsyncRollouts:
    """Background producer of rollout batches, at most `staleness` updates ahead of the learner.

        producer = AsyncRollouts(lambda: collect_rollouts(...), staleness=2, version_fn=lambda: engine.weight_version)
        producer.start(batches=steps)
        for step ...:
            batch, waited = producer.get()
            ... train ...
            producer.wait_made(step + k)   # the batches that need the weights before this update
            ... sync weights ...
            producer.mark_synced()     # lets the producer start one more batch
        producer.close()
    """

    def __init__(self, produce: Callable[[], tuple[list, dict, int]], *, staleness: int,
                 version_fn: Callable[[], int], generate_threads: int | None = None):
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness: must be an int >= 0, got {staleness!r}")
        if generate_threads is not None and generate_threads < 1:
            raise ValueError(f"generate_threads: must be >= 1 or None, got {generate_threads!r}")
        self._produce = produce
        self.staleness = staleness
        self._version_fn = version_fn
        self._threads = generate_threads
        self._cond = threading.Condition()
        self._ready: list[Batch] = []
        self._synced = 0  # batches of the run whose update has reached the engine (or were skipped)
        self._made = 0  # batches of the run made (trained ones included)
        self._total = 0  # batches of the whole run
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    def start(self, batches: int, done: int = 0, ready: list[Batch] = ()) -> "AsyncRollouts":
        """Make the run's batches up to `batches` in all; `done`: steps already trained (a resumed run),
        `ready`: the batches after them that a checkpoint kept (made_ahead), handed out first."""
        if self._thread is not None:
            raise RuntimeError("already started")
        self._total, self._synced = int(batches), int(done)
        self._ready = list(ready)
        self._made = self._synced + len(self._ready)
        self._thread = threading.Thread(target=self._run, name="megapo-rollouts", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)  # this thread's OpenMP team only
        try:
            while True:
                with self._cond:
                    # batch b may start once b - k updates are synced (and the learner still wants it)
                    self._cond.wait_for(lambda: self._stop or self._made >= self._total
                                        or self._synced >= self._made - self.staleness)
                    if self._stop or self._made >= self._total:
                        return
                version = int(self._version_fn())
                t0 = time.perf_counter()
                groups, metrics, tokens = self._produce()
                batch = Batch(groups, metrics, tokens, time.perf_counter() - t0, version)
                with self._cond:
                    self._ready.append(batch)
                    self._made += 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the learner thread in get()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def get(self, timeout: float | None = None) -> tuple[Batch, float]:
        """The next batch (in order) and the seconds the learner waited for it."""
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._error is not None, timeout):
                raise TimeoutError(f"no rollout batch after {timeout} s")
            if self._error is not None and not self._ready:
                raise self._error  # as the rollout thread raised it: megapo train reports a RewardError in one line
            batch = self._ready.pop(0)
        return batch, time.perf_counter() - t0

    def _wait(self, made: int, timeout: float | None, what: str) -> None:
        """Until `made` batches of the run exist (or all of them); raises the producer's error."""
        target = min(made, self._total)
        with self._cond:
            if not self._cond.wait_for(lambda: self._made >= target or self._error is not None, timeout):
                raise TimeoutError(f"{what}: batch {target} not made after {timeout} s")
            if self._error is not None and self._made < target:
                raise self._error

    def wait_made(self, made: int, timeout: float | None = None) -> None:
        """The learner, before the sync of step s: wait until batch s - 1 + k, the last one generated on the
        weights before that update, is made (`made` = s + k)."""
        self._wait(made, timeout, "weight sync")

    def made_ahead(self, timeout: float | None = None) -> list[Batch]:
        """For a checkpoint after the synced steps: wait until every batch the synced weights allow is made
        (the producer then waits for the next sync), and return the batches not yet handed out, in order."""
        with self._cond:
            allowed = self._synced + self.staleness + 1
        self._wait(allowed, timeout, "checkpoint")
        with self._cond:
            return list(self._ready)

    def mark_synced(self) -> None:
        """The update of one more batch is on the engine (or the batch was skipped)."""
        with self._cond:
            self._synced += 1
            self._cond.notify_all()

    @property
    def ahead(self) -> int:
        """Batches made but not yet synced (for logs)."""
        with self._cond:
            return self._made - self._synced

    def close(self, timeout: float = 600.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def staleness_metrics(groups: list, learner_version: int) -> tuple[dict, list[int]]:
    """Per-sample staleness (learner version - sample's weight version) stats, and each group's worst."""
    per_group = [max(learner_version - s.weight_version for s in g.samples) for g in groups]
    every = [learner_version - s.weight_version for g in groups for s in g.samples]
    if not every:
        return {}, per_group
    return {"async/staleness_max": float(max(every)), "async/staleness_mean": sum(every) / len(every)}, per_group


def drop_stale(groups: list, learner_version: int, bound: int) -> tuple[list, dict[str, Any]]:
    """Keep groups whose samples are at most `bound` versions old; report the rest as dropped."""
    metrics, worst = staleness_metrics(groups, learner_version)
    kept = [g for g, w in zip(groups, worst) if w <= bound]
    metrics["async/dropped_groups"] = float(len(groups) - len(kept))
    return kept, metrics


def next_batch(producer: AsyncRollouts, learner_version: int, bound: int, timer) -> tuple[list, dict, int]:
    """Rank 0, async mode: the next batch for the learner at `learner_version`, stale groups dropped;
    timer gets `generate_wait` (the learner's wait: small when generation overlaps training)."""
    with timer("generate_wait"):
        batch, _ = producer.get()
    groups, metrics = drop_stale(batch.groups, learner_version, bound)
    metrics.update(batch.metrics)
    metrics["async/generate_s"] = batch.generate_s  # producer time, overlapped with the previous steps
    metrics["async/start_version"] = float(batch.start_version)
    return groups, metrics, batch.tokens

"""A generate call preempted mid-batch, then the trainer's weight sync played (test_partial_rollouts,
test_duet_abort)."""

from __future__ import annotations

import threading


def generate_preempted(engine, prompts, params, new_weights, preempt_at_call: int):
    """engine.generate in a thread; at the preempt_at_call-th model step (the prefill is the first) the engine is
    preempted, then the sync is played: pause, load `new_weights` ((name, tensor) pairs) as version 1, resume.
    Returns the groups."""
    step, calls = engine.model.step, [0]

    def counting(*a, **kw):
        calls[0] += 1
        if calls[0] == preempt_at_call:
            engine.preempt()
        return step(*a, **kw)

    engine.model.step = counting
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(prompts, params)))
    worker.start()
    while not engine._preempted.is_set() and worker.is_alive():
        worker.join(0.01)
    engine.pause()
    engine.update_weights(new_weights, 1)
    engine.resume()
    worker.join(60)
    engine.model.step = step
    return out["groups"]

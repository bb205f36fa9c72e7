"""What the benches that time passes side by side in one process share (second_models.py, reference_cost.py): a
step's random batch with engine routes, rounds in alternating order after a warm-up round, wall seconds of a call,
and the bytes a module keeps."""

from __future__ import annotations

import random
import time


def seconds(fn) -> float:
    """Wall seconds of fn()."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def param_bytes(module, trained: bool = False) -> int:
    """Bytes of the module's parameters; trained: x4 (+ the fp32 gradient and Adam's two moments)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params * 4 if trained else params


def routed_batch(rng: random.Random, n_seqs: int, seq_len: int, prompt_len: int, tiny) -> list[dict]:
    """n_seqs samples of seq_len random token ids (prompt_len of them the prompt), a random advantage each, and
    random engine routes of the tiny MoE `tiny` (its experts, topk, layers, vocab) at every position but the last."""
    batch = []
    for _ in range(n_seqs):
        routes = [[rng.sample(range(tiny.experts), tiny.topk) for _ in range(tiny.layers)] for _ in range(seq_len - 1)]
        batch.append(dict(tokens=[rng.randrange(3, tiny.vocab) for _ in range(seq_len)], prompt_len=prompt_len,
                          advantage=rng.uniform(-1, 1), routes=routes))
    return batch


def alternating_rounds(rounds: int, passes) -> dict[str, list[float]]:
    """Seconds of each pass per round: `passes()` gives a round's (name, callable) list (on a fresh batch), run in
    its order in odd rounds and reversed in even ones; round 0 warms up and is dropped."""
    out: dict[str, list[float]] = {}
    for r in range(rounds + 1):
        runs = passes()
        for name, fn in (runs if r % 2 else runs[::-1]):
            out.setdefault(name, []).append(seconds(fn))
        if r == 0:
            out = {}
    return out

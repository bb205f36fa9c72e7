"""Block rewards for the stage bae (Blockwise Advantage Estimation, megapo/algorithms/blockwise.py) on the built-in
addition task (megapo/tasks/addition.py: "123+456=" -> "0579"), whose responses carry no delimiter text:

    algorithm.stages=[{name: bae, blocks: [high, low], cut_chars: [2],
                       block_reward: "megapo.tasks.addition_blocks:digit_halves"}]

The answer's four digits in two blocks, each checked on its own against the reference:

    high   the response's first two characters == the sum's thousands and hundreds digits ("05" of "0579")
    low    the rest of the response == its tens and units digits ("79"; an extra or a missing character fails it)

A response earns both exactly when it is the reference answer itself, so high = low = 1 is exact match on the
unstripped text (the task's own reward strips surrounding whitespace first). Assumption: Blockwise Advantage
Estimation for Multi-Objective RL with Verifiable Rewards (Pavlenko et al. 2026, arXiv:2602.10231) takes its
blocks from a response's own segments (a solution, then a confidence); the two halves of the written sum are this
repository's stand-in for a task that has none, the high half's correctness the intermediate outcome that
stratifies the low half's baseline.
"""

from __future__ import annotations

HIGH_CHARS = 2  # the cut: cut_chars [2]


def digit_halves(response: str, answer: str) -> dict[str, float]:
    """{high: 1.0 when response[:2] == answer[:2], low: 1.0 when response[2:] == answer[2:]} (0.0 otherwise)."""
    return {"high": float(response[:HIGH_CHARS] == answer[:HIGH_CHARS]),
            "low": float(response[HIGH_CHARS:] == answer[HIGH_CHARS:])}

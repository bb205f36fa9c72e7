"""What a multi-turn environment is, and what a multi-turn rollout returns.

An environment plays one trajectory: `reset(example)` starts it, then the rollout driver
(megapo/envs/rollout.py) alternates a policy turn (the engine samples until end-of-sequence) with
`step(turn_text)`, which answers with an observation to append, or ends the trajectory:

    env = make_env(example)                 # one instance per trajectory
    first = env.reset(example)              # None: the prompt the data pipeline encoded; str / token ids: its own
    result = env.step("<tool>calc(47*85)</tool>")
    # StepResult(observation="3995", done=False)  -> the driver appends the observation and samples again
    result = env.step("3995")
    # StepResult(done=True, finish="answer")      -> the verifier scores the last turn ("3995")

An observation is a string (wrapped by the driver in the observation format, raw or the chat
template's tool turn, then tokenised) or token ids (appended as they are). `reward` at the end
replaces the verifier's score when it is not None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from megapo.engines.base import Sample

# why a trajectory ended (Trajectory.finish):
#   answer      the environment ended it (a turn without a tool call: the final answer)
#   max_turns   env.max_turns policy turns were taken
#   length      a policy turn was cut at rollout.max_new_tokens, or the trajectory reached env.max_total_tokens
#   budget      an observation did not fit in what was left of env.max_total_tokens
#   parse_error a turn held a malformed tool call
#   tool_error  a tool raised (or the environment's step did)
FINISHES = ("answer", "max_turns", "length", "budget", "parse_error", "tool_error")


@dataclass
class StepResult:
    observation: str | list[int] | None = None  # what to append before the next policy turn (None when done)
    done: bool = False
    reward: float | None = None  # replaces the verifier's score of the trajectory when not None
    finish: str = "answer"  # with done: one of FINISHES
    tool_calls: int = 0  # tool calls this turn made (metrics)

    def __post_init__(self) -> None:
        if self.finish not in FINISHES:
            raise ValueError(f"StepResult.finish must be one of {', '.join(FINISHES)}, got {self.finish!r}")
        if not self.done and self.observation is None:
            raise ValueError("StepResult: a step that is not done must give an observation")


@runtime_checkable
class Environment(Protocol):
    def reset(self, example: Any) -> str | list[int] | None: ...

    def step(self, response: str) -> StepResult: ...


@dataclass
class Trajectory(Sample):
    """A multi-turn sample: output_ids hold every token after the prompt, the policy's turns and the
    observations between them; `loss_mask` marks the policy's (1) and the environment's (0); logprobs are the
    engine's at policy tokens and 0.0 at observation tokens; routes cover every fed position as for a Sample.
    finish_reason is "stop" when the trajectory ended properly and "length" when it was cut (then it gets
    data.truncated_reward)."""

    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0  # policy turns
    tool_calls: int = 0
    finish: str = "answer"  # one of FINISHES
    env_reward: float | None = None
    last_turn: tuple[int, int] = (0, 0)  # [lo, hi) of the last policy turn in output_ids

    def answer_ids(self, stop_token_ids) -> list[int]:
        """The last policy turn's tokens without its stop token: what the verifier reads."""
        lo, hi = self.last_turn
        ids = self.output_ids[lo:hi]
        return ids[:-1] if ids and ids[-1] in stop_token_ids else ids

    def segments(self) -> list[tuple[bool, list[int]]]:
        """(is_policy, token ids) runs of output_ids in order: the turns and observations (for logs)."""
        runs: list[tuple[bool, list[int]]] = []
        for token, m in zip(self.output_ids, self.loss_mask):
            if runs and runs[-1][0] == bool(m):
                runs[-1][1].append(token)
            else:
                runs.append((bool(m), [token]))
        return runs

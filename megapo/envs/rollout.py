"""Multi-turn rollouts over any Engine: policy turns from `engine.generate`, observations from environments.

    trajectories = generate_trajectories(engine, params, prompts, examples, make_env, observe, limits)
    # list (per prompt) of params.n Trajectory, in prompt order, like Engine.generate

Each turn is one `generate` call for every live trajectory at once, its prompt being the trajectory so far
(token ids: prompt, turns, observations): the engine re-prefills it (vLLM and SGLang reuse the shared prefix
from their prefix cache), so any engine serves multi-turn unchanged. A Router keeps each trajectory on one
server while that server lives (`sessions`); when it dies, the router resends the turn elsewhere, and the
trajectory goes on from its last completed turn. A turn ends at the stop tokens (end-of-sequence), then the
environment reads its text. Log-probs and routes are the engine's for every policy token; routes of each turn
extend the positions the trajectory already had (R3 replays what each token was sampled under).
`weight_version` of a trajectory is the oldest of its turns' (async weights may change between turns).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from megapo.engines.base import Engine
from megapo.envs.base import FINISHES, StepResult, Trajectory

log = logging.getLogger(__name__)
_SEED_STRIDE = 1_000_003  # turn t of a seeded batch samples with seed + t * stride
_session_ids = itertools.count()


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int  # policy turns per trajectory
    max_total_tokens: int  # output tokens per trajectory, turns and observations together

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_total_tokens < 1:
            raise ValueError(f"TurnLimits: max_turns and max_total_tokens must be >= 1, got {self}")


@dataclass(frozen=True)
class TurnPlay:
    """What a multi-turn rollout needs besides the engine: a fresh environment per trajectory, and the limits."""

    make_env: Callable[[Any], Any]
    limits: TurnLimits


class ObservationFormat:
    """Token ids of an observation string: raw `<result>…</result>`, or with chat templates the template's
    tool turn (after the newline the template puts behind the assistant's end-of-turn) and the next assistant
    header."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer = tokenizer
        self.chat = chat_template

    def encode(self, observation: str | list[int]) -> list[int]:
        if not isinstance(observation, str):
            return [int(t) for t in observation]
        if not self.chat:
            return list(self.tokenizer(f"<result>{observation}</result>", add_special_tokens=False)["input_ids"])
        turn = self.tokenizer.apply_chat_template([{"role": "tool", "content": observation}],
                                                  add_generation_prompt=True, tokenize=True)
        if isinstance(turn, dict) or hasattr(turn, "input_ids"):  # transformers 5 may return a BatchEncoding
            turn = turn["input_ids"]
        return list(self.tokenizer("\n", add_special_tokens=False)["input_ids"]) + list(turn)


@dataclass
class _State:
    """One trajectory being played."""

    env: Any
    prompt: list[int]
    key: int  # the router session: the trajectories of one prompt share it (and their server's prefix cache)
    out: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    routes: np.ndarray | None = None
    turns: int = 0
    tool_calls: int = 0
    version: int | None = None
    last_turn: tuple[int, int] = (0, 0)
    finish: str = ""
    cut: bool = False
    reward: float | None = None

    def add_turn(self, sample) -> None:
        lo = len(self.out)
        self.out += sample.output_ids
        self.logps += sample.logprobs
        self.mask += [1] * len(sample.output_ids)
        self.turns += 1
        self.last_turn = (lo, len(self.out))
        self.version = sample.weight_version if self.version is None else min(self.version, sample.weight_version)
        if sample.routes is not None:  # this call's routes cover the whole context: keep the new positions
            have = 0 if self.routes is None else len(self.routes)
            new = sample.routes[have:]
            self.routes = new if self.routes is None else np.concatenate([self.routes, new])

    def add_observation(self, ids: list[int]) -> None:
        self.out += ids
        self.logps += [0.0] * len(ids)
        self.mask += [0] * len(ids)

    def end(self, finish: str, *, cut: bool = False, reward: float | None = None) -> None:
        self.finish, self.cut, self.reward = finish, cut, reward

    def trajectory(self) -> Trajectory:
        return Trajectory(prompt_ids=list(self.prompt), output_ids=self.out, logprobs=self.logps,
                          finish_reason="length" if self.cut else "stop", weight_version=int(self.version or 0),
                          routes=self.routes, loss_mask=self.mask, turns=self.turns, tool_calls=self.tool_calls,
                          finish=self.finish, env_reward=self.reward, last_turn=self.last_turn)


def generate_trajectories(engine: Engine, params, prompts: list[list[int]], examples: list,
                          make_env: Callable[[Any], Any], observe: ObservationFormat, limits: TurnLimits,
                          decode: Callable[[list[int]], str]) -> list[list[Trajectory]]:
    """params.n trajectories per prompt (`examples[i]` the example of prompts[i]); `make_env(example)` a fresh
    environment per trajectory; `decode(ids)` the text the environment reads of a turn (stop token removed)."""
    n = params.n
    states = []
    for prompt, example in zip(prompts, examples):
        key = next(_session_ids)
        for _ in range(n):
            env = make_env(example)
            own = env.reset(example)
            first = prompt if own is None else (observe.tokenizer(own, add_special_tokens=False)["input_ids"]
                                                if isinstance(own, str) else [int(t) for t in own])
            states.append(_State(env, list(first), key))
    shared = all(states[i * n + j].prompt == states[i * n].prompt for i in range(len(prompts)) for j in range(n))
    params = replace(params, max_new_tokens=min(params.max_new_tokens, limits.max_total_tokens))
    if shared:  # each prompt prefilled once for its n samples
        heads = states[::n]
        first_turn = [s for group in _generate(engine, [h.prompt for h in heads], params, heads) for s in group]
    else:
        first_turn = [g[0] for g in _generate(engine, [s.prompt for s in states], replace(params, n=1), states)]
    live, turn = list(zip(states, first_turn)), 0
    stop = set(params.stop_token_ids)
    try:
        while live:
            next_live = []
            for state, sample in live:
                state.add_turn(sample)
                if _after_turn(state, sample, observe, limits, decode, stop):
                    next_live.append(state)
            turn += 1
            live = _next_turn(engine, params, next_live, limits, turn)
    finally:
        if engine.capabilities.sessions:
            engine.end_sessions(sorted({s.key for s in states}))
    trajectories = [s.trajectory() for s in states]
    return [trajectories[i * n:(i + 1) * n] for i in range(len(prompts))]


def _after_turn(state: _State, sample, observe: ObservationFormat, limits: TurnLimits, decode, stop) -> bool:
    """Step the environment on the turn just taken; True when the trajectory goes on (its observation appended)."""
    if sample.finish_reason != "stop" or len(state.out) >= limits.max_total_tokens:
        state.end("length", cut=True)
        return False
    ids = sample.output_ids[:-1] if sample.output_ids and sample.output_ids[-1] in stop else sample.output_ids
    try:
        result = state.env.step(decode(ids))
        if not isinstance(result, StepResult):
            raise TypeError(f"step returned a {type(result).__name__}, not a StepResult")
    except Exception as err:  # noqa: BLE001 - a failing environment ends this trajectory, not the run
        log.warning("environment %s failed in step: %s: %s", type(state.env).__name__, type(err).__name__, err)
        state.end("tool_error")
        return False
    state.tool_calls += result.tool_calls
    if result.done:
        state.end(result.finish, reward=result.reward)
        return False
    if state.turns >= limits.max_turns:
        state.end("max_turns")
        return False
    obs = observe.encode(result.observation)
    if len(state.out) + len(obs) >= limits.max_total_tokens:  # no room left for the next turn's first token
        state.end("budget")
        return False
    state.add_observation(obs)
    return True


def _next_turn(engine: Engine, params, states: list[_State], limits: TurnLimits, turn: int) -> list[tuple[_State, Any]]:
    """Sample the next turn of every live trajectory, each within what is left of its token budget."""
    if not states:
        return []
    seed = None if params.seed is None else params.seed + turn * _SEED_STRIDE
    by_budget: dict[int, list[_State]] = {}
    for s in states:
        by_budget.setdefault(min(params.max_new_tokens, limits.max_total_tokens - len(s.out)), []).append(s)
    out = []
    for budget, group in by_budget.items():
        turn_params = replace(params, n=1, max_new_tokens=budget, seed=seed)
        samples = _generate(engine, [s.prompt + s.out for s in group], turn_params, group)
        out += [(s, g[0]) for s, g in zip(group, samples)]
    return out


def _generate(engine: Engine, contexts: list[list[int]], params, states: list[_State]):
    if engine.capabilities.sessions:  # a Router: each trajectory stays on its server
        return engine.generate(contexts, params, sessions=[s.key for s in states])
    return engine.generate(contexts, params)


def trajectory_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per trajectory: env/turns, env/tool_calls, env/policy_token_frac; the share of each finish reason
    (env/finish/<reason>), and the counts env/parse_errors and env/tool_errors of the batch."""
    count = max(len(trajectories), 1)
    tokens = sum(len(t.loss_mask) for t in trajectories)
    metrics = {"env/turns": sum(t.turns for t in trajectories) / count,
               "env/tool_calls": sum(t.tool_calls for t in trajectories) / count,
               "env/policy_token_frac": sum(sum(t.loss_mask) for t in trajectories) / max(tokens, 1),
               "env/parse_errors": float(sum(t.finish == "parse_error" for t in trajectories)),
               "env/tool_errors": float(sum(t.finish == "tool_error" for t in trajectories))}
    for reason in FINISHES:
        metrics[f"env/finish/{reason}"] = sum(t.finish == reason for t in trajectories) / count
    return metrics


def trajectory_sampler(make_env, tokenizer, chat_template: bool, limits: TurnLimits):
    """sample(engine, prompts, examples, params) -> per prompt params.n Trajectory: what the loop calls in place
    of engine.generate when the run has an environment."""
    observe = ObservationFormat(tokenizer, chat_template)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def sample(engine, prompts, examples, params):
        return generate_trajectories(engine, params, prompts, examples, make_env, observe, limits, decode)

    return sample

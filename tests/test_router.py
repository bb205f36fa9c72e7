"""Router over two fake vLLM-style servers (in-process HTTP on 127.0.0.1); one dies in the middle of a batch."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megapo.engines.base import SamplingParams
from megapo.engines.router import NoLiveEngine, Router
from megapo.engines.vllm import VLLMEngine


def expected_tokens(prompt, seed, length):
    """What the fake server generates: a function of (prompt, seed) only, written out independently."""
    return [(sum(prompt) * 31 + seed * 7 + k) % 500 for k in range(length)]


class FakeVLLM:
    """Answers /inference/v1/generate like vLLM (token ids, per-token log-probs, weight-version spans).

    die_after: once that many generate requests have arrived, the server crashes: the requests still in flight
    and every later one get their connection closed without an answer, and the port stops listening."""

    def __init__(self, die_after=None, delay=0.02):
        self.die_after, self.delay = die_after, delay
        self.requests, self.answered, self.dead = 0, 0, False
        # (prompt, seed) of the requests that crashed in flight: the client's own reconnect may send one again
        # before the port closes, so distinct requests, not arrivals, are what the router has to retry
        self.crashed = set()
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _crash(self):
                self.close_connection = True
                self.connection.close()

            def do_GET(self):
                if fake.dead:
                    return self._crash()
                self._send({})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/inference/v1/generate":
                    return self._send({})
                with fake.lock:
                    fake.requests += 1
                    if fake.die_after is not None and fake.requests > fake.die_after and not fake.dead:
                        fake.dead = True
                        threading.Thread(target=fake.stop_listening).start()
                time.sleep(fake.delay)
                if fake.dead:  # crashed while this request was in flight
                    with fake.lock:
                        fake.crashed.add((tuple(body["token_ids"]), body["sampling_params"]["seed"]))
                    return self._crash()
                sp = body["sampling_params"]
                assert sp["logprobs"] == 0 and sp["ignore_eos"] and sp["detokenize"] is False
                choices = []
                for j in range(sp["n"]):
                    toks = expected_tokens(body["token_ids"], sp["seed"] + j, sp["max_tokens"])
                    choices.append({"index": j, "finish_reason": "length", "token_ids": toks,
                                    "weight_versions": [{"version": "3", "start": 0, "end": len(toks)}],
                                    "logprobs": {"content": [{"token_id": t, "logprob": -t / 1000} for t in toks]}})
                with fake.lock:
                    fake.answered += 1
                self._send({"request_id": "x", "choices": choices})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop_listening(self):
        self.server.shutdown()
        self.server.server_close()  # later connections are refused at once

    def close(self):
        if not self.dead:
            self.stop_listening()


@pytest.fixture
def servers():
    made = []

    def make(**kw):
        made.append(FakeVLLM(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def check_batch(out, prompts, params):
    assert [len(g) for g in out] == [params.n] * len(prompts)
    for i, (prompt, group) in enumerate(zip(prompts, out)):
        for j, s in enumerate(group):
            seed = params.seed + i * params.n + j
            assert s.prompt_ids == prompt
            assert s.output_ids == expected_tokens(prompt, seed, params.max_new_tokens)
            assert s.logprobs == [-t / 1000 for t in s.output_ids]
            assert s.weight_version == 3 and s.finish_reason == "length"


@pytest.mark.parametrize("per_request", [None, 1, 3])
def test_router_balances_and_keeps_order(servers, per_request):
    a, b = servers(), servers()
    router = Router([VLLMEngine(a.url), VLLMEngine(b.url)], max_in_flight_per_engine=4,
                    samples_per_request=per_request)
    prompts = [[i, i + 1, i + 2] for i in range(12)]
    params = SamplingParams(n=4, max_new_tokens=5, seed=100)
    out = router.generate(prompts, params)
    check_batch(out, prompts, params)
    requests = 12 * {None: 1, 1: 4, 3: 2}[per_request]
    assert a.answered + b.answered == requests and min(a.answered, b.answered) >= requests // 4  # both used
    assert sum(router.served) == 48 and router.retries == 0
    router.close()


@pytest.mark.parametrize("per_request,die_after", [(1, 10), (None, 3), (3, 5)])
def test_router_survives_a_server_dying_mid_batch(servers, per_request, die_after):
    a, b = servers(die_after=die_after), servers()
    router = Router([VLLMEngine(a.url, timeout=10), VLLMEngine(b.url, timeout=10)], max_in_flight_per_engine=4,
                    samples_per_request=per_request)
    prompts = [[i, 2 * i, 3] for i in range(16)]
    params = SamplingParams(n=4, max_new_tokens=6, seed=7)
    out = router.generate(prompts, params)
    check_batch(out, prompts, params)  # every sample exactly once, each with its own id's content
    assert a.dead and a.answered < a.requests  # a died with requests in flight...
    assert a.crashed and router.retries >= len(a.crashed)  # ...and those were sent again elsewhere
    assert router.alive == [False, True]
    assert sum(router.served) == 64 and router.served[1] > 0
    # the next batch runs on the survivor alone
    out2 = router.generate(prompts[:3], params)
    check_batch(out2, prompts[:3], params)
    router.close()


def test_router_fails_clearly_when_every_server_is_dead(servers):
    a = servers(die_after=0)
    router = Router([VLLMEngine(a.url, timeout=5)])
    with pytest.raises(NoLiveEngine):
        router.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=0))
    with pytest.raises(ValueError, match="engines"):
        Router([])
    with pytest.raises(ValueError, match="samples_per_request"):
        Router([VLLMEngine(a.url)], samples_per_request=0)
    router.close()

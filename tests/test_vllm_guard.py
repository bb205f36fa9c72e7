"""megapo.engines.auth: the guard megapo puts in front of vLLM's app (driven here as a plain ASGI app in front of
a recording stand-in for vLLM), the API key files, and the clients that carry the key (VLLMEngine / Router against
an HTTP server that refuses requests without it). The real vLLM server behind the guard: tests/test_vllm_server.py.
"""

import asyncio
import json
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megapo.config import ConfigError, load_config
from megapo.engines.auth import IDENTITY_PATH, GuardPolicy, VLLMGuard, create_key_file, read_key_file
from megapo.engines.base import SamplingParams
from megapo.engines.http import HTTPError
from megapo.engines.router import Router
from megapo.engines.vllm import VLLMEngine

KEY = "k" * 43
NONCE = "launch-nonce"


class StandIn:
    """The app behind the guard: records (method, path, body) of what reaches it and answers 200."""

    def __init__(self):
        self.seen = []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.seen.append((scope["method"], scope["path"], message.get("body", b"")))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(guard, method, path, key=None, body=b"", chunks=1):
    """One HTTP request through the ASGI app `guard`: (status, decoded JSON answer)."""
    headers = [(b"host", b"x")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers}
    step = max(1, -(-len(body) // chunks))
    parts = [body[i:i + step] for i in range(0, len(body), step)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body_out)


@pytest.fixture
def guarded(tmp_path):
    weights = tmp_path / "run" / "weights_sync"
    (weights / "v3").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    app = StandIn()
    return VLLMGuard(app, GuardPolicy(KEY, NONCE, (weights.resolve(),))), app, weights, tmp_path


def rpc(method, **kwargs):
    return json.dumps({"method": method, "kwargs": kwargs}).encode()


def test_every_route_but_health_needs_the_key(guarded):
    guard, app, weights, _ = guarded
    assert call(guard, "GET", "/health")[0] == 200  # liveness stays open
    reload = rpc("megapo_reload_weights", weights_path=str(weights / "v3"))
    for method, path, body in [("POST", "/collective_rpc", reload), ("POST", "/pause", b""),
                               ("POST", "/update_weight_version", b'{"new_version": "9"}'),
                               ("POST", "/inference/v1/generate", b"{}"), ("GET", "/weight_info", b""),
                               ("GET", IDENTITY_PATH, b""), ("POST", "/v1/completions", b"{}"),
                               ("POST", "/init_weight_transfer_engine", b"{}"), ("GET", "/server_info", b"")]:
        for key in (None, "wrong-" + KEY, KEY[:-1]):
            status, answer = call(guard, method, path, key, body)
            assert status == 401 and "API key" in answer["error"], (method, path, key)
    assert app.seen == [("GET", "/health", b"")]  # nothing else reached vLLM


def test_with_the_key_only_megapo_routes_are_served(guarded):
    guard, app, _, _ = guarded
    assert call(guard, "GET", IDENTITY_PATH, KEY) == (200, {"nonce": NONCE})
    for method, path in [("POST", "/pause"), ("POST", "/resume"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/update_weight_version"), ("GET", "/weight_info"),
                         ("POST", "/inference/v1/generate"), ("GET", "/metrics")]:
        assert call(guard, method, path, KEY, b"{}")[0] == 200, path
    for method, path in [("POST", "/v1/completions"), ("POST", "/sleep"), ("POST", "/init_weight_transfer_engine"),
                         ("POST", "/update_weights"), ("POST", "/scale_elastic_ep"), ("GET", "/server_info"),
                         ("GET", "/docs"), ("POST", "/invocations"), ("GET", "/pause")]:
        status, answer = call(guard, method, path, KEY, b"{}")
        assert status == 404 and f"does not expose {method} {path}" in answer["error"]
    assert [p for _, p, _ in app.seen] == ["/pause", "/resume", "/reset_prefix_cache", "/update_weight_version",
                                           "/weight_info", "/inference/v1/generate", "/metrics"]


def test_collective_rpc_runs_only_megapo_methods_from_allowed_folders(guarded):
    guard, app, weights, tmp = guarded
    os.symlink(tmp / "elsewhere", weights / "link")  # inside by name, outside once resolved
    refused = {
        rpc("reload_weights", weights_path=str(weights / "v3")): "not one megapo calls",
        rpc("load_model"): "not one megapo calls",
        rpc("megapo_reload_weights", weights_path=str(tmp / "elsewhere")): "outside the folders",
        rpc("megapo_reload_weights", weights_path=str(weights / ".." / ".." / "elsewhere")): "outside the folders",
        rpc("megapo_reload_weights", weights_path=str(weights / "link")): "outside the folders",
        rpc("megapo_reload_weights", weights_path="/etc"): "outside the folders",
        rpc("megapo_reload_weights"): "weights_path must be a folder path",
        rpc("megapo_reload_weights", weights_path=str(weights), load_format="pt"): "takes kwargs",
        json.dumps({"method": "megapo_reload_weights", "args": [str(weights)]}).encode(): "positional args",
        b"[1, 2]": "not a JSON object",
        b"{not json": "not JSON",
    }
    for body, why in refused.items():
        status, answer = call(guard, "POST", "/collective_rpc", KEY, body)
        assert status == 403 and why in answer["error"], (body, answer)
    assert app.seen == []
    allowed = [rpc("megapo_reload_weights", weights_path=str(weights / "v3")),
               rpc("megapo_receive_weights"),
               rpc("megapo_join_weight_groups", host="10.0.0.1", base_port=2000, workers=1, rank_offset=1, stages=1,
                   timeout_s=60, threads=2, backend="gloo")]
    for body in allowed:
        assert call(guard, "POST", "/collective_rpc", KEY, body, chunks=3)[0] == 200
    # vLLM reads the very body the guard checked, whole, though it arrived in pieces
    assert app.seen == [("POST", "/collective_rpc", body) for body in allowed]
    assert call(guard, "POST", "/collective_rpc", KEY, b" " * (2 << 20))[0] == 413


def test_key_files_are_private_and_named_in_errors(tmp_path):
    path = tmp_path / "key"
    key = create_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key) >= 40 and read_key_file(path) == key
    with pytest.raises(FileExistsError):
        create_key_file(path)  # never overwrites a key someone holds
    path.chmod(0o644)
    with pytest.raises(ValueError, match=rf"rollout.api_key_file: API key file {path} is open to other users"):
        read_key_file(path, "rollout.api_key_file")
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(ValueError, match=">= 16 characters"):
        read_key_file(short)
    with pytest.raises(FileNotFoundError, match=f"--api-key-file: API key file {tmp_path / 'none'} does not exist"):
        read_key_file(tmp_path / "none", "--api-key-file")


def _vllm_servers_config(tmp_path, tiny_moe, **rollout):
    import yaml

    cfg = {"model": {"path": str(tiny_moe)}, "train": {"output_dir": str(tmp_path / "out")},
           "data": {"task": "addition"}, "algorithm": {"routing_replay": "r2"},
           "rollout": {"engine": "vllm", "weight_sync": "disk", "servers": ["127.0.0.1:30000"], **rollout}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_trainer_config_needs_a_private_key_file_for_vllm_servers(tmp_path, tiny_moe):
    from megapo.trainer.config import RunConfig

    with pytest.raises(ConfigError, match="rollout.api_key_file: is required with vLLM rollout.servers"):
        load_config(RunConfig, _vllm_servers_config(tmp_path, tiny_moe), [])
    key = tmp_path / "key"
    with pytest.raises(ConfigError, match=f"rollout.api_key_file: API key file {key} does not exist"):
        load_config(RunConfig, _vllm_servers_config(tmp_path, tiny_moe, api_key_file=str(key)), [])
    create_key_file(key)
    key.chmod(0o640)
    with pytest.raises(ConfigError, match="is open to other users"):
        load_config(RunConfig, _vllm_servers_config(tmp_path, tiny_moe, api_key_file=str(key)), [])
    key.chmod(0o600)
    cfg = load_config(RunConfig, _vllm_servers_config(tmp_path, tiny_moe, api_key_file=str(key)), [])
    assert cfg.rollout.api_key_file == str(key)


class KeyedServer:
    """An HTTP server that, like megapo's guarded vLLM, answers only requests with `Bearer KEY` (else 401) and
    records the Authorization header of every request."""

    def __init__(self):
        self.headers = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _answer(self, body):
                auth = self.headers.get("Authorization")
                outer.headers.append((self.command, self.path, auth))
                status = 200 if auth == f"Bearer {KEY}" or self.path == "/health" else 401
                data = json.dumps(body if status == 200 else {"error": "megapo: this server needs its API key"})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def do_GET(self):
                self._answer({"nonce": NONCE} if self.path == IDENTITY_PATH else {})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/inference/v1/generate":
                    return self._answer({})
                n, prompt = req["sampling_params"]["n"], req["token_ids"]
                self._answer({"choices": [{"index": i, "token_ids": [prompt[0] + i],
                                           "logprobs": {"content": [{"token_id": prompt[0] + i, "logprob": -1.0}]},
                                           "finish_reason": "length"} for i in range(n)]})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_clients_send_the_key_on_every_request(tmp_path):
    server = KeyedServer()
    try:
        engine = VLLMEngine(server.url, api_key=KEY)
        router = Router([engine])
        out = router.generate([[5, 6], [7]], SamplingParams(n=2, max_new_tokens=1))
        assert [[s.output_ids for s in g] for g in out] == [[[5], [6]], [[7], [8]]]
        (tmp_path / "w").mkdir()
        router.update_weights_from_disk(str(tmp_path / "w"), version=1)
        engine.check_access()
        assert server.headers and all(auth == f"Bearer {KEY}" for _, _, auth in server.headers)
        assert {p.split("?")[0] for _, p, _ in server.headers} >= {
            "/inference/v1/generate", "/pause", "/collective_rpc", "/update_weight_version", "/resume", IDENTITY_PATH}
        # without the key: the refusal names where the key comes from, before any batch
        keyless = VLLMEngine(server.url)
        assert keyless.health()  # /health is open, so a wrong key is not a dead server
        with pytest.raises(PermissionError, match="rollout.api_key_file"):
            keyless.check_access("rollout.api_key_file")
        with pytest.raises(HTTPError, match="HTTP 401"):
            keyless.pause()
        engine.close(), keyless.close(), router.close()
    finally:
        server.close()

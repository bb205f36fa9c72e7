"""`megapo serve` / VLLMServer refuse what would expose or confuse a server, before anything starts: a non-loopback
bind without --allow-remote (and a key file), a port another program holds (exit 2, no traceback); and readiness
means the server on the port returns this launch's nonce, so another HTTP server that holds the port is never
taken for ours. A stand-in `python` (a shell script in a fake venv) plays vLLM: it records that it ran."""

import argparse
import json
import socket
import stat
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megapo.cli import run_command
from megapo.commands import serve
from megapo.engines.auth import GUARD_ENV, IDENTITY_PATH
from megapo.engines.server import PortInUse, ServerError, VLLMServer, VLLMServerConfig
from megapo.net import free_port


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_intermixed_args(list(argv))


@pytest.fixture
def fake_venv(tmp_path):
    """A venv whose python appends a line to `ran` and exits 1 after `sleep_s` (as vLLM failing to bind)."""
    venv, ran = tmp_path / "venv", tmp_path / "ran"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho started >> {ran}\nsleep ${{FAKE_SLEEP_S:-0}}\nexit 1\n")
    python.chmod(0o755)
    return venv, ran


@pytest.fixture
def squatter():
    """squatter(answer) -> port: a plain HTTP server that holds a port; answer(handler) -> (status, body)."""
    servers = []

    def start(answer=lambda h: (200, {})):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = answer(self)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "node17"])
def test_non_loopback_bind_needs_allow_remote_and_a_key_file(tiny_model_factory, fake_venv, tmp_path, capsys, host):
    model = tiny_model_factory()
    venv, ran = fake_venv
    base = ["--model", str(model), "--venv", str(venv), "--host", host]
    assert run_command("serve", _args(*base)) == 2
    err = capsys.readouterr().err
    assert f"host {host} is not a loopback address" in err and "--allow-remote" in err
    assert run_command("serve", _args(*base, "--allow-remote")) == 2
    assert "megapo serve: --api-key-file: " in capsys.readouterr().err  # named as the flag the user gives
    assert not ran.exists(), "nothing may start before the bind is refused"
    # allowed explicitly, with a key file the trainer reads too: the server would bind there (where it can)
    key_file = tmp_path / "key"
    config = dict(model_dir=str(model), host=host, venv=str(venv), allow_remote=True, api_key_file=str(key_file))
    if host in ("10.1.2.3", "node17"):  # not an address of this machine
        with pytest.raises(ValueError, match=f"host {host} cannot be bound here"):
            VLLMServer(VLLMServerConfig(**config))
        return
    server = VLLMServer(VLLMServerConfig(**config))
    command = server.command()
    assert command[command.index("--host") + 1] == host
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and server.api_key == key_file.read_text().strip()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "::1", "localhost"])
def test_loopback_binds_need_no_flag(tiny_model_factory, fake_venv, host):
    port = free_port("::1" if host == "::1" else "127.0.0.1")
    server = VLLMServer(VLLMServerConfig(str(tiny_model_factory()), host=host, venv=str(fake_venv[0]), port=port))
    assert server.url == (f"http://[::1]:{port}" if host == "::1" else f"http://{host}:{port}")


def test_busy_port_is_refused_before_starting(tiny_model_factory, fake_venv, squatter, capsys):
    venv, ran = fake_venv
    port = squatter()
    rc = run_command("serve", _args("--model", str(tiny_model_factory()), "--venv", str(venv), "--port", str(port)))
    assert rc == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
    with pytest.raises(PortInUse, match=f"port {port}"):
        VLLMServer(VLLMServerConfig(str(tiny_model_factory()), venv=str(venv), port=port))
    assert not ran.exists()


def test_a_chosen_port_taken_before_start_is_chosen_again(tiny_model_factory, fake_venv):
    """No --port: the free port picked at construction can be taken before start() (in the suite, by another
    server or a weight-sync group); start picks a free one again, url with it. A port the user gave is kept, and a
    server never started says so in tail() instead of failing."""
    venv, _ = fake_venv
    server = VLLMServer(VLLMServerConfig(str(tiny_model_factory()), venv=str(venv)))
    assert server.tail() == "(no log: the server was not started)"
    taken = server.port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", taken))
        sock.listen()
        server._repick_port()
        assert server.port != taken and server.url == f"http://127.0.0.1:{server.port}"
        given = VLLMServer(VLLMServerConfig(str(tiny_model_factory()), venv=str(venv), port=server.port))
        sock2 = socket.socket()
        sock2.bind(("127.0.0.1", given.port))
        sock2.listen()
        try:
            given._repick_port()
            assert given.port == server.port  # the user's port: start() refuses it rather than moving
            with pytest.raises(PortInUse, match=f"port {given.port}"):
                given._check_port_free(given.port)
        finally:
            sock2.close()


def test_another_server_on_the_port_is_not_taken_for_ours(tiny_model_factory, fake_venv, squatter, tmp_path,
                                                          monkeypatch):
    """The port was free when checked, then another HTTP server took it (answering 200 to everything) while our
    process starts and fails to bind: readiness waits for our nonce, and reports the process's exit."""
    venv, ran = fake_venv
    server = VLLMServer(VLLMServerConfig(str(tiny_model_factory()), venv=str(venv), log_path=str(tmp_path / "log")))
    port = squatter(lambda h: (200, {"nonce": "not-ours"} if h.path == IDENTITY_PATH else {}))
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server._ensure_key()
    (tmp_path / "log").write_text("ERROR [Errno 98] Address already in use\n")
    server.log_path = tmp_path / "log"
    monkeypatch.setenv("FAKE_SLEEP_S", "3")
    server.process = subprocess.Popen([str(venv / "bin" / "python")], start_new_session=True)
    try:
        with pytest.raises(ServerError) as info:
            server.wait_ready(timeout=30)
    finally:
        server.stop()
    message = str(info.value)
    assert "exited with code 1 before becoming ready" in message
    assert f"another server answered at http://127.0.0.1:{port}: not-ours" in message
    assert "Address already in use" in message


def test_readiness_accepts_the_server_that_returns_our_nonce_for_our_key(tiny_model_factory, fake_venv, squatter,
                                                                          tmp_path, monkeypatch):
    """The other side of the check: a server that answers the identity request as megapo's guard does (the nonce,
    only for the key) is ready; the same server without our key is not."""
    venv, _ = fake_venv
    server = VLLMServer(VLLMServerConfig(str(tiny_model_factory()), venv=str(venv), log_path=str(tmp_path / "log")))
    server._ensure_key()
    key = server.api_key

    def guard_like(h):
        if h.path == IDENTITY_PATH:
            ok = h.headers.get("Authorization") == f"Bearer {key}"
            return (200, {"nonce": server.nonce}) if ok else (401, {"error": "key"})
        return (200, {}) if h.path == "/health" else (404, {})

    port = squatter(guard_like)
    server.port, server.url = port, f"http://127.0.0.1:{port}"
    server._ensure_key()  # a client for the new url, same key
    monkeypatch.setenv("FAKE_SLEEP_S", "30")
    server.process = subprocess.Popen([str(venv / "bin" / "python")], start_new_session=True)
    try:
        server.wait_ready(timeout=20)
        assert server.identity() == server.nonce
        server.api_key = "x" * 20  # a client with another key
        server._ensure_key()
        assert server.identity() == "HTTP 401"
    finally:
        server.stop()


def test_a_server_that_dies_while_starting_is_a_message_not_a_traceback(tiny_model_factory, fake_venv, tmp_path,
                                                                         capsys):
    venv, ran = fake_venv
    rc = run_command("serve", _args("--model", str(tiny_model_factory()), "--venv", str(venv), "--log", str(tmp_path / "log"),
                         "--timeout", "30"))
    assert rc == 1 and ran.exists()
    assert "megapo serve: vLLM server exited with code 1 before becoming ready" in capsys.readouterr().err


def test_server_process_gets_the_guard_and_a_private_key_that_ends_with_it(tiny_model_factory, fake_venv, tmp_path):
    model = tiny_model_factory()
    venv, _ = fake_venv
    server = VLLMServer(VLLMServerConfig(str(model), venv=str(venv), log_path=str(tmp_path / "log"),
                                         weights_dirs=[str(tmp_path / "sync"), str(model)]))
    with pytest.raises(ServerError):
        server.start(timeout=30)  # the stand-in exits at once; start() stops and cleans up
    assert server.api_key is None and server.api_key_file is None
    server._ensure_key()
    key_file = Path(server.api_key_file)
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    command, env = server.command(), server.env()
    assert command[command.index("--middleware") + 1] == "megapo.engines.auth.VLLMGuard"
    assert env[GUARD_ENV["key_file"]] == str(key_file) and env[GUARD_ENV["nonce"]] == server.nonce
    assert env[GUARD_ENV["weights_dirs"]].split(":") == [str((tmp_path / "sync").resolve()), str(model.resolve())]
    assert "VLLM_API_KEY" not in env and server.api_key not in " ".join(command)  # not visible in `ps`
    server.stop()
    assert not key_file.parent.exists()

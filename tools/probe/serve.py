"""Probe cases of the class 'wrong: false readiness / vLLM server security': `megapo serve` refusals (a held
port, remote binds without a key, key-file permissions), the vLLM guard driven through ASGI calls, and the
Slurm template's bind address.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading

from tools.probe.outcomes import ROOT, Outcome, message_line
from tools.probe.registry import case, config_refusal, refused


SERVE = "wrong: false readiness / vLLM server security"


@contextlib.contextmanager
def busy_port():
    """A plain Python http.server (not megapo's) holding a free loopback port."""
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@case(SERVE)
def serve_on_a_port_another_server_holds(ctx):
    with busy_port() as port:
        out = ctx.megapo("serve", "--model", ctx.model, "--port", port, "--timeout", "60")
    if "serving" in out.stdout.lower():
        return out, ("wrong", "printed 'serving' for a port another server holds")
    return refused(ctx, out, str(port))


@case(SERVE)
def serve_non_loopback_without_allow_remote(ctx):
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--host", "0.0.0.0", "--timeout", "60"),
                   "--allow-remote")


@case(SERVE)
def serve_allow_remote_without_key_file(ctx):
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--host", "0.0.0.0", "--allow-remote",
                                   "--timeout", "60"), "--api-key-file")


@case(SERVE)
def serve_world_readable_key_file(ctx):
    folder = ctx.fresh("world_readable_key")
    key = folder / "key"
    key.write_text("k" * 40 + "\n")
    key.chmod(0o644)
    return refused(ctx, ctx.megapo("serve", "--model", ctx.model, "--api-key-file", key, "--timeout", "60"),
                   str(key), "chmod 600")


@case(SERVE)
def serve_model_without_config_json(ctx):
    folder = ctx.fresh("serve_no_config")
    return refused(ctx, ctx.megapo("serve", "--model", folder, "--timeout", "60"), "config.json")


@case(SERVE)
def train_vllm_servers_without_key_file(ctx):
    return config_refusal(ctx, "vllm_servers_no_key", ('rollout.servers=["127.0.0.1:9"]', "rollout.engine=vllm",
                                                       "rollout.weight_sync=disk"), ("rollout.api_key_file",))


GUARD_SCRIPT = r'''
import asyncio, json, os, sys, tempfile
from pathlib import Path
from megapo.engines.auth import GuardPolicy, VLLMGuard, create_key_file
d = Path(tempfile.mkdtemp()); key = create_key_file(d / "key"); (d / "w").mkdir()
reached = []
async def app(scope, receive, send):
    reached.append(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})
guard = VLLMGuard(app, GuardPolicy(key, "nonce", (d / "w",)))
async def call(method, path, body=b"", auth=None):
    sent = []
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"authorization", f"Bearer {auth}".encode())] if auth else []}
    async def receive(): return {"type": "http.request", "body": body, "more_body": False}
    async def send(m): sent.append(m)
    await guard(scope, receive, send)
    return sent[0]["status"]
rpc = lambda m, **kw: json.dumps({"method": m, "kwargs": kw}).encode()
case = sys.argv[1]
status = asyncio.run({
    "no_key": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path=str(d / "w")), None),
    "wrong_key": lambda: call("POST", "/pause", b"", "x" * 43),
    "other_method": lambda: call("POST", "/collective_rpc", rpc("load_model"), key),
    "outside_path": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path="/etc"), key),
    "allowed": lambda: call("POST", "/collective_rpc", rpc("megapo_reload_weights", weights_path=str(d / "w")), key),
}[case]())
print(json.dumps({"status": status, "reached_app": bool(reached)}))
'''


def _guard(ctx, which: str, want: int):
    out = ctx.python(GUARD_SCRIPT.replace("sys.argv[1]", repr(which)))
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return out, ("poor", f"the guard probe failed: {message_line(out)}")
    reached = got["reached_app"]
    if got["status"] != want or (want != 200 and reached):
        return out, ("wrong", f"HTTP {got['status']} (app reached: {reached}), expected {want}")
    return out, ("good", f"HTTP {want}" + ("" if want == 200 else ", vLLM's app never reached"))


@case(SERVE)
def guard_refuses_rpc_without_key(ctx):
    return _guard(ctx, "no_key", 401)


@case(SERVE)
def guard_refuses_wrong_key(ctx):
    return _guard(ctx, "wrong_key", 401)


@case(SERVE)
def guard_refuses_other_worker_method(ctx):
    return _guard(ctx, "other_method", 403)


@case(SERVE)
def guard_refuses_weights_from_any_path(ctx):
    return _guard(ctx, "outside_path", 403)


@case(SERVE)
def guard_lets_megapo_reload_from_its_folder(ctx):
    return _guard(ctx, "allowed", 200)


@case(SERVE)
def slurm_template_binds_all_interfaces_only_with_a_key(ctx):
    """slurm/disaggregated.sbatch: every `--host 0.0.0.0` comes with --allow-remote and the job's key file."""
    text = (ROOT / "slurm" / "disaggregated.sbatch").read_text()
    out = Outcome(["grep", "0.0.0.0", "slurm/disaggregated.sbatch"], 0, stdout=text)
    binds = [m.start() for m in re.finditer(r"--host 0\.0\.0\.0", text)]
    ok = binds and all("--allow-remote" in text[i:i + 200] and "KEY_OVERRIDE" in text[i:i + 300] for i in binds)
    per_job = "od -An -N32" in text and "umask 077" in text
    if ok and per_job:
        return out, ("good", "0.0.0.0 only with --allow-remote and a per-job key file (umask 077)")
    return out, ("wrong", "the template binds 0.0.0.0 without --allow-remote and a per-job key")

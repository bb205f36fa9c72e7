"""The API key of megapo's vLLM servers, and the guard that enforces it inside the server.

vLLM's own `--api-key` covers only the /v1, /v2, /inference and /cohere routes (vllm/entrypoints/serve/middleware/
authenticate.py); the RL control endpoints that megapo needs (`VLLM_SERVER_DEV_MODE=1`: /collective_rpc, /pause,
/resume, /update_weight_version, ...) are open to anyone who reaches the port, and /collective_rpc calls any worker
method (load weights from any path, join any process group). So megapo serves vLLM behind VLLMGuard, an ASGI
middleware (`--middleware megapo.engines.auth.VLLMGuard`, outermost, it sees every request first):

- GET /health is open (liveness only); every other request needs `Authorization: Bearer <key>` (else 401);
- only the routes megapo's clients use are served (ROUTES; anything else 404, e.g. /v1/*, /docs, /sleep);
- /collective_rpc runs only megapo's worker-extension methods (RPC_KWARGS; else 403), with no positional args,
  and `megapo_reload_weights` only from a folder inside the server's allowed weights folders (after resolving links);
- GET /megapo/identity answers the per-launch nonce, so a starter knows the server on its port is the one it started.

The key lives in a file only its owner can read (a per-job secret: `megapo serve --api-key-file`, the trainer's
`rollout.api_key_file`); the server process gets that file's path, the nonce and the allowed folders through its
environment (GUARD_ENV). Standard library only: this module is imported inside vLLM's own venv.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

KEY_BYTES = 32  # secrets.token_urlsafe(32): 43 characters
MIN_KEY_CHARS = 16
IDENTITY_PATH = "/megapo/identity"
OPEN = {("GET", "/health")}
ROUTES = {("POST", "/inference/v1/generate"), ("POST", "/pause"), ("POST", "/resume"),
          ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"), ("GET", "/weight_info"),
          ("POST", "/collective_rpc"), ("GET", "/metrics")}
# worker-extension methods megapo's VLLMEngine calls, with the keyword arguments each takes
RPC_KWARGS = {
    "megapo_reload_weights": {"weights_path"},
    "megapo_join_weight_groups": {"host", "base_port", "workers", "rank_offset", "stages", "timeout_s", "threads",
                                  "backend", "generation"},
    "megapo_receive_weights": set(),
}
MAX_RPC_BODY = 1 << 20  # bytes: an RPC body is a method name and a few arguments
# environment the guard reads in the server process (set by megapo.engines.server.VLLMServer)
GUARD_ENV = {"key_file": "MEGAPO_API_KEY_FILE", "nonce": "MEGAPO_SERVER_NONCE", "weights_dirs": "MEGAPO_WEIGHTS_DIRS"}


# ----------------------------------------------------------------------------- the key file


def read_key_file(path: str | Path, field: str = "api_key_file") -> str:
    """The key in `path`; errors name `field` and the file: missing, empty, too short, or readable by others."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"{field}: API key file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{field}: cannot read API key file {path}: {err}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{field}: API key file {path} is open to other users (mode {stat.filemode(mode)}); "
                         f"`chmod 600 {path}`")
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"{field}: API key file {path} must hold one key of >= {MIN_KEY_CHARS} characters "
                         "without spaces")
    return key


def create_key_file(path: str | Path) -> str:
    """Write a fresh random key to a new file `path` that only its owner can read; returns the key."""
    key = secrets.token_urlsafe(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def key_from_file(path: str | Path, field: str = "api_key_file") -> str:
    """The key in `path`, created there first when the file does not exist yet."""
    return read_key_file(path, field) if Path(path).exists() else create_key_file(path)


def bearer(key: str | None) -> dict[str, str]:
    """The request header that carries `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


# ----------------------------------------------------------------------------- the guard's rules


@dataclass(frozen=True)
class GuardPolicy:
    key: str
    nonce: str
    weights_dirs: tuple[Path, ...]  # resolved

    @classmethod
    def from_env(cls, env=os.environ) -> "GuardPolicy":
        missing = [name for name in GUARD_ENV.values() if not env.get(name)]
        if missing:
            raise RuntimeError(f"megapo's vLLM guard needs {', '.join(missing)} in the environment (megapo serve "
                               "sets them)")
        dirs = tuple(Path(d).resolve() for d in env[GUARD_ENV["weights_dirs"]].split(os.pathsep) if d)
        return cls(read_key_file(env[GUARD_ENV["key_file"]]), env[GUARD_ENV["nonce"]], dirs)

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.key.encode())

    def rpc_refusal(self, body: bytes) -> str | None:
        """Why this /collective_rpc body must not run (None: it may)."""
        try:
            rpc = json.loads(body)
        except ValueError:
            return "the body is not JSON"
        if not isinstance(rpc, dict):
            return "the body is not a JSON object"
        method, kwargs = rpc.get("method"), rpc.get("kwargs") or {}
        if method not in RPC_KWARGS:
            return f"method {method!r} is not one megapo calls ({', '.join(sorted(RPC_KWARGS))})"
        if rpc.get("args"):
            return "positional args are refused; pass kwargs"
        if not isinstance(kwargs, dict) or set(kwargs) - RPC_KWARGS[method]:
            return f"{method} takes kwargs {sorted(RPC_KWARGS[method])}, got {kwargs!r}"
        if method == "megapo_reload_weights":
            return self.weights_path_refusal(kwargs.get("weights_path"))
        return None

    def weights_path_refusal(self, path) -> str | None:
        if not isinstance(path, str) or not path:
            return "weights_path must be a folder path"
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(d) for d in self.weights_dirs):
            return (f"weights_path {path} is outside the folders this server loads weights from "
                    f"({', '.join(map(str, self.weights_dirs))})")
        return None


# ----------------------------------------------------------------------------- the ASGI middleware


class VLLMGuard:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(VLLMGuard)`); rules in the module docstring."""

    def __init__(self, app, policy: GuardPolicy | None = None):
        self.app = app
        self.policy = policy or GuardPolicy.from_env()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # websockets (realtime audio): megapo uses none
            await receive()
            return await send({"type": "websocket.close", "code": 1008})
        method = scope["method"]
        path = scope["path"].removeprefix(scope.get("root_path") or "")
        if (method, path) in OPEN:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self.policy.authorized(headers.get("authorization")):
            return await _answer(send, 401, "megapo: this server needs its API key (Authorization: Bearer <key>, "
                                            "the key in the file given to megapo serve / rollout.api_key_file)")
        if (method, path) == ("GET", IDENTITY_PATH):
            return await _answer(send, 200, None, {"nonce": self.policy.nonce})
        if (method, path) not in ROUTES:
            return await _answer(send, 404, f"megapo serve does not expose {method} {path}")
        if path == "/collective_rpc":
            body = await _read_body(receive)
            if body is None:
                return await _answer(send, 413, f"an RPC body is at most {MAX_RPC_BODY} bytes")
            refusal = self.policy.rpc_refusal(body)
            if refusal:
                return await _answer(send, 403, f"megapo: collective_rpc refused: {refusal}")
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)


async def _read_body(receive) -> bytes | None:
    """The whole request body (None when it exceeds MAX_RPC_BODY)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_RPC_BODY:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then the client's later messages (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _answer(send, status: int, error: str | None, payload: dict | None = None) -> None:
    data = json.dumps(payload if payload is not None else {"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})

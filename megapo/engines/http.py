"""Minimal JSON-over-HTTP for the engine clients (standard library only; one connection per thread, kept alive).

With an api_key every request carries it (`Authorization: Bearer <key>`, megapo.engines.auth)."""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlsplit

from megapo.engines.auth import bearer


class HTTPError(RuntimeError):
    """The server answered with an error status (it is alive; retrying elsewhere will not help)."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url} -> HTTP {status}: {body[:500]}")
        self.status, self.body = status, body


class ConnectionLost(ConnectionError):
    """No answer (refused, reset, timed out): the server may be dead; the request may be retried elsewhere."""


class JSONClient:
    def __init__(self, base_url: str, timeout: float = 600.0, api_key: str | None = None):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must look like http://HOST:PORT, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host, self.port = parts.hostname, parts.port or 80
        self.timeout = timeout
        self._auth = bearer(api_key)
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def request(self, method: str, path: str, body=None, timeout: float | None = None):
        """Send JSON, return the decoded JSON answer (None for an empty body)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._auth, **({"Content-Type": "application/json"} if data is not None else {})}
        for attempt in range(2):  # a kept-alive connection the server closed fails once; reconnect
            conn = self._conn()
            conn.timeout = timeout or self.timeout
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (ConnectionError, http.client.HTTPException, OSError) as err:
                self._drop()
                fresh = attempt == 0 and isinstance(err, (http.client.RemoteDisconnected, BrokenPipeError,
                                                          ConnectionResetError))
                if fresh:
                    continue
                raise ConnectionLost(f"{self.base_url}{path}: {type(err).__name__}: {err}") from err
            if resp.status >= 400:
                raise HTTPError(self.base_url + path, resp.status, raw.decode(errors="replace"))
            if resp.getheader("Connection", "").lower() == "close":
                self._drop()
            if not raw.strip():
                return None
            try:
                return json.loads(raw)
            except ValueError:  # some endpoints answer plain text (SGLang's /flush_cache)
                return raw.decode(errors="replace")
        raise AssertionError("unreachable")

    def post(self, path: str, body=None, timeout: float | None = None):
        return self.request("POST", path, {} if body is None else body, timeout)

    def get(self, path: str, timeout: float | None = None):
        return self.request("GET", path, None, timeout)

    def alive(self, path: str = "/health", timeout: float = 5.0) -> bool:
        try:
            self.request("GET", path, None, timeout)
            return True
        except (ConnectionLost, HTTPError, ValueError):
            return False

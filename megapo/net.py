"""Small network helpers shared by the learner, the launchers and the server starters."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it; bind soon, another process may take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

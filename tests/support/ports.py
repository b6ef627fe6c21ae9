"""A loopback TCP port that nothing listens on."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just handed out and that is closed again: a dial there is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

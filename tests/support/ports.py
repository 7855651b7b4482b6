"""A free TCP port on 127.0.0.1, for servers the tests start (the one copy)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])

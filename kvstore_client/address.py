"""Daemon addresses as users write them: HOST:PORT, or HOST alone for the default port.

    with_default_port("localhost")        == "localhost:50051"
    with_default_port("10.0.0.5:6000")    == "10.0.0.5:6000"
    with_default_port("::1")              == "[::1]:50051"
    with_default_port("unix:/run/kv.sock")   unchanged (a gRPC target URI)

NOTE: gRPC itself reads a target without a port as port 443 (HTTPS's), which is never
a kvstore daemon: a user who gives `--address localhost` means the daemon's port.
"""

from __future__ import annotations

import ipaddress

DEFAULT_PORT = 50051
"""The port kvstore-server listens on unless told otherwise (--listen)."""

# gRPC target URI schemes: such a target names its own endpoint, port or not.
_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "google-c2p")


def with_default_port(address: str) -> str:
    """`address` with DEFAULT_PORT added when it names no port. Raises ValueError for an
    empty address or a port that is not a number 1..65535 (0 only names a port to bind)."""
    text = address.strip()
    if not text:
        raise ValueError("the daemon address is empty; give HOST:PORT (e.g. 127.0.0.1:50051)")
    if text.split(":", 1)[0].lower() in _SCHEMES and ":" in text:
        return text
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not host:
            raise ValueError(f"invalid address {address!r}: expected [IPV6]:PORT")
        if not rest:
            return f"[{host}]:{DEFAULT_PORT}"
        _check_port(address, rest[1:] if rest.startswith(":") else rest)
        return text
    if text.count(":") > 1:  # a bare IPv6 address, which cannot carry a port
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            raise ValueError(
                f"invalid address {address!r}: write an IPv6 address in brackets, [IPV6]:PORT"
            ) from None
        return f"[{text}]:{DEFAULT_PORT}"
    host, colon, port = text.rpartition(":")
    if not colon:
        return f"{text}:{DEFAULT_PORT}"
    _check_port(address, port)
    return text


def _check_port(address: str, port: str) -> None:
    if not (port.isdigit() and 0 < int(port) <= 65535):
        raise ValueError(
            f"invalid address {address!r}: the port must be a number 1..65535 "
            f"(HOST:PORT, or HOST alone for port {DEFAULT_PORT})"
        )

"""The control socket's framing: the daemon's unary calls and PinStream over a Unix socket
on its host, the same protobuf messages as over gRPC, for a fraction of a gRPC call's cost
(on the 2-core VM a gRPC call costs ~0.85 ms of CPU, a socket round trip ~0.05 ms).

A connection carries one call at a time. Every frame is a little-endian u32 length, then
that many bytes: a kind byte and its body.

    daemon -> client  READY   once, on accept: version u8, store id (utf-8); or the
                              connection closes at once (too many connections: use gRPC)
    client -> daemon  CALL    version u8, timeout in ms u32 (0: none), method name length
                              u8, token length u16, the method name, the bearer token
                              (empty without auth), the serialized request
    daemon -> client  REPLY   a unary call's serialized response (the call succeeded)
                      MESSAGE one message of a stream (PinStream)
                      STATUS  the call ended: gRPC status code u8, details (utf-8); a
                              unary call's failure, or any stream's end (0: OK)

Closing the connection cancels the call on it. Imports neither grpc nor the daemon: the
daemon (kvstore_server.rpc.control) and the client (kvstore_client._rpc) share it.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

from kvstore import wire

VERSION: Final = 1
READY: Final = 1
CALL: Final = 2
REPLY: Final = 3
MESSAGE: Final = 4
STATUS: Final = 5

MAX_METHOD_BYTES: Final = 64
MAX_TOKEN_BYTES: Final = 4096
# a frame from the daemon holds one message of at most wire.MAX_MESSAGE_BYTES
MAX_FRAME_BYTES: Final = wire.MAX_MESSAGE_BYTES + 64
# A call's serialized request on the socket (a client sends a larger one over gRPC): the
# daemon holds at most CALL_BUDGET_BYTES of them at once, whatever the connections
MAX_REQUEST_BYTES: Final = 4 << 20
MAX_CALL_FRAME_BYTES: Final = MAX_REQUEST_BYTES + MAX_METHOD_BYTES + MAX_TOKEN_BYTES + 64
CALL_BUDGET_BYTES: Final = 32 << 20

_LENGTH = struct.Struct("<I")
_CALL = struct.Struct("<BBIBH")  # kind, version, timeout ms, method length, token length
_STATUS = struct.Struct("<BB")  # kind, code

# gRPC's status codes by number (grpc.StatusCode's names; the wire carries the number)
STATUS_NAMES: Final = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip

# sun_path holds 108 bytes with its NUL: a longer path is reached through its directory
_SUN_PATH_BYTES: Final = 107
_COALESCE_BYTES: Final = 64 << 10


class FrameError(Exception):
    """The peer sent something this side cannot read (the connection is then closed)."""


class Closed(Exception):
    """The peer closed the connection."""


@contextmanager
def _address(path: Path) -> Iterator[str]:
    """An address for `path` that fits sun_path: the path itself, or, when it is too long,
    /proc/self/fd/N/NAME through an fd of its directory (open while in use)."""
    if len(os.fsencode(path)) <= _SUN_PATH_BYTES:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def bind(sock: socket.socket, path: Path) -> None:
    with _address(path) as address:
        sock.bind(address)


def connect(sock: socket.socket, path: Path) -> None:
    with _address(path) as address:
        sock.connect(address)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> memoryview:
    """One frame's bytes (kind first). Raises Closed at a clean end between frames, and
    FrameError for a frame over `limit` or one cut short."""
    return recv_body(sock, recv_length(sock, limit))


def recv_length(sock: socket.socket, limit: int) -> int:
    """The next frame's length (then recv_body). Raises Closed at a clean end between
    frames, FrameError over `limit`."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, between_frames=True))
    if length == 0 or length > limit:
        raise FrameError(f"a frame of {length} bytes (at most {limit})")
    return length


def recv_body(sock: socket.socket, length: int) -> memoryview:
    return _recv_exactly(sock, length, between_frames=False)


def _recv_exactly(sock: socket.socket, n: int, *, between_frames: bool) -> memoryview:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and between_frames:
                raise Closed("the peer closed the connection")
            raise FrameError("the connection closed in the middle of a frame")
        got += k
    return view


def send_frame(sock: socket.socket, head: bytes, body: bytes | memoryview = b"") -> None:
    """One frame: `head` (its kind first, and fixed fields) then `body`; a small frame in
    one send, a large body sent from where it lies."""
    prefix = _LENGTH.pack(len(head) + len(body)) + head
    if len(body) <= _COALESCE_BYTES:
        sock.sendall(prefix + body)
    else:
        sock.sendall(prefix)
        sock.sendall(body)


def ready_frame(store_id: str) -> bytes:
    return bytes((READY, VERSION)) + store_id.encode()


def parse_ready(frame: memoryview) -> str:
    if len(frame) < 2 or frame[0] != READY or frame[1] != VERSION:
        raise FrameError("not a kvstore control socket of this version")
    return bytes(frame[2:]).decode(errors="replace")


def call_head(method: str, timeout_s: float | None, token: str | None) -> bytes:
    name = method.encode()
    secret = token.encode() if token else b""
    if len(name) > MAX_METHOD_BYTES or len(secret) > MAX_TOKEN_BYTES:
        raise ValueError("method name or token too long for the control socket")
    ms = 0 if timeout_s is None else max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    return _CALL.pack(CALL, VERSION, ms, len(name), len(secret)) + name + secret


def parse_call(frame: memoryview) -> tuple[str, float | None, str | None, memoryview]:
    """(method, timeout in seconds or None, token or None, the serialized request)."""
    if len(frame) < _CALL.size:
        raise FrameError("a call frame too short for its header")
    kind, version, ms, name_len, token_len = _CALL.unpack_from(frame)
    if kind != CALL or version != VERSION:
        raise FrameError(f"frame kind {kind}, version {version}: expected a call of version {VERSION}")
    start = _CALL.size
    if len(frame) < start + name_len + token_len:
        raise FrameError("a call frame too short for its method name and token")
    try:
        method = bytes(frame[start : start + name_len]).decode("ascii")
        token = bytes(frame[start + name_len : start + name_len + token_len]).decode() or None
    except UnicodeDecodeError as exc:
        raise FrameError(f"undecodable method name or token: {exc}") from exc
    return method, (ms / 1000 if ms else None), token, frame[start + name_len + token_len :]


def status_head(code: int, details: str) -> bytes:
    return _STATUS.pack(STATUS, code) + details.encode(errors="replace")[:4096]


def parse_status(frame: memoryview) -> tuple[int, str]:
    if len(frame) < _STATUS.size:
        raise FrameError("a status frame too short")
    _, code = _STATUS.unpack_from(frame)
    return code, bytes(frame[_STATUS.size :]).decode(errors="replace")


def status_name(code: int) -> str:
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"

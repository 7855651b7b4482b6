"""The client's side of the daemon's control socket (kvstore.control; the daemon's side is
kvstore_server.rpc.control): unary calls and PinStream as framed protobuf over a Unix
socket beside the arena, for less than a gRPC call costs. No grpc here: a refusal is a
ControlError that errors.from_rpc_error reads as it reads a grpc.RpcError.

    Control        a pool of connections to one daemon run's socket, one call at a time
                   on each; `usable` until a connect fails (then gRPC for _RETRY_SECONDS)
    ControlStream  a PinStream on one connection: its messages, then its end (the
                   connection goes back to the pool)
    ControlError   a call that ended with a status other than OK

kvstore_client._rpc routes a Channel's calls here (its _Routed stubs) when the client
maps the arena.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstore import control
from kvstore_client import errors

log = logging.getLogger(__name__)


class _Code(collections.namedtuple("_Code", ("name",))):
    """A status code as errors.from_rpc_error reads it (grpc.StatusCode's `name`)."""


class ControlError(Exception):
    """A call on the control socket that ended with a status other than OK."""

    def __init__(self, code: int | str, details: str) -> None:
        super().__init__(details)
        self._code = _Code(control.status_name(code) if isinstance(code, int) else code)
        self._details = details

    def code(self) -> _Code:
        return self._code

    def details(self) -> str:
        return self._details


_CONNECT_TIMEOUT = 2.0
# an idle connection is reused for this long: half the daemon's idle limit
# (kvstore_server.rpc.control.IDLE_SECONDS), so it never closes one as a call arrives
_REUSE_SECONDS = 60.0
# after a connect failed (too many connections, the socket gone, another daemon run)
_RETRY_SECONDS = 30.0
_FINISH_WAIT = 0.5  # for the end of a stream whose last message was read
_IDLE_CONNECTIONS = 16


class _Connection:
    """One connection to the control socket, READY read (the daemon run checked)."""

    def __init__(self, path: Path, store_id: str, timeout: float | None) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(_CONNECT_TIMEOUT, timeout or _CONNECT_TIMEOUT))
            control.connect(sock, path)
            ran = control.parse_ready(control.recv_frame(sock, limit=4096))
            if ran != store_id:
                raise control.FrameError(f"it belongs to daemon run {ran}, not {store_id}")
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.pid = os.getpid()
        self.used = time.monotonic()  # when its last call ended

    def alive(self) -> bool:
        """Whether the daemon still holds this idle connection open (it sends nothing
        between calls: anything readable is its end)."""
        try:
            self.sock.settimeout(0.0)
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; bytes: not a call's answer
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def send(self, method: str, request: bytes, timeout: float | None, token: str | None) -> None:
        self.sock.settimeout(timeout)
        control.send_frame(self.sock, control.call_head(method, timeout, token), request)

    def close(self) -> None:
        self.sock.close()

    def __del__(self) -> None:
        # a client dropped without close(): its idle connections go with it (as its
        # gRPC channel's do)
        sock = getattr(self, "sock", None)  # None: __init__ failed (and closed it)
        if sock is not None:
            sock.close()


class Control:
    """The daemon's control socket at `path` (offered in ArenaAccessResponse.control_socket):
    unary calls and PinStream for a fraction of a gRPC call's cost, on a pool of
    connections, one call at a time each. A call that cannot connect (the socket gone, too
    many connections, another daemon run) answers None: its caller uses gRPC, and so do
    the calls of the next _RETRY_SECONDS (`usable` is false meanwhile). Thread-safe; a
    forked child opens its own."""

    def __init__(self, path: Path, store_id: str, token: str | None) -> None:
        self.path = path
        self.store_id = store_id
        self._token = token
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0  # after a failed connect: gRPC until then

    @property
    def usable(self) -> bool:
        return not self._closed and time.monotonic() >= self._down_until

    def _take(self, timeout: float | None) -> _Connection | None:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.pid == os.getpid() and time.monotonic() - conn.used < _REUSE_SECONDS and conn.alive():
                    return conn
                # the daemon closed it (it stopped), or soon will (idle), or the parent's
                # across a fork
                conn.close()
            if not self.usable:
                return None
        try:
            return _Connection(self.path, self.store_id, timeout)
        except (OSError, control.Closed, control.FrameError) as exc:
            self._down_until = time.monotonic() + _RETRY_SECONDS
            log.info(
                "the control socket %s cannot be used (%s): calls go over gRPC for %.0f s",
                self.path, exc, _RETRY_SECONDS,
            )  # fmt: skip
            return None

    def _give_back(self, conn: _Connection) -> None:
        conn.used = time.monotonic()
        with self._lock:
            if self.usable and len(self._idle) < _IDLE_CONNECTIONS:
                self._idle.append(conn)
                return
        conn.close()

    def _start(self, method: str, request: bytes, timeout: float | None) -> _Connection | None:
        """A connection with the call sent on it; None: not reachable here, use gRPC."""
        conn = self._take(timeout)
        if conn is not None:
            with _closing_on_failure(conn, method):
                conn.send(method, request, timeout, self._token)
        return conn

    def unary(self, method: str, request: bytes, timeout: float | None) -> memoryview | None:
        """The serialized response; None: not reachable here, use gRPC. Raises ControlError."""
        conn = self._start(method, request, timeout)
        if conn is None:
            return None
        with _closing_on_failure(conn, method):
            frame = control.recv_frame(conn.sock)
        if frame[0] == control.REPLY:
            self._give_back(conn)
            return frame[1:]
        if frame[0] == control.STATUS:
            self._give_back(conn)
            raise ControlError(*control.parse_status(frame))
        conn.close()
        raise ControlError("INTERNAL", f"{method}: the daemon answered a frame of kind {frame[0]}")

    def stream(
        self, method: str, request: bytes, decode: Callable[[bytes], Any], timeout: float | None
    ) -> ControlStream | None:
        """A server stream's messages; None: not reachable here, use gRPC."""
        conn = self._start(method, request, timeout)
        return ControlStream(self, conn, method, decode) if conn is not None else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


_LOST = (OSError, control.Closed, control.FrameError)


@contextlib.contextmanager
def _closing_on_failure(conn: _Connection, method: str) -> Iterator[None]:
    """A call's send or receive: on any failure the connection is closed (its stream is
    out of step), and a lost connection raises as gRPC would (_lost)."""
    try:
        yield
    except _LOST as exc:
        conn.close()
        raise _lost(method, exc) from exc
    except BaseException:
        conn.close()
        raise


def _lost(method: str, exc: Exception) -> errors.KVStoreError:
    """What a call whose connection failed raises: DEADLINE_EXCEEDED for a timeout, else
    UNAVAILABLE (as gRPC reports a connection lost mid-call)."""
    if isinstance(exc, TimeoutError):
        return errors.from_rpc_error(ControlError("DEADLINE_EXCEEDED", f"{method}: the deadline passed"))
    return errors.from_rpc_error(ControlError("UNAVAILABLE", f"{method}: the control socket: {exc}"))


class ControlStream:
    """A server stream on the control socket (PinStream): iterate its messages (KVStoreError
    for a failed call); cancel() ends it from any thread. A stream cancelled after its
    last message, its end already received, keeps its connection for the next call."""

    def __init__(
        self, owner: Control, conn: _Connection, method: str, decode: Callable[[bytes], Any]
    ) -> None:
        self._owner = owner
        self._conn: _Connection | None = conn
        self._method = method
        self._decode = decode
        self._cancelled = False
        self._reading = threading.Lock()  # held by the thread in __next__

    def __iter__(self) -> ControlStream:
        return self

    def __next__(self) -> Any:
        with self._reading:
            conn = self._conn
            if conn is None:
                raise StopIteration
            try:
                frame = control.recv_frame(conn.sock)
            except BaseException as exc:
                self._end(keep=False)
                if not isinstance(exc, _LOST):
                    raise
                if self._cancelled:
                    raise errors.from_rpc_error(
                        ControlError("CANCELLED", f"{self._method} was cancelled")
                    ) from exc
                raise _lost(self._method, exc) from exc
            if frame[0] == control.MESSAGE:
                return self._decode(bytes(frame[1:]))
            if frame[0] == control.STATUS:
                code, details = control.parse_status(frame)
                self._end(keep=True)
                if code == 0:
                    raise StopIteration
                raise errors.from_rpc_error(ControlError(code, details))
            self._end(keep=False)
            raise errors.from_rpc_error(
                ControlError("INTERNAL", f"{self._method}: a frame of kind {frame[0]}")
            )

    def _end(self, *, keep: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if keep:
            self._owner._give_back(conn)
        else:
            conn.close()

    def _read_end(self, conn: _Connection, wait: float) -> bool:
        """Read the call's remaining messages and its status, waiting `wait` seconds at
        most; whether the end was read (the connection is then ready for another call)."""
        try:
            conn.sock.settimeout(wait)
            while True:
                frame = control.recv_frame(conn.sock)
                if frame[0] == control.STATUS:
                    return True
                if frame[0] != control.MESSAGE:
                    return False
        except _LOST:  # nothing more yet, or halfway through a frame
            return False

    def cancel(self) -> None:
        """End the call (the daemon sees the connection close); safe from any thread, and twice."""
        self._close(wait=0.0)

    def finish(self) -> None:
        """The caller has every message it needs and the daemon is ending the stream: read
        its end (briefly), so the connection serves the next call; else as cancel()."""
        self._close(wait=_FINISH_WAIT)

    def _close(self, wait: float) -> None:
        self._cancelled = True
        if not self._reading.acquire(blocking=False):
            conn = self._conn  # another thread waits in __next__: wake it
            if conn is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError as exc:
                    log.debug("cancelling %s: %s", self._method, exc)
            return
        try:
            conn = self._conn
            if conn is not None:
                self._end(keep=self._read_end(conn, wait))
        finally:
            self._reading.release()

    def __del__(self) -> None:
        # dropped unfinished (as a gRPC call is cancelled when dropped)
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.close()

"""The control socket: the daemon's unary calls and PinStream over a Unix socket beside
the arena file (framing: kvstore.control), answered by the same method handlers as gRPC,
through the same interceptors (metrics, auth), so a call means the same either way.

Only clients that can open the arena reach it: the socket has the arena file's mode and
group, and is offered in ArenaAccessResponse.control_socket. A connection has a thread of
its own and carries one call at a time; beyond `max_connections` the daemon closes a new
connection at once (its client uses gRPC), and it closes one idle for `IDLE_SECONDS`.
A call's request is at most kvstore.control.MAX_REQUEST_BYTES (a client sends a larger
one over gRPC), and the daemon holds at most CALL_BUDGET_BYTES of them at once: all the
socket adds to the daemon's memory. Put, Get, DropSelect and Watch are not offered
here: UNIMPLEMENTED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore import control
from kvstore.service import SERVICE_PREFIX

log = logging.getLogger(__name__)


# The server streams served here: the others (Get, DropSelect, Watch) answer in initial
# metadata, which this socket does not carry
_STREAMS = frozenset({"PinStream"})

IDLE_SECONDS = 120.0
"""A connection without a call for this long is closed (clients reuse theirs for half of it)."""


class _Details(NamedTuple):
    """grpc.HandlerCallDetails, as the interceptors read it."""

    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _Aborted(Exception):
    """context.abort: the handler's call ends with this status."""


class _Context:
    """The part of grpc.ServicerContext the handlers and interceptors use, for one call."""

    def __init__(
        self, conn: socket.socket, metadata: tuple[tuple[str, str], ...], timeout: float | None
    ) -> None:
        self._conn = conn
        self._metadata = metadata
        self._deadline = time.monotonic() + timeout if timeout is not None else None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._callbacks: list[Callable[[], None]] = []
        self._over = False
        self._cancelled = False

    # ---- grpc.ServicerContext
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        raise _Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self._over:
            return False
        self._callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        """False once the call ended, its client went away or its deadline passed."""
        if self._over or self._cancelled:
            return False
        if self._deadline is not None and time.monotonic() > self._deadline:
            return False
        readable, _, _ = select.select([self._conn], [], [], 0)
        if readable:  # a client sends nothing during a call: this is its end (EOF or reset)
            self._cancelled = True
        return not self._cancelled

    def send_initial_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Not carried: the calls served here (_STREAMS) answer nothing in it."""

    def peer(self) -> str:
        return "unix:control"

    # ---- this module's
    def cancel(self) -> None:
        self._cancelled = True
        if self._code is None:
            self._code = grpc.StatusCode.CANCELLED

    def end(self) -> None:
        """The call is over: run its callbacks (as gRPC does when a call terminates)."""
        self._over = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a call's end callback failed")

    def status(self) -> tuple[int, str]:
        code = self._code or grpc.StatusCode.OK
        return code.value[0], self._details


class _Budget:
    """Bytes of requests held at once, across connections: a call whose request would go
    over waits for others to be answered (a request is at most a tenth of the budget)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._freed = threading.Condition()

    @contextlib.contextmanager
    def taking(self, n: int) -> Iterator[None]:
        with self._freed:
            while self._used + n > self._limit:
                self._freed.wait()
            self._used += n
        try:
            yield
        finally:
            with self._freed:
                self._used -= n
                self._freed.notify_all()


def _serialized(handler: Any, response: Any) -> bytes:
    serialize = handler.response_serializer
    return serialize(response) if serialize is not None else response  # type: ignore[no-any-return]


class ControlSocket:
    """Serves `handler` (through `interceptors`, outermost first) on a Unix socket at `path`
    until `close`. The accept thread starts at once."""

    def __init__(
        self,
        path: Path,
        handler: grpc.GenericRpcHandler,
        interceptors: Sequence[grpc.ServerInterceptor],
        store_id: str,
        *,
        group: int | None = None,
        max_connections: int = 64,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.path = path
        self._handler = handler
        self._interceptors = tuple(interceptors)
        self._ready = control.ready_frame(store_id)
        self._max_connections = max_connections
        self._idle_seconds = idle_seconds
        self._budget = _Budget(control.CALL_BUDGET_BYTES)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self.accepted = 0  # connections served
        self.refused = 0  # connections closed at once, over max_connections
        self.calls = 0  # calls answered (any status)
        if path.is_socket():  # an earlier run's (a SIGKILLed daemon), of the same name
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # created with no access for others, then given the arena file's mode and group
            old_umask = os.umask(0o177)
            try:
                control.bind(listener, path)
            finally:
                os.umask(old_umask)
            if group is not None:
                os.chown(path, -1, group)
                os.chmod(path, 0o660)
            listener.listen(max_connections)
        except OSError:
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            raise
        self._listener = listener
        self._thread = threading.Thread(target=self._accept, name="kvstore-control", daemon=True)
        self._thread.start()

    # ---- connections
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._connections) >= self._max_connections:
                    self.refused += not self._closed
                    conn.close()
                    continue
                self._connections.add(conn)
                self.accepted += 1
            threading.Thread(
                target=self._serve, args=(conn,), name="kvstore-control-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            # a connection that sends no call for this long is closed: a client that went
            # away without closing it, or one that keeps connections it does not use
            conn.settimeout(self._idle_seconds)
            control.send_frame(conn, self._ready)
            while True:
                length = control.recv_length(conn, control.MAX_CALL_FRAME_BYTES)
                with self._budget.taking(length):  # the request's bytes, until it is answered
                    frame = control.recv_body(conn, length)
                    try:
                        method, timeout, token, payload = control.parse_call(frame)
                    except control.FrameError as exc:
                        self._send_status(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                        return
                    self.calls += 1
                    self._call(conn, method, timeout, token, payload)
                    del frame, payload
        except control.Closed:
            pass
        except control.FrameError as exc:
            # over the size limit, or cut short: the rest of the stream cannot be framed
            with contextlib.suppress(OSError):
                self._send_status(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except OSError as exc:
            log.debug("control connection ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _call(
        self, conn: socket.socket, method: str, timeout: float | None, token: str | None, payload: memoryview
    ) -> None:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        handler = self._method_handler(_Details(SERVICE_PREFIX + method, metadata))
        if (
            handler is None
            or handler.request_streaming
            or (handler.response_streaming and method not in _STREAMS)
        ):
            what = "not a method of this service" if handler is None else "not served here (use gRPC)"
            self._send_status(conn, grpc.StatusCode.UNIMPLEMENTED, f"{method}: {what}")
            return
        context = _Context(conn, metadata, timeout)
        try:
            raw = bytes(payload)
            request = handler.request_deserializer(raw) if handler.request_deserializer else raw
            if handler.response_streaming:
                self._stream(conn, handler, request, context)
            else:
                response = handler.unary_unary(request, context)
                code, details = context.status()
                if code == 0:
                    control.send_frame(conn, bytes((control.REPLY,)), _serialized(handler, response))
                else:
                    control.send_frame(conn, control.status_head(code, details))
        except _Aborted:
            control.send_frame(conn, control.status_head(*context.status()))
        except OSError:
            context.cancel()
            raise
        except Exception:
            log.exception("%s failed on the control socket", method)
            self._send_status(conn, grpc.StatusCode.INTERNAL, f"{method} failed in the daemon")
        finally:
            context.end()

    def _stream(self, conn: socket.socket, handler: Any, request: Any, context: _Context) -> None:
        head = bytes((control.MESSAGE,))
        responses = handler.unary_stream(request, context)
        try:
            for response in responses:
                control.send_frame(conn, head, _serialized(handler, response))
        except OSError:
            context.cancel()
            raise
        finally:
            close = getattr(responses, "close", None)
            if close is not None:
                close()  # a cancelled stream's generator runs its finally blocks now
        control.send_frame(conn, control.status_head(*context.status()))

    def _method_handler(self, details: _Details) -> Any:
        def through(i: int, d: Any) -> Any:
            if i == len(self._interceptors):
                return self._handler.service(d)
            return self._interceptors[i].intercept_service(lambda nxt: through(i + 1, nxt), d)

        return through(0, details)

    @staticmethod
    def _send_status(conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        control.send_frame(conn, control.status_head(code.value[0], details))

    # ---- lifecycle
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self) -> None:
        """Stop accepting, remove the socket file, and end the open connections (a call in
        a handler finishes; its answer finds the connection closed). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

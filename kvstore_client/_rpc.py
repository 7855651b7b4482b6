"""The client's gRPC edge, and the only client module that imports grpc.

    Channel       the channel (TLS, bearer token, keepalive), one stub per RPC, unary calls;
                  on the daemon's host, its control socket for the calls it answers there
    ServerStream  a server-streaming call (Get, DropSelect, Watch): its messages
    PutCall       a Put in flight: its answer, or cancel it
    Control       the daemon's control socket (kvstore.control): a pool of connections

Every grpc.RpcError is turned into a kvstore_client.errors exception here
(`raise ... from exc`); the rest of the client sees only those.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore import control, wire
from kvstore.service import SERVICE_NAME, SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors

log = logging.getLogger(__name__)


def _pem(value: str | Path | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call (works without TLS too)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._header],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class ServerStream:
    """A server-streaming call's messages; iterating raises KVStoreError for a failed call.

    `cancel_ends`: after our own `cancel()`, the CANCELLED status ends the iteration
    quietly (Watch) instead of raising PutAborted (Get, DropSelect).
    """

    def __init__(self, call: Any, *, cancel_ends: bool = False) -> None:
        self._call = call
        self._cancel_ends = cancel_ends
        self._cancelled = False

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if self._cancel_ends and self._cancelled and exc.code() is grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise errors.from_rpc_error(exc) from exc

    def initial_metadata(self, required: str, what: str) -> dict[str, str]:
        """The call's initial metadata, waiting for it; raises the call's error when it
        ended without sending `required` (StoreInternalError if it ended OK)."""
        metadata = dict(self._call.initial_metadata() or ())
        if required not in metadata:
            if self._call.code() is grpc.StatusCode.OK:
                raise errors.StoreInternalError(f"{what} stream ended before it started")
            raise errors.from_rpc_error(self._call)
        return metadata

    def cancel(self) -> None:
        """End the call; safe from any thread, and twice."""
        self._cancelled = True
        self._call.cancel()


class PutCall:
    """A Put (client stream) in flight, sending what `requests` yields."""

    def __init__(self, method: Any, requests: Iterator[Any]) -> None:
        # NOTE: no gRPC deadline: it would run through the writer's own time too.
        self._future = method.future(requests)

    def result(self, timeout: float) -> pb.PutResponse | None:
        """The store's answer, or None when it has not come within `timeout` seconds.
        Raises PutAborted after cancel(), and the KVStoreError of a failed call."""
        try:
            return self._future.result(timeout=timeout)  # type: ignore[no-any-return]
        except grpc.FutureTimeoutError:
            return None
        except grpc.FutureCancelledError as exc:
            raise errors.PutAborted("the put was aborted before its commit was answered") from exc
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc

    def cancel(self) -> None:
        self._future.cancel()


class ProgressStream:
    """A server stream of small messages: iterate it; gRPC errors become KVStoreError
    (UNIMPLEMENTED: a daemon that predates the call); cancel() ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> ProgressStream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc

    def cancel(self) -> None:
        self._call.cancel()

    def finish(self) -> None:
        """Every message needed was read: end the call (as cancel)."""
        self._call.cancel()


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


class _Routed:
    """A unary call that goes over the control socket when the channel has one it can
    reach, else over gRPC: called like a gRPC stub, `(request, timeout=...)`."""

    def __init__(self, channel: Channel, name: str, stub: Any, decode: Callable[[bytes], Any]) -> None:
        self._channel = channel
        self.name = name
        self._stub = stub
        self._decode = decode

    def __call__(self, request: Any, timeout: float | None = None) -> Any:
        ctl = self._channel.control
        if ctl is not None and ctl.usable:
            serialized = request.SerializeToString()
            if len(serialized) <= control.MAX_REQUEST_BYTES:  # else over gRPC
                try:
                    raw = ctl.unary(self.name, serialized, timeout)
                except ControlError as exc:
                    raise errors.from_rpc_error(exc) from exc
                if raw is not None:
                    return self._decode(bytes(raw))
        return self._stub(request, timeout=timeout)


class Channel:
    """One daemon's channel and a stub per RPC. Thread-safe, like grpc's channel."""

    def __init__(
        self,
        address: str,
        *,
        channel_options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | Path | bytes | None = None,
        tls_cert: str | Path | bytes | None = None,
        tls_key: str | Path | bytes | None = None,
    ) -> None:
        """TLS when `tls` is true or a CA or certificate is given; see KVStoreClient."""
        options = [
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            *wire.CLIENT_KEEPALIVE,
            *channel_options,
        ]
        if tls or tls_ca is not None or tls_cert is not None:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key go together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert)
            )
            raw = grpc.secure_channel(address, credentials, options=options)
        else:
            raw = grpc.insecure_channel(address, options=options)
        self._raw = raw
        self._channel = grpc.intercept_channel(raw, _Bearer(token)) if token else raw
        self._token = token
        # the daemon's control socket, once ArenaAccess offered one (use_control)
        self.control: Control | None = None
        unary = self._channel.unary_unary
        self.lookup = _Routed(
            self,
            "Lookup",
            unary(
                SERVICE_PREFIX + "Lookup", pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
            ),
            pb.LookupResponse.FromString,
        )
        self._put = self._channel.stream_unary(
            SERVICE_PREFIX + "Put", wire.encode_put_request, pb.PutResponse.FromString
        )
        self._get = self._channel.unary_stream(
            SERVICE_PREFIX + "Get", pb.GetRequest.SerializeToString, wire.decode_get_response
        )
        self._drop_select = self._channel.unary_stream(
            SERVICE_PREFIX + "DropSelect", pb.DropSelectRequest.SerializeToString, wire.decode_get_response
        )
        self.evict = unary(
            SERVICE_PREFIX + "Evict", pb.EvictRequest.SerializeToString, pb.EvictResponse.FromString
        )
        self.stats = unary(
            SERVICE_PREFIX + "Stats", pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString
        )
        self.list = unary(
            SERVICE_PREFIX + "List", pb.ListRequest.SerializeToString, pb.ListResponse.FromString
        )
        self.describe = unary(
            SERVICE_PREFIX + "Describe", pb.DescribeRequest.SerializeToString, pb.DescribeResponse.FromString
        )
        self._watch = self._channel.unary_stream(
            SERVICE_PREFIX + "Watch", pb.WatchRequest.SerializeToString, pb.Event.FromString
        )
        self._pin_stream = self._channel.unary_stream(
            SERVICE_PREFIX + "PinStream", pb.PinRequest.SerializeToString, pb.PinProgress.FromString
        )
        self.local_access = unary(
            SERVICE_PREFIX + "LocalAccess",
            pb.LocalAccessRequest.SerializeToString,
            pb.LocalAccessResponse.FromString,
        )

        # the memory tier's control plane (kvstore_client.arena), by method name; all but
        # ArenaAccess (which offers the control socket) go over that socket where it can
        self.arena = {
            name: _Routed(
                self,
                name,
                unary(SERVICE_PREFIX + name, request.SerializeToString, response.FromString),
                response.FromString,
            )
            if name != "ArenaAccess"
            else unary(SERVICE_PREFIX + name, request.SerializeToString, response.FromString)
            for name, request, response in (
                ("ArenaAccess", pb.ArenaAccessRequest, pb.ArenaAccessResponse),
                ("Reserve", pb.ReserveRequest, pb.ReserveResponse),
                ("ReserveMany", pb.ReserveManyRequest, pb.ReserveManyResponse),
                ("Commit", pb.CommitRequest, pb.PutResponse),
                ("CommitMany", pb.CommitManyRequest, pb.CommitManyResponse),
                ("Abort", pb.AbortRequest, pb.AbortResponse),
                ("Pin", pb.PinRequest, pb.PinResponse),
                ("PinMany", pb.PinManyRequest, pb.PinManyResponse),
                ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
            )
        }

    @staticmethod
    def unary(method: Any, request: Any, timeout: float) -> Any:
        """Call one of the unary stubs above (lookup, evict, ...). Raises KVStoreError."""
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc

    def pin_stream(self, request: pb.PinRequest, timeout: float) -> ProgressStream | ControlStream:
        """The PinStream call: PinProgress messages (KVStoreError on failure)."""
        ctl = self.control
        serialized = request.SerializeToString() if ctl is not None and ctl.usable else b""
        if ctl is not None and 0 < len(serialized) <= control.MAX_REQUEST_BYTES:
            stream = ctl.stream("PinStream", serialized, pb.PinProgress.FromString, timeout)
            if stream is not None:
                return stream
        return ProgressStream(self._pin_stream(request, timeout=timeout))

    def use_control(self, path: str, store_id: str) -> None:
        """Send the calls the daemon answers on its control socket at `path` (this host's
        daemon run `store_id`; empty: none) there from now on; gRPC where it cannot be
        reached. Kept while the daemon run is the same."""
        old = self.control
        if old is not None and old.store_id == store_id and str(old.path) == path:
            return
        self.control = Control(Path(path), store_id, self._token) if path else None
        if old is not None:
            old.close()

    def get(self, request: pb.GetRequest, timeout: float) -> ServerStream:
        return ServerStream(self._get(request, timeout=timeout))

    def drop_select(self, request: pb.DropSelectRequest, timeout: float) -> ServerStream:
        return ServerStream(self._drop_select(request, timeout=timeout))

    def watch(self, request: pb.WatchRequest, timeout: float | None) -> ServerStream:
        return ServerStream(self._watch(request, timeout=timeout), cancel_ends=True)

    def put(self, requests: Iterator[Any]) -> PutCall:
        return PutCall(self._put, requests)

    def health(self, timeout: float) -> str:
        """The standard gRPC health status of the KVStore service: 'SERVING', 'NOT_SERVING', ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        resp = self.unary(stub.Check, request, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        self._raw.close()

"""The client's gRPC edge, and the only client module that imports grpc.

    Channel       the channel (TLS, bearer token, keepalive), one stub per RPC, unary calls;
                  on the daemon's host, its control socket for the calls it answers there
    ServerStream  a server-streaming call (Get, DropSelect, Watch): its messages
    PutCall       a Put in flight: its answer, or cancel it
    _Routed       a unary call over the daemon's control socket where the client has one
                  (kvstore_client._control), else over gRPC

Every grpc.RpcError is turned into a kvstore_client.errors exception here
(`raise ... from exc`); the rest of the client sees only those.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore import control, wire
from kvstore.service import SERVICE_NAME, SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client._control import Control, ControlError, ControlStream

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

"""The status codes of the gRPC edge: the error table and the decorator/decoder machinery.

Every request is checked (kvstore_server.rpc.validation) before it reaches the store;
every store error is translated to a status code here and nowhere else (ABORTED, for a
Put stream that ends before its commit, the servicer sets itself):

    INVALID_ARGUMENT    malformed or undecodable request (sizes, counts, dtypes, shapes, keys)
    RESOURCE_EXHAUSTED  over a documented limit, or no room in the store
    DEADLINE_EXCEEDED   DropSelect waited its full time
    NOT_FOUND           Describe of a block that is not stored
    ABORTED             Put stream closed before its commit (nothing stored)
    OUT_OF_RANGE        Watch from (or fallen behind to) a sequence no longer held
    NOT_FOUND           ... and Commit/Abort of a reservation that no longer exists
    FAILED_PRECONDITION LocalAccess on a daemon that does not offer local reads, memory-tier
                        calls on one without a memory tier (or not offering it to clients)
    UNAVAILABLE         the daemon is shutting down (also ends Watch streams)
    INTERNAL            the backend failed (logged with details)

`_STATUS` is that table as code; `translated` wraps each Servicer method with it, and
`_decoder` makes request deserializers that never raise (undecodable is INVALID_ARGUMENT).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvstore import wire
from kvstore_server.errors import (
    CapacityError,
    EventsOutOfRange,
    FleetUnavailable,
    InvalidChain,
    InvalidCommit,
    InvalidPart,
    InvalidRequest,
    LeaseNotFound,
    LocalReadsOff,
    MalformedPut,
    NoFleet,
    NoMemoryTier,
    NotFoundError,
    ShuttingDown,
    WaitTimeout,
)
from kvstore_server.tiers import StorageError

if TYPE_CHECKING:
    from kvstore_server.rpc.servicer import Servicer

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


_STATUS = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (MalformedPut, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidChain, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidCommit, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidPart, grpc.StatusCode.INVALID_ARGUMENT),
    (LeaseNotFound, grpc.StatusCode.NOT_FOUND),
    (NoMemoryTier, grpc.StatusCode.FAILED_PRECONDITION),
    (NoFleet, grpc.StatusCode.FAILED_PRECONDITION),
    (FleetUnavailable, grpc.StatusCode.UNAVAILABLE),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WaitTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (EventsOutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (LocalReadsOff, grpc.StatusCode.FAILED_PRECONDITION),
)


REFUSALS = (*(kind for kind, _ in _STATUS), StorageError)
"""What a call may fail with: each has its status code (status_of); StorageError: INTERNAL."""


def status_of(exc: Exception) -> grpc.StatusCode:
    """The status code of one of REFUSALS (a backend failure, INTERNAL, is logged)."""
    for kind, code in _STATUS:
        if isinstance(exc, kind):
            return code
    log.error("backend failure: %s", exc)
    return grpc.StatusCode.INTERNAL


def _abort_for(context: grpc.ServicerContext, exc: Exception) -> NoReturn:
    code = status_of(exc)
    context.abort(code, str(exc) if code != grpc.StatusCode.INTERNAL else f"storage failure: {exc}")
    raise RuntimeError("context.abort returned") from exc  # it raises; this keeps type checkers honest


def translated(method: F) -> F:
    """Map store and validation errors to status codes (unary and streaming methods)."""
    errors = REFUSALS

    @functools.wraps(method)
    def unary(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, _decoded(request), context)
        except errors as exc:
            _abort_for(context, exc)

    @functools.wraps(method)
    def streaming(self: Servicer, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, _decoded(request), context)
        except errors as exc:
            _abort_for(context, exc)

    return streaming if inspect.isgeneratorfunction(method) else unary  # type: ignore[return-value]


def _decoded(request: Any) -> Any:
    """The request, unless it did not decode (see `_decoder`): then INVALID_ARGUMENT."""
    if isinstance(request, wire.Malformed):
        raise InvalidRequest(request.reason)
    return request


def _decoder(message: type[Message]) -> Callable[[bytes], Any]:
    """A request deserializer that never raises. gRPC answers a deserializer's
    exception (or None) with INTERNAL "Exception deserializing request!"; a
    client's garbage is INVALID_ARGUMENT, so it becomes a Malformed value that
    the `translated` method refuses. (Put streams decode through wire.decode_put_request.)"""
    name = message.DESCRIPTOR.name

    def decode(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except DecodeError as exc:
            return wire.Malformed(f"undecodable {name}: {exc}")

    return decode

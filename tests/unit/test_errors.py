"""kvstore_client.errors: gRPC status codes -> the client's exception tree."""

from __future__ import annotations

import grpc
import pytest

from kvstore_client import errors
from kvstore_client.errors import (
    AuthError,
    BlockNotFound,
    CapacityExceeded,
    EventsOutOfRange,
    InvalidRequest,
    KVStoreError,
    NotOffered,
    PutAborted,
    StoreInternalError,
    StoreTimeout,
    StoreUnavailable,
    from_rpc_error,
)


class RpcError(grpc.RpcError, grpc.Call):
    """The shape of the errors a grpc channel raises: an RpcError that is also a Call."""

    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        super().__init__()
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details

    # the rest of grpc.Call, unused here
    def initial_metadata(self):  # pragma: no cover
        return ()

    def trailing_metadata(self):  # pragma: no cover
        return ()

    def is_active(self) -> bool:  # pragma: no cover
        return False

    def time_remaining(self):  # pragma: no cover
        return None

    def cancel(self) -> bool:  # pragma: no cover
        return False

    def add_callback(self, callback) -> bool:  # pragma: no cover
        return False


DOCUMENTED = {
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreTimeout,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceeded,
    grpc.StatusCode.NOT_FOUND: BlockNotFound,
    grpc.StatusCode.ABORTED: PutAborted,
    grpc.StatusCode.CANCELLED: PutAborted,
    grpc.StatusCode.OUT_OF_RANGE: EventsOutOfRange,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.FAILED_PRECONDITION: NotOffered,
}


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_every_status_code_maps_to_its_documented_class(code: grpc.StatusCode) -> None:
    exc = from_rpc_error(RpcError(code, "something happened"))
    want = DOCUMENTED.get(code, StoreInternalError)
    assert type(exc) is want
    assert isinstance(exc, KVStoreError)
    assert exc.code == code.name
    assert str(exc) == f"{code.name}: something happened"


def test_everything_else_is_internal() -> None:
    for code in (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNIMPLEMENTED,
    ):
        assert type(from_rpc_error(RpcError(code, "x"))) is StoreInternalError


def test_message_without_details() -> None:
    exc = from_rpc_error(RpcError(grpc.StatusCode.UNAVAILABLE, None))
    assert str(exc) == "UNAVAILABLE"
    assert exc.code == "UNAVAILABLE"


def test_rpc_error_without_a_code() -> None:
    class Bare(grpc.RpcError):
        def __str__(self) -> str:
            return "bare failure"

    exc = from_rpc_error(Bare())
    assert type(exc) is StoreInternalError
    assert exc.code is None
    assert "bare failure" in str(exc)


def test_exception_tree() -> None:
    assert issubclass(StoreTimeout, TimeoutError)
    assert issubclass(InvalidRequest, ValueError)
    for cls in (
        StoreUnavailable,
        StoreTimeout,
        InvalidRequest,
        CapacityExceeded,
        BlockNotFound,
        PutAborted,
        EventsOutOfRange,
        AuthError,
        StoreInternalError,
    ):
        assert issubclass(cls, KVStoreError)
    assert not issubclass(CapacityExceeded, ValueError)
    assert not issubclass(StoreUnavailable, TimeoutError)
    # catching the builtin catches the client error
    with pytest.raises(TimeoutError):
        raise from_rpc_error(RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    with pytest.raises(ValueError):
        raise from_rpc_error(RpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad"))


def test_kvstore_error_code_attribute() -> None:
    assert KVStoreError("m").code is None
    assert KVStoreError("m", "NOT_FOUND").code == "NOT_FOUND"
    assert str(KVStoreError("message")) == "message"


def test_every_exported_error_is_documented() -> None:
    names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, KVStoreError)}
    doc = errors.__doc__ or ""
    assert all(name in doc for name in names)

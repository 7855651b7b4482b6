"""Every exception the client raises, in one tree.

    KVStoreError                    base; catch this to catch them all
    ├── StoreUnavailable            daemon unreachable or shutting down, or the connection
    │                               broke (UNAVAILABLE). Retry later or recompute. A put
    │                               whose connection broke after its commit was sent may
    │                               have committed (a retry skips what is stored); nothing
    │                               else changed on the store.
    ├── StoreTimeout                deadline passed (DEADLINE_EXCEEDED); also a TimeoutError.
    │                               A put may or may not have committed; a drop_select
    │                               removed nothing.
    ├── InvalidRequest              the daemon refused the request (INVALID_ARGUMENT);
    │                               also a ValueError. Fix the call; nothing was stored.
    ├── CapacityExceeded            over a server limit or no room (RESOURCE_EXHAUSTED).
    │                               Nothing was stored; smaller or later may succeed.
    ├── BlockNotFound               describe of a block that is not stored (NOT_FOUND).
    ├── PutAborted                  a put stream ended without commit (ABORTED, CANCELLED);
    │                               nothing was stored.
    ├── EventsOutOfRange            watch from a sequence the daemon no longer holds, or a
    │                               watcher that fell behind its window (OUT_OF_RANGE).
    │                               Events were missed: resync with List, then watch from 0.
    ├── AuthError                   UNAUTHENTICATED or PERMISSION_DENIED
    ├── NotOffered                  the daemon is configured without what was asked
    │                               (FAILED_PRECONDITION), e.g. LocalAccess with local reads off
    ├── LocalDataCorrupt            a same-host read found bytes failing their checksum; the
    │                               daemon was told (it removes the block); read it again
    ├── LoadIncomplete              a pin's blocks could not all be read from the daemon's
    │                               persistent tier (PinStream ended early): do not use the
    │                               layers not reported ready; release, recompute
    └── StoreInternalError          anything else the daemon reported (INTERNAL, ...)

Who catches what: serving code (the vLLM connector) catches KVStoreError and
recomputes; tools (the CLI) print the message and exit non-zero.
"""

from __future__ import annotations

from typing import Any


class KVStoreError(Exception):
    """Base class. `code` is the gRPC status code name when one was received."""

    code: str | None = None

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class StoreUnavailable(KVStoreError):
    pass


class StoreTimeout(KVStoreError, TimeoutError):
    pass


class InvalidRequest(KVStoreError, ValueError):
    pass


class CapacityExceeded(KVStoreError):
    pass


class BlockNotFound(KVStoreError):
    pass


class PutAborted(KVStoreError):
    pass


class EventsOutOfRange(KVStoreError):
    pass


class AuthError(KVStoreError):
    pass


class NotOffered(KVStoreError):
    pass


class LocalDataCorrupt(KVStoreError):
    pass


class LoadIncomplete(KVStoreError):
    """The daemon could not read all of a pin's blocks from its persistent tier."""


class StoreInternalError(KVStoreError):
    pass


# gRPC status code names (grpc.StatusCode.*.name): this module imports no grpc, so
# code that only catches these errors does not load it.
_BY_CODE: dict[str, type[KVStoreError]] = {
    "UNAVAILABLE": StoreUnavailable,
    "DEADLINE_EXCEEDED": StoreTimeout,
    "INVALID_ARGUMENT": InvalidRequest,
    "RESOURCE_EXHAUSTED": CapacityExceeded,
    "NOT_FOUND": BlockNotFound,
    "ABORTED": PutAborted,
    "CANCELLED": PutAborted,
    "OUT_OF_RANGE": EventsOutOfRange,
    "UNAUTHENTICATED": AuthError,
    "PERMISSION_DENIED": AuthError,
    "FAILED_PRECONDITION": NotOffered,
}


# grpc.StatusCode values by name (the `refused_code` of a ReserveMany answer)
_CODE_NAMES = {
    1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
    6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
    10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
    15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}  # fmt: skip


def from_code(code: int, details: str) -> KVStoreError:
    """The client exception for a status code given as its number (and its details)."""
    name = _CODE_NAMES.get(code, "UNKNOWN")
    return _BY_CODE.get(name, StoreInternalError)(f"{name}: {details}", name)


def from_rpc_error(exc: Any) -> KVStoreError:
    """The client exception for a grpc.RpcError (or a failed call); raise it `from exc`."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    name = code.name if code is not None else None
    kind = _BY_CODE.get(name, StoreInternalError) if name is not None else StoreInternalError
    return kind(f"{name}: {details}" if details else str(name or exc), name)

"""The daemon's errors, in one module. kvstore_server.rpc.status maps each one a call can
meet to its gRPC status code (nothing else catches them); main() turns the start-up ones
into a log line and exit status 1. Each leaves the store as it was, but where it says
otherwise.

    Exception
    ├── StoreError            the store's, raised to the servicer
    │   ├── InvalidChain      the put would link blocks into a cycle
    │   ├── InvalidCommit     a commit that does not match its reservation (its space is freed)
    │   ├── InvalidPart       a partial put or read that does not fit the block
    │   ├── CapacityError     the request cannot fit the byte budget (evictions made for it stay)
    │   ├── NotFoundError     the named block is not stored
    │   ├── LeaseNotFound     no reservation or pin with that id (expired, ended, another's)
    │   ├── WaitTimeout       DropSelect's wait ran out, or its caller went away
    │   ├── ShuttingDown      the store is closing: retry elsewhere or later
    │   ├── NoMemoryTier      the daemon runs without a memory tier
    │   ├── NoFleet           the daemon runs without a fleet tier
    │   └── FleetUnavailable  the fleet did not answer a call that needs it
    ├── InvalidRequest        a request failed validation at the gRPC edge
    ├── LocalReadsOff         LocalAccess on a daemon that does not offer local reads
    ├── EventsOutOfRange      Watch from (or fallen behind to) a sequence no longer held
    ├── ValueError
    │   └── MalformedPut      a Put chunk that does not fit the Put's header
    ├── OSError
    │   └── ListenError       start-up: the listen address cannot be bound
    └── RuntimeError
        └── DataDirInUse      start-up: another kvstore-server holds the data directory

A tier's own failures are StorageError, answered INTERNAL: defined in kvstore.blocks,
since the client's local reads raise it too, and below it tiers.base.StorageFullError
(out of room), tiers.arena.file.ArenaError and tiers.fleet.FleetObjectError. A part
that does not fit its block (parts.PartError) and a full parts buffer (parts.PartsFull)
stay inside the store, which raises InvalidPart and CapacityError for them.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of the errors the store raises to the servicer."""


class InvalidChain(StoreError):
    """The put would link blocks into a cycle (parents are what clients claim)."""


class CapacityError(StoreError):
    """The request cannot fit in the store's byte budget."""


class NotFoundError(StoreError):
    """The named block is not stored."""


class WaitTimeout(StoreError):
    """DropSelect's wait ran out before the whole prefix was stored."""


class ShuttingDown(StoreError):
    """The store is closing; the call should be retried elsewhere or later."""


class LeaseNotFound(StoreError):
    """No reservation or pin with that id (never made, expired, or already ended)."""


class InvalidCommit(StoreError):
    """A commit that does not match its reservation (checksum count)."""


class NoMemoryTier(StoreError):
    """The daemon runs without a memory tier."""


class NoFleet(StoreError):
    """The daemon runs without a fleet tier."""


class InvalidPart(StoreError):
    """A partial put or read that does not fit the block (the caller's error)."""


class FleetUnavailable(StoreError):
    """The fleet did not answer a call that needs it (not a lookup or a read: those miss)."""


class InvalidRequest(Exception):
    """A request failed validation; answered with INVALID_ARGUMENT."""


class LocalReadsOff(Exception):
    """LocalAccess on a daemon configured without local reads: FAILED_PRECONDITION."""


class EventsOutOfRange(Exception):
    """A watcher asked for (or fell behind to) a sequence the log no longer holds."""


class MalformedPut(ValueError):
    """A chunk that does not fit the Put's header (the servicer answers INVALID_ARGUMENT)."""


class ListenError(OSError):
    """The listen address cannot be bound; the message says why and names --listen."""


class DataDirInUse(RuntimeError):
    """Another kvstore-server holds this data directory."""

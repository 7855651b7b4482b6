"""The errors the store raises to the servicer (kvstore_server.rpc.status maps each to its
gRPC status code; nothing else catches them). Each leaves the store as it was, but where
it says otherwise.

    StoreError
    ├── InvalidChain       the put would link blocks into a cycle
    ├── InvalidCommit      a commit that does not match its reservation (its space is freed)
    ├── InvalidPart        a partial put or read that does not fit the block
    ├── CapacityError      the request cannot fit the byte budget (evictions made for it stay)
    ├── NotFoundError      the named block is not stored
    ├── LeaseNotFound      no reservation or pin with that id (expired, ended, another's)
    ├── WaitTimeout        DropSelect's wait ran out, or its caller went away
    ├── ShuttingDown       the store is closing: retry elsewhere or later
    ├── NoMemoryTier       the daemon runs without a memory tier
    ├── NoFleet            the daemon runs without a fleet tier
    └── FleetUnavailable   the fleet did not answer a call that needs it

A tier's own failures are tiers.base.StorageError (StorageFullError when out of room).
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

"""The storage interface: the `Tier` every tier implements, and the persistent `Backend`.

A tier stores whole blocks: one byte string per layer plus a small metadata record
(namespace, hash, parent, layer specs, per-layer checksums, creation time). It
knows nothing about prefixes, capacity or eviction policy: `kvstore_server.store.
Store` owns those. The chain of tiers (tiers.chain.TierChain) and the store call
tiers from gRPC worker threads, the write-behind threads and the I/O pools, never
from an event loop. Three kinds implement `Tier`: the memory tier (tiers.arena.
MemoryTier), the persistent tier (a `Backend`: tiers.lmdb, tiers.disk) and the fleet
(tiers.fleet.FleetTier).

`Tier`, in the order a block meets it:
    stored_prefix(keys)  how many leading keys the tier holds, without reading them; called
                      per lookup (the fleet's within its short deadline), side-effect free
    read(keys)        the read lease: a context manager yielding each block (None: missing
                      or unreadable) whose layer views stay valid inside it; per Get,
                      DropSelect, Describe, fleet copy and fetch
    write(puts, dels) delete `dels`, then store `puts`; durable against a process kill on
                      return (the fleet: once Redis answered); per admission, write-behind
                      batch, fleet copy. Raises StorageFullError when out of room
    delete(keys)      remove blocks the store dropped; unknown keys are ignored; never
                      called on the fleet for local removals (other hosts use it)
    close()           release files and connections; called exactly once, last

A `Backend` (the persistent tier) also:
    scan()            once at start: every stored block's metadata, to rebuild the index
    locate(keys)      context manager yielding a handle per block (its `.meta`; None where
                      missing) for read_into, valid inside the context (promotions)
    read_into(h, t)   read a located block's layers into `t` (a future; on the backend's
                      I/O threads where it has them); read_batches(batches): many blocks,
                      every batch planned before the first is issued, one task each
    release_memory()  drop what is held only as a cache (when idle; optional)
"""

from __future__ import annotations

import ctypes
import errno
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

# The block records are shared with the client (kvstore.blocks); re-exported here.
from kvstore.blocks import BlockKey, BlockMeta, LayerSpec, StorageError, StoredBlock, checksum

__all__ = [
    "NO_SPACE",
    "Backend",
    "BlockKey",
    "BlockMeta",
    "BlockWrite",
    "Pieces",
    "LayerSpec",
    "StorageError",
    "StorageFullError",
    "StoredBlock",
    "Tier",
    "checksum",
]

# What a filesystem says when it has no room (quota included).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageFullError(StorageError):
    """The backend has no room for a write even though the byte budget allows it."""


class Located(Protocol):
    """What `locate` yields per block: at least its record, and its layers' specs (which a
    promotion plans its reads from, before it needs the rest of the record)."""

    @property
    def meta(self) -> BlockMeta: ...

    @property
    def specs(self) -> tuple[LayerSpec, ...]: ...


@dataclass(frozen=True, slots=True)
class Pieces:
    """Where a block's layers lie in memory that stays mapped while they are used (the
    arena): one (address, length) row per layer, in layer order, as a numpy uint64 array
    of shape (layers, 2), the layout of a `struct iovec` array. A backend that moves
    bytes with preadv/pwritev takes it as it is: no Python object per layer."""

    iov: Any  # numpy.ndarray[(layers, 2), uint64]
    owner: object  # what keeps the memory mapped (the arena file)

    def views(self) -> list[memoryview]:
        """The same memory as one writable view per layer (for backends without iovec I/O)."""
        return [
            memoryview((ctypes.c_char * int(length)).from_address(int(address))).cast("B")
            for address, length in self.iov
        ]


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """A block to store: its metadata and one buffer per layer (same order), or `pieces`
    where the layers lie in mapped memory (then `layers` may be empty: `buffers()`);
    `joined`, when the writer has it, is the same bytes back to back (spares a join)."""

    meta: BlockMeta
    layers: Sequence[memoryview | bytes]
    joined: memoryview | bytes | None = None
    pieces: Pieces | None = None

    def buffers(self) -> Sequence[memoryview | bytes]:
        if self.layers or self.pieces is None:
            return self.layers
        return self.pieces.views()


class Tier(Protocol):
    """One tier of the chain (see the module docstring for when each method is called).
    Thread-safe: called from many threads at once."""

    name: str

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` the tier holds, without reading their data."""
        ...

    def read(self, keys: Sequence[BlockKey]) -> AbstractContextManager[list[StoredBlock | None]]:
        """The read lease: blocks in `keys` order, None for a missing or unreadable one;
        their views are valid until the context exits."""
        ...

    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then store `puts`. Raises StorageFullError when out of room,
        StorageError when the tier fails."""
        ...

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove blocks; unknown keys are ignored."""
        ...

    def close(self) -> None:
        """Release the tier; called exactly once, after the last other call."""
        ...


class Backend(ABC):
    """The persistent tier: a `Tier` that rebuilds the store's index at start (scan) and
    reads straight into the memory tier (locate, read_into, read_batches). Thread-safe."""

    name: str

    @abstractmethod
    def scan(self) -> Iterator[BlockMeta]:
        """Yield every stored block's metadata. Called once, at start."""

    @abstractmethod
    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then store `puts`. Raises StorageFullError when out of room."""

    def room_returning(self) -> bool:
        """Whether room freed here waits for reads that may still see it (and comes back
        when they end): a write refused for room now may fit soon. This default: never."""
        return False

    @abstractmethod
    def read(self, keys: Sequence[BlockKey]) -> AbstractContextManager[list[StoredBlock | None]]:
        """Blocks in `keys` order, None for a missing or unreadable one."""

    @abstractmethod
    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` are stored, without reading their data."""

    @contextmanager
    def locate(self, keys: Sequence[BlockKey]) -> Iterator[Sequence[Located | None]]:
        """Handles for read_into. This default reads the blocks (read) and keeps them open."""
        with self.read(keys) as blocks:
            yield blocks

    def read_into(
        self, handle: Located, target: Pieces | list[memoryview], layers: range | None = None
    ) -> Future[None]:
        """Fill `target` (one buffer per layer, in order) with a located block's bytes: of
        `layers` only when given (then `target` holds buffers for those layers alone).
        This default copies on the calling thread from what `locate` read."""
        done: Future[None] = Future()
        try:
            views = target.views() if isinstance(target, Pieces) else target
            stored = handle.layers  # type: ignore[attr-defined]
            if layers is not None:
                stored = stored[layers.start : layers.stop]
            if len(stored) != len(views):
                raise ValueError(f"{len(views)} buffers for {len(stored)} layers")
            for view, data in zip(views, stored, strict=True):
                view[:] = data
        except Exception as exc:  # the caller gets it from the future, as from an I/O thread
            done.set_exception(exc)
        else:
            done.set_result(None)
        return done

    def read_batches(
        self,
        batches: Sequence[Sequence[tuple[Located, Pieces | list[memoryview]]]],
        layers: range | None = None,
    ) -> list[Future[None]]:
        """read_into for batches of blocks, a future per batch: every batch is planned before
        the first is issued (planning on the caller's thread then never competes with the
        reads already running), each batch one unit of work (one I/O task where the
        backend has a pool: a per-block task costs more than its read when reads are
        small). This default reads each batch on the calling thread."""
        futures: list[Future[None]] = []
        for reads in batches:
            done: Future[None] = Future()
            for handle, target in reads:
                failure = self.read_into(handle, target, layers).exception()
                if failure is not None:
                    done.set_exception(failure)
                    break
            else:
                done.set_result(None)
            futures.append(done)
        return futures

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self.write((), keys)

    def release_memory(self) -> None:  # noqa: B027 - optional: most backends hold no cache
        """Give back memory held only as a cache (called when the daemon is idle)."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend; called exactly once, after the last other call."""

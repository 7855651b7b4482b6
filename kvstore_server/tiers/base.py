"""The storage interface: what a backend stores and the five things it does.

A backend persists whole blocks: one byte string per layer plus a small
metadata record (namespace, hash, parent, layer specs, per-layer checksums,
creation time). It knows nothing about prefixes, capacity or eviction policy;
`kvstore_server.store.Store` owns those; it and the chain of tiers
(tiers.chain.TierChain) call the backend from gRPC worker threads and the
write-behind thread, never from an event loop.

    scan()            once at start: every stored block's metadata, to rebuild the index
    write(puts, dels) atomically (per backend's promise) delete `dels` and store `puts`;
                      durable against a process kill on return
    read(keys)        context manager yielding the blocks' metadata and layer views
    locate(keys)      context manager yielding a handle per block (its `.meta`; None where
                      missing) for read_into, valid inside the context
    read_into(h, views)  read a located block's layers into `views` (a future; on the
                      backend's I/O threads where it has them)
    stored_prefix(keys)  how many leading keys are stored (same-host lookups)
    delete(keys)      remove blocks; unknown keys are ignored
    release_memory()  drop what is held only as a cache (when idle; optional)
    close()           release files; called exactly once
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
    "checksum",
]

# What a filesystem says when it has no room (quota included).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageFullError(StorageError):
    """The backend has no room for a write even though the byte budget allows it."""


class Located(Protocol):
    """What `locate` yields per block: at least its record."""

    @property
    def meta(self) -> BlockMeta: ...


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


class Backend(ABC):
    """One storage engine. Thread-safe: the store calls it from many threads."""

    name: str

    @abstractmethod
    def scan(self) -> Iterator[BlockMeta]:
        """Yield every stored block's metadata. Called once, at start."""

    @abstractmethod
    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then store `puts`. Raises StorageFullError when out of room."""

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

    def read_batch(
        self, reads: Sequence[tuple[Located, Pieces | list[memoryview]]], layers: range | None = None
    ) -> Future[None]:
        """read_into for several blocks, as one unit of work (one I/O task where the backend
        has a pool: a per-block task costs more than its read when the reads are small)."""
        done: Future[None] = Future()
        for handle, target in reads:
            failure = self.read_into(handle, target, layers).exception()
            if failure is not None:
                done.set_exception(failure)
                return done
        done.set_result(None)
        return done

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self.write((), keys)

    def release_memory(self) -> None:  # noqa: B027 - optional: most backends hold no cache
        """Give back memory held only as a cache (called when the daemon is idle)."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend; called exactly once, after the last other call."""

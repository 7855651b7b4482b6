"""The storage interface: what a backend stores and the five things it does.

A backend persists whole blocks: one byte string per layer plus a small
metadata record (namespace, hash, parent, layer specs, per-layer checksums,
creation time). It knows nothing about prefixes, capacity or eviction policy;
`kvstore_server.store.Store` owns those and calls the backend from gRPC worker
threads, never from an event loop.

    scan()            once at start: every stored block's metadata, to rebuild the index
    write(puts, dels) atomically (per backend's promise) delete `dels` and store `puts`;
                      durable against a process kill on return
    read(keys)        context manager yielding the blocks' metadata and layer views
    stored_prefix(keys)  how many leading keys are stored (same-host lookups)
    delete(keys)      remove blocks; unknown keys are ignored
    release_memory()  drop what is held only as a cache (when idle; optional)
    close()           release files; called exactly once
"""

from __future__ import annotations

import errno
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import orjson
import xxhash

BlockKey = tuple[bytes, bytes]
"""(namespace, 32-byte block hash)."""


# What a filesystem says when it has no room (quota included).
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageError(Exception):
    """A backend failed in a way the caller cannot fix by retrying the same call."""


class StorageFullError(StorageError):
    """The backend has no room for a write even though the byte budget allows it."""


# A layer's checksum: xxh3-64 of its bytes (~13-20 GB/s, so verifying every read is
# cheap). Bound directly, no wrapper: reads call it once per block and layer.
checksum: Callable[[memoryview | bytes], int] = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class LayerSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


# Blocks of one model share their layer layout: parse it once (every read parses metadata).
_LAYOUTS: dict[tuple[tuple[str, str, tuple[int, ...], int], ...], tuple[LayerSpec, ...]] = {}
_MAX_LAYOUTS = 256


@dataclass(frozen=True, slots=True)
class BlockMeta:
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    layers: tuple[LayerSpec, ...]
    checksums: tuple[int, ...]
    created_at: float = field(default_factory=time.time)

    @property
    def key(self) -> BlockKey:
        return (self.namespace, self.block_hash)

    @property
    def size(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def to_json(self) -> bytes:
        """Canonical metadata record (JSON; no pickle on disk)."""
        return json.dumps(
            {
                "v": 1,
                "ns": self.namespace.hex(),
                "hash": self.block_hash.hex(),
                "parent": self.parent_hash.hex(),
                "created": self.created_at,
                "layers": [
                    [layer.name, layer.dtype, list(layer.shape), layer.nbytes, f"{crc:016x}"]
                    for layer, crc in zip(self.layers, self.checksums, strict=True)
                ],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str) -> BlockMeta:
        # orjson: every read parses a block's record (2 us instead of 6 with json);
        # bad JSON raises orjson.JSONDecodeError, a ValueError
        doc = orjson.loads(raw)
        version = doc.get("v") if isinstance(doc, dict) else None
        if version != 1:
            raise StorageError(f"unknown block metadata version {version!r}")
        entries = doc["layers"]
        key = tuple([(n, d, tuple(s), b) for n, d, s, b, _ in entries])
        layers = _LAYOUTS.get(key)
        if layers is None:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.clear()
            layers = _LAYOUTS[key] = tuple(LayerSpec(*spec) for spec in key)
        return cls(
            bytes.fromhex(doc["ns"]),
            bytes.fromhex(doc["hash"]),
            bytes.fromhex(doc["parent"]),
            layers,
            tuple([int(entry[4], 16) for entry in entries]),
            float(doc["created"]),
        )


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """A block to store: its metadata and one buffer per layer (same order); `joined`,
    when the writer has it, is the same bytes back to back (spares the backend a join)."""

    meta: BlockMeta
    layers: Sequence[memoryview | bytes]
    joined: memoryview | bytes | None = None


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read back; `layers` views are valid only inside `Backend.read`'s block."""

    meta: BlockMeta
    layers: list[memoryview]

    def corrupt_layer(self) -> int | None:
        """Index of the first layer whose bytes fail the checksum, or None."""
        for i, (view, want) in enumerate(zip(self.layers, self.meta.checksums, strict=True)):
            if len(view) != self.meta.layers[i].nbytes or checksum(view) != want:
                return i
        return None


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

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self.write((), keys)

    def release_memory(self) -> None:  # noqa: B027 - optional: most backends hold no cache
        """Give back memory held only as a cache (called when the daemon is idle)."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend; called exactly once, after the last other call."""

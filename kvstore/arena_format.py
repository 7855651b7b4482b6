"""The memory arena's file format, shared by the daemon (which owns the file) and
the clients that map it.

The arena is one file in a shared-memory filesystem (/dev/shm by default):

    [0, HEADER_BYTES)         the header below
    [DATA_OFFSET, size)       extents: every reservation (a save) and every
                              promotion (a load of blocks the persistent tier
                              held) gets one, aligned to ALIGN bytes

An extent holds `n` blocks of one layer layout, **layer-major**: layer l's n
blocks lie back to back, so a save or load moves one contiguous run per layer
(copies of 64 KiB and more; small DMA pieces are slow). Block i of layer l is at

    extent + n * (bytes of layers 0..l-1 of one block) + i * (bytes of layer l)

The daemon keeps which extent holds which committed block in its own index
(not in this file); clients learn extents from the Reserve and Pin answers.
The header's `store_id` is the daemon run's id (LocalAccess/ArenaAccess report
the same): a client maps the file only when the two agree, which proves it sees
the daemon's file, not another one at the same path. Its `owner` is the data
directory the arena belongs to (the other half of that record is the data
directory's ARENA file; kvstore.arenas tells live, recoverable and orphaned
arenas apart with both). The owner lies after the fixed fields, flagged, so
readers of arenas written before it was recorded see an empty owner.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"KVSARENA"
VERSION = 1
HEADER_BYTES = 4096
DATA_OFFSET = HEADER_BYTES
ALIGN = 4096
# magic, version, flags, file size, data offset, arena id (random per file), store id (per run)
_HEADER = struct.Struct("<8sIIQQ32s64s")
# flags: the header records its owner (the data directory's path, UTF-8) at _OWNER_AT
FLAG_OWNER = 1
_OWNER_AT = 256
_OWNER_LEN = struct.Struct("<H")
MAX_OWNER_BYTES = HEADER_BYTES - _OWNER_AT - _OWNER_LEN.size


class ArenaFormatError(ValueError):
    """The file is not an arena of this version, or not the one expected."""


@dataclass(frozen=True, slots=True)
class Header:
    size: int
    arena_id: str
    store_id: str
    data_offset: int = DATA_OFFSET
    owner: str = ""  # the owning data directory's absolute path; "" when not recorded

    def pack(self) -> bytes:
        owner = self.owner.encode()
        if len(owner) > MAX_OWNER_BYTES:
            raise ArenaFormatError(f"an arena's owner path is at most {MAX_OWNER_BYTES} bytes")
        raw = _HEADER.pack(
            MAGIC,
            VERSION,
            FLAG_OWNER if owner else 0,
            self.size,
            self.data_offset,
            self.arena_id.encode().ljust(32, b"\0"),
            self.store_id.encode().ljust(64, b"\0"),
        )
        raw = raw.ljust(_OWNER_AT, b"\0") + _OWNER_LEN.pack(len(owner)) + owner
        return raw.ljust(HEADER_BYTES, b"\0")

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Header:
        if len(raw) < _HEADER.size:
            raise ArenaFormatError("arena header is truncated")
        magic, version, flags, size, data_offset, arena_id, store_id = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ArenaFormatError("not a kvstore arena file (bad magic)")
        if version != VERSION:
            raise ArenaFormatError(f"arena format version {version}, expected {VERSION}")
        if data_offset != DATA_OFFSET or size < data_offset:
            raise ArenaFormatError(f"arena header has a bad layout (size {size}, data at {data_offset})")
        owner = ""
        if flags & FLAG_OWNER:
            if len(raw) < _OWNER_AT + _OWNER_LEN.size:
                raise ArenaFormatError("arena header is truncated")
            (length,) = _OWNER_LEN.unpack_from(raw, _OWNER_AT)
            start = _OWNER_AT + _OWNER_LEN.size
            if length > MAX_OWNER_BYTES or len(raw) < start + length:
                raise ArenaFormatError(f"arena header has a bad owner length {length}")
            try:
                owner = bytes(raw[start : start + length]).decode()
            except UnicodeDecodeError as exc:
                raise ArenaFormatError("arena header's owner is not UTF-8") from exc
        return cls(size, arena_id.rstrip(b"\0").decode(), store_id.rstrip(b"\0").decode(), data_offset, owner)


def extent_bytes(block_bytes: int, num_blocks: int) -> int:
    """Bytes an extent of `num_blocks` blocks of `block_bytes` takes, aligned."""
    raw = block_bytes * num_blocks
    return max(ALIGN, -(-raw // ALIGN) * ALIGN)


def layer_offsets(layer_bytes: Sequence[int], num_blocks: int) -> list[int]:
    """Where each layer's run of `num_blocks` blocks starts, relative to its extent."""
    offsets, at = [], 0
    for nbytes in layer_bytes:
        offsets.append(at)
        at += nbytes * num_blocks
    return offsets


def block_layer_offset(layer_bytes: Sequence[int], num_blocks: int, layer: int, position: int) -> int:
    """Offset of block `position`'s slice of `layer` in an extent of `num_blocks` blocks.
    O(layer): for every layer of a block, block_offsets; for many, layer_starts once."""
    return num_blocks * sum(layer_bytes[:layer]) + position * layer_bytes[layer]


def layer_starts(layer_bytes: Sequence[int]) -> list[int]:
    """One block's bytes of the layers before each layer (prefix sums): block `position`'s
    slice of layer l lies at `num_blocks * starts[l] + position * layer_bytes[l]`."""
    starts, before = [], 0
    for nbytes in layer_bytes:
        starts.append(before)
        before += nbytes
    return starts


def block_offsets(layer_bytes: Sequence[int], num_blocks: int, position: int) -> list[int]:
    """Offsets of block `position`'s slice of every layer, relative to its extent (one pass:
    with a store layer per KV head a block has 256 layers, and a sum per layer was
    quadratic)."""
    offsets, before = [], 0
    for nbytes in layer_bytes:
        offsets.append(num_blocks * before + position * nbytes)
        before += nbytes
    return offsets


def arena_file(memory_dir: Path, data_dir: Path) -> Path:
    """The arena file of the daemon on `data_dir`: one per data directory, stable across
    restarts (so a restarted daemon finds the file that outlived its predecessor)."""
    tag = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return memory_dir / f"{ARENA_PREFIX}{tag}{ARENA_SUFFIX}"


ARENA_PREFIX = "kvstore-"
ARENA_SUFFIX = ".arena"
INDEX_SUFFIX = ".index"
"""The arena's index (an LMDB directory) is the arena file's path + INDEX_SUFFIX."""


def index_path(arena: Path) -> Path:
    return arena.with_name(arena.name + INDEX_SUFFIX)


SOCKET_SUFFIX = ".sock"
"""The daemon's control socket (kvstore.control) is the arena file's path with this suffix."""


def socket_path(arena: Path) -> Path:
    return arena.with_suffix(SOCKET_SUFFIX)

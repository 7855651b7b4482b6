"""Block records shared by the daemon, the client and the connector, defined once.

    BlockKey        (namespace, 32-byte hash)
    checksum        a layer's xxh3-64, verified before its bytes are used (CHECKSUMS: by kind)
    LayerSpec       one layer's per-block slice: name, dtype, shape (nbytes derived)
    BlockMeta       a stored block's metadata record (JSON, never pickle)
    StoredBlock     a block read back: its record and one view per layer
    leading_blocks  the usable prefix of a read (present, one layout, verified)
    STOP_*          why a read returned fewer blocks than it was asked for
    subset_indices  the layer indices a layer subset means (a tensor-parallel rank's KV heads)
    PutResult       what a committed put did
    StorageError    stored files that cannot be opened or read

No torch, no grpc; the on-disk layouts of the backends are in kvstore.layouts.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec
import orjson
import xxhash

from kvstore.wire import DTYPES, layer_block_bytes

BlockKey = tuple[bytes, bytes]
"""(namespace, 32-byte block hash)."""


class StorageError(Exception):
    """Stored blocks cannot be read or written in a way that retrying the same call fixes."""


# A layer's checksum: xxh3-64 of its bytes (~13-20 GB/s, so verifying every read is
# cheap). Bound directly, no wrapper: reads call it once per block and layer.
checksum: Callable[[memoryview | bytes], int] = xxhash.xxh3_64_intdigest

XXH3 = "xxh3"
WSUM32 = "wsum32"
_WEIGHTS: dict[int, Any] = {}


def wsum32(data: memoryview | bytes) -> int:
    """The GPU's checksum: sum((i + 1) * w_i) mod 2**64 over the bytes as little-endian
    uint32 words w_0.. (a tail of 1-3 bytes is zero-padded to a word). A GPU computes it
    for a whole layer's blocks in one kernel (kvstore_connector.transfer.wsum32_blocks),
    where xxh3 on the host is the bottleneck of a load; the host computes it here, with
    numpy, about 1 GB/s. Any single changed word changes it (the weights are odd or even
    but never 0 mod 2**64 for a block's word count)."""
    import numpy as np

    tail = len(data) % 4
    words = np.frombuffer(bytes(data) + b"\0" * (4 - tail) if tail else data, dtype="<u4")
    weights = _WEIGHTS.get(len(words))
    if weights is None:
        if len(_WEIGHTS) > 64:
            _WEIGHTS.clear()
        weights = _WEIGHTS[len(words)] = np.arange(1, len(words) + 1, dtype=np.uint64)
    return int((words.astype(np.uint64) * weights).sum(dtype=np.uint64))


CHECKSUMS: dict[str, Callable[[memoryview | bytes], int]] = {XXH3: checksum, WSUM32: wsum32}
"""A block record's checksum kind -> how to compute it. The persistent tier holds xxh3
only; wsum32 records live in the memory tier (saves from GPUs) and are rewritten to
xxh3 when they are written behind."""


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's per-block slice: a layer tensor of N blocks is [N, *shape].

    `nbytes` (also `block_bytes`) is one block's bytes of this layer; left out, it is
    derived from dtype and shape, given, it must agree (ValueError otherwise, as for an
    unknown dtype). Frozen and hashable: specs are compared with == to match layouts.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int = -1

    def __post_init__(self) -> None:
        if type(self.shape) is not tuple:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPES:
            raise ValueError(
                f"layer {self.name!r}: dtype {self.dtype!r} is not supported; supported: {', '.join(DTYPES)}"
            )
        size = layer_block_bytes(self.dtype, self.shape)
        if self.nbytes == -1:
            object.__setattr__(self, "nbytes", size)
        elif self.nbytes != size:
            raise ValueError(
                f"layer {self.name!r}: {self.nbytes} bytes per block, but its dtype and shape make {size}"
            )

    @property
    def block_bytes(self) -> int:
        """The same as nbytes (the client's name for it)."""
        return self.nbytes

    @classmethod
    def of(cls, name: str, tensor: Any) -> LayerSpec:
        """The spec of a [num_blocks, *shape] tensor (torch or anything with dtype and shape)."""
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape[1:]))


# Blocks of one model share their layer layout: parse it once (every read parses metadata).
_LAYOUTS: dict[tuple[tuple[str, str, tuple[int, ...], int], ...], tuple[LayerSpec, ...]] = {}
_MAX_LAYOUTS = 256
_INTERNED: dict[tuple[LayerSpec, ...], tuple[LayerSpec, ...]] = {}


def intern_layout(layers: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """The one tuple of this layout: blocks of a model then share it, so comparing two
    blocks' layouts and the per-layout facts below (`layout_of`) cost one identity test,
    not a walk over every layer (a commit of 512 blocks of 32 layers did that 16k times)."""
    found = _INTERNED.get(layers)
    if found is None:
        if len(_INTERNED) >= _MAX_LAYOUTS:
            _INTERNED.clear()
        found = _INTERNED[layers] = layers
    return found


@dataclass(frozen=True, slots=True)
class Layout:
    """Facts about one layer layout, computed once (see layout_of)."""

    layers: tuple[LayerSpec, ...]
    block_bytes: int  # one block, all layers
    entries: list[tuple[str, str, list[int], int]]  # the JSON record's layer entries
    record: bytes  # the entries as JSON: a layout stored once for many blocks
    digest: bytes  # 8 bytes naming `record` (xxh3-64)

    @classmethod
    def of(cls, layers: tuple[LayerSpec, ...]) -> Layout:
        entries = [(layer.name, layer.dtype, list(layer.shape), layer.nbytes) for layer in layers]
        record = orjson.dumps(entries)
        size = sum(layer.nbytes for layer in layers)
        return cls(layers, size, entries, record, xxhash.xxh3_64_digest(record))

    @staticmethod
    def parse(record: bytes | memoryview) -> tuple[LayerSpec, ...]:
        """The layers of a `record` (interned). Raises ValueError, TypeError."""
        entries = orjson.loads(record)
        return intern_layout(tuple(LayerSpec(str(n), str(d), tuple(s), int(b)) for n, d, s, b in entries))


T = TypeVar("T")


Layers = tuple[LayerSpec, ...]


def per_layout(cache: dict[int, tuple[Layers, T]], layers: Layers, make: Callable[[Layers], T]) -> T:
    """`make(layers)`, once per layers tuple, found in `cache` by the tuple's identity
    (interned layouts hit every time; the cache holds the tuple, so its id is not reused
    while cached): cheaper than hashing a tuple of specs on every block."""
    hit = cache.get(id(layers))
    if hit is not None and hit[0] is layers:
        return hit[1]
    if len(cache) >= _MAX_LAYOUTS:
        cache.clear()
    made = make(layers)
    cache[id(layers)] = (layers, made)
    return made


_BY_ID: dict[int, tuple[tuple[LayerSpec, ...], Layout]] = {}


def layout_of(layers: tuple[LayerSpec, ...]) -> Layout:
    """The Layout of a layers tuple (see per_layout)."""
    return per_layout(_BY_ID, layers, Layout.of)


class PackedSums(Sequence[int]):
    """A block's per-layer checksums as a record stores them (little-endian uint64s), read
    one at a time when asked: finding 512 blocks of 256 store layers in an index made
    131,072 Python ints that a promotion never looks at (it passes the packed bytes on)."""

    __slots__ = ("packed", "_view")

    def __init__(self, packed: bytes) -> None:
        if len(packed) % 8:
            raise ValueError(f"{len(packed)} bytes of checksums: not a whole number of uint64s")
        self.packed = packed
        # made when a checksum is first read: a commit cuts one of these per block and
        # passes the packed bytes on (the view cost a 512-block commit 0.3 ms)
        self._view: Sequence[int] | None = None

    def _values(self) -> Sequence[int]:
        if self._view is None:
            # a big-endian host (none that runs this yet) unpacks them at once
            self._view = memoryview(self.packed).cast("Q") if _LITTLE_ENDIAN else _unpacked(self.packed)
        return self._view

    def __len__(self) -> int:
        return len(self.packed) // 8

    def __getitem__(self, index: Any) -> Any:
        found = self._values()[index]
        return tuple(found) if isinstance(found, memoryview | tuple) else found

    def __iter__(self) -> Iterator[int]:
        return iter(self._values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedSums):
            return self.packed == other.packed
        if isinstance(other, tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PackedSums({tuple(self)!r})"


_LITTLE_ENDIAN = sys.byteorder == "little"


def _unpacked(packed: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(packed) // 8}Q", packed)


class BlockMeta(msgspec.Struct, frozen=True, gc=False):  # type: ignore[call-arg]
    """A stored block's metadata. A msgspec Struct, not a frozen dataclass: a commit or a
    promotion makes one per block, and a frozen dataclass took 1.3 us to make against 0.12
    (a commit of 128 blocks spent 0.17 ms in them). Immutable, compared and hashed by its
    fields like one; outside the cyclic collector's reach (it refers to no container that
    could refer back)."""

    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    layers: tuple[LayerSpec, ...]
    checksums: tuple[int, ...] | PackedSums
    created_at: float = msgspec.field(default_factory=time.time)
    checksum_kind: str = XXH3

    @property
    def key(self) -> BlockKey:
        return (self.namespace, self.block_hash)

    @property
    def size(self) -> int:
        return layout_of(self.layers).block_bytes

    def to_json(self) -> bytes:
        """Canonical metadata record (JSON; no pickle on disk). orjson, and each layout's
        layer entries built once: a commit of 512 blocks of 32 layers wrote its records in
        170 ms with json.dumps."""
        entries = layout_of(self.layers).entries
        if len(entries) != len(self.checksums):
            raise ValueError(f"{len(self.checksums)} checksums for {len(entries)} layers")
        doc: dict[str, Any] = {
            "v": 1,
            "ns": self.namespace.hex(),
            "hash": self.block_hash.hex(),
            "parent": self.parent_hash.hex(),
            "created": self.created_at,
            "layers": [[*entry, f"{crc:016x}"] for entry, crc in zip(entries, self.checksums, strict=True)],
        }
        if self.checksum_kind != XXH3:  # records of xxh3 (all persistent ones) stay as they were
            doc["ck"] = self.checksum_kind
        return orjson.dumps(doc)

    @classmethod
    def from_json(cls, raw: bytes | memoryview | str) -> BlockMeta:
        """Parse a record. Raises StorageError (unknown version), ValueError, KeyError, TypeError."""
        # orjson: every read parses a block's record (2 us instead of 6 with json);
        # bad JSON raises orjson.JSONDecodeError, a ValueError
        doc = orjson.loads(raw)
        version = doc.get("v") if isinstance(doc, dict) else None
        if version != 1:
            raise StorageError(f"unknown block metadata version {version!r}")
        kind = doc.get("ck", XXH3)
        if kind not in CHECKSUMS:
            raise StorageError(f"unknown checksum kind {kind!r}")
        entries = doc["layers"]
        key = tuple([(n, d, tuple(s), b) for n, d, s, b, _ in entries])
        layers = _LAYOUTS.get(key)
        if layers is None:
            if len(_LAYOUTS) >= _MAX_LAYOUTS:
                _LAYOUTS.clear()
            layers = _LAYOUTS[key] = intern_layout(tuple(LayerSpec(*spec) for spec in key))
        return cls(
            bytes.fromhex(doc["ns"]),
            bytes.fromhex(doc["hash"]),
            bytes.fromhex(doc["parent"]),
            layers,
            tuple([int(entry[4], 16) for entry in entries]),
            float(doc["created"]),
            kind,
        )


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block read back; `layers` views are valid only while its read lasts."""

    meta: BlockMeta
    layers: list[memoryview]

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        return self.meta.layers

    def corrupt_layer(self, subset: Sequence[int] | None = None) -> int | None:
        """Index of the first layer (of layer subset `subset`, default all) whose bytes fail
        the checksum, or None."""
        digest = CHECKSUMS[self.meta.checksum_kind]
        if len(self.layers) != len(self.meta.checksums):
            return 0
        for i in range(len(self.layers)) if subset is None else subset:
            view = self.layers[i]
            if len(view) != self.meta.layers[i].nbytes or digest(view) != self.meta.checksums[i]:
                return i
        return None


# Why a read (Get, DropSelect, Pin; KVStoreClient.select) returned fewer blocks than it
# was asked for: what stopped it at the first block it did not return. The wire carries
# them as kvstore.v1.StopReason (kvstore.wire.STOP_REASONS).
STOP_NONE = "none"
"""Nothing stopped it: every block asked for came."""
STOP_NOT_STORED = "not_stored"
"""The block is not stored (a lookup stops there too)."""
STOP_LAYER_SET_DIFFERS = "layer_set_differs"
"""Stored with other layers (names, dtypes, shapes) than the blocks before it: a read never
mixes layer sets, but a lookup counts the block."""
STOP_CHECKSUM_FAILED = "checksum_failed"
"""Its bytes failed their checksum (the daemon removed it)."""
STOP_EVICTED = "evicted"
"""Removed between finding the prefix and reading it (evicted, taken, or unreadable)."""
STOP_NO_ROOM = "no_room"
"""A load through the memory tier: no room there to bring the block in from the
persistent tier (a Get would read it)."""
STOP_NOT_IN_MEMORY = "not_in_memory"
"""A lease taken at lookup (LookupRequest.lease): the block is stored below the memory
tier, and a lookup never waits for a promotion (the load's own Pin brings it in)."""
STOP_UNKNOWN = "unknown"
"""The daemon (or the source of the read) did not say."""


@dataclass(frozen=True, slots=True)
class BlockPrefix:
    """The leading usable blocks of a read, and why the block after them is not usable."""

    blocks: list[StoredBlock]
    stop: Literal["missing", "corrupt", "layout"] | None = None
    """None: every block was used; "missing": absent or unreadable; "corrupt": fails its
    checksum (at `bad_layer`); "layout": another layer layout than the first block's."""
    bad_layer: int | None = None

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        return self.blocks[0].meta.layers if self.blocks else ()

    def stop_reason(self, missing: str = STOP_NOT_STORED) -> str:
        """`stop` as a STOP_* reason; `missing`: what an absent block means to the reader
        (not stored, for a reader of the files; evicted, for the daemon, whose index had it)."""
        if self.stop is None:
            return STOP_NONE
        return {"missing": missing, "corrupt": STOP_CHECKSUM_FAILED, "layout": STOP_LAYER_SET_DIFFERS}[
            self.stop
        ]


def leading_blocks(
    blocks: Iterable[StoredBlock | None], *, verify: bool = True, subset: Sequence[int] | None = None
) -> BlockPrefix:
    """The leading present blocks of `blocks` (a read, in key order) that share the first
    one's layer layout, each verified against its checksums (of layer subset `subset` only,
    when the read carries only those).

    verify=False leaves the checksums to the caller, which must check every layer just
    before it uses the bytes (the same-host reader does, so the copy finds them in cache).
    """
    good: list[StoredBlock] = []
    for block in blocks:
        if block is None:
            return BlockPrefix(good, "missing")
        if subset is not None and subset and subset[-1] >= len(block.meta.layers):
            return BlockPrefix(good, "layout")
        if verify:
            bad = block.corrupt_layer(subset)
            if bad is not None:
                return BlockPrefix(good, "corrupt", bad)
        if good and block.meta.layers != good[0].meta.layers:
            return BlockPrefix(good, "layout")
        good.append(block)
    return BlockPrefix(good)


def subset_indices(subset: Sequence[int], width: int) -> list[int]:
    """The indices of a layer subset of `width` stored layers (empty: all of them). Raises
    ValueError for indices out of range or not strictly increasing."""
    if not subset:
        return list(range(width))
    if any(b <= a for a, b in zip(subset, subset[1:], strict=False)) or subset[0] < 0 or subset[-1] >= width:
        raise ValueError(f"layers must be strictly increasing indices below {width}, not {list(subset)[:8]}")
    return list(subset)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a committed put did: blocks stored, blocks already stored, bytes stored, and
    blocks evicted to make room."""

    blocks_written: int
    blocks_skipped: int
    bytes_written: int
    blocks_evicted: int

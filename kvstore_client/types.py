"""The client's result types: what KVStoreClient's calls return.

LayerSpec     one layer's per-block slice (kvstore.blocks, shared with the daemon)
PutResult     what a committed put did (kvstore.blocks)
Selection     what a select returned: {layer: tensor}, and why it stopped short
Chain         one save's blocks in a reserve_many: hashes, parent, token ids
EvictResult   what an evict removed
Event         one change reported by Watch; kind EVENT_STORED or EVENT_REMOVED
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore.blocks import LayerSpec, PutResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "EVENT_REMOVED",
    "EVENT_STORED",
    "Chain",
    "Event",
    "EvictResult",
    "LayerSpec",
    "Lease",
    "PutResult",
    "Selection",
]

EVENT_STORED = "stored"
EVENT_REMOVED = "removed"


class Chain(NamedTuple):
    """One save's blocks for KVStoreClient.reserve_many: their chained hashes, the hash
    before the first (b"" at the root), and their token ids (for the store's KV events;
    block_size per block, or none)."""

    hashes: Sequence[bytes]
    parent_hash: bytes = b""
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class EvictResult:
    blocks_evicted: int
    bytes_freed: int
    fleet_objects_removed: int = 0


@dataclass(frozen=True, slots=True)
class Where:
    """Where a stored prefix lives (KVStoreClient.where): a tier per block, the
    kvstore.wire.TIER_* codes (0 memory, 1 persistent, 2 fleet), and the daemon's
    measured read rates of the tiers below memory, in bytes/s (0: not measured yet)."""

    num_blocks: int
    tiers: bytes
    persistent_read_rate: float
    fleet_read_rate: float
    lease: Lease | None = None
    """Asked with lease_from: the blocks it pinned for the load that follows (None: none)."""
    prefetching: int = 0
    """Asked with prefetch: the blocks whose reads into the memory tier the lookup started."""


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks a lookup pinned in the memory tier for the load after it (KVStoreClient.where
    with `lease_from`): a Pin answer per namespace, in the lookup's order, each covering
    the leading blocks from lease_from that were in memory (`num_blocks` of them in every
    namespace). Whoever loads uses it in place of a Pin (the arena client's `leased`) and
    releases its share; whoever does not hand it on gives it back (release_lease).

    A lease holds from `taken` (time.monotonic() when the lookup was sent: one clock for
    every process of the host) for the daemon's lease_seconds, and only in the daemon run
    `store_id`."""

    namespaces: tuple[bytes, ...]  # the lookup's
    pins: tuple[Any, ...]  # kvstore.v1.PinResponse, one per namespace
    store_id: str
    taken: float

    def pin(self, namespace: bytes) -> Any | None:
        """The pin of `namespace` (None: not one of the lookup's)."""
        for name, pin in zip(self.namespaces, self.pins, strict=True):
            if name == namespace:
                return pin
        return None

    @property
    def num_blocks(self) -> int:
        return min((pin.num_blocks for pin in self.pins), default=0)


@dataclass(frozen=True, slots=True)
class Event:
    """One change of the store as Watch reports it: blocks of one namespace stored or removed."""

    sequence: int
    """1, 2, 3, ... in commit order; restarts with every daemon start (see store_id)."""
    kind: str
    """EVENT_STORED ("stored") or EVENT_REMOVED ("removed")."""
    namespace: bytes
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes, ...]
    """Stored: each block's parent (b"" where a chain starts). Removed: ()."""
    timestamp: float
    """Unix seconds of the commit."""
    store_id: str
    """Random per daemon start: a new value means the store's picture must be rebuilt."""


class Selection(dict[str, "torch.Tensor"]):
    """What KVStoreClient.select returns: a dict {layer name: [num_blocks, *shape] tensor},
    empty on a miss, with two attributes more.

    `num_blocks`: the blocks it holds, the leading ones of those asked for.
    `stop_reason`: why it holds no more, one of kvstore.blocks' STOP_* reasons:
        "none"               every block asked for is here
        "not_stored"         the next block is not stored (lookup stops there too)
        "layer_set_differs"  the next block is stored with other layers (names, dtypes,
                             shapes): a select never mixes layer sets, a lookup counts it
        "checksum_failed"    the next block failed its checksum (the daemon removed it)
        "evicted"            the next block was removed between the lookup and the read
        "no_room"            through the memory tier: no room there to bring it in
        "unknown"            a daemon that does not say
    It compares equal to a plain dict of the same tensors (the attributes are left out).
    """

    __slots__ = ("num_blocks", "stop_reason")

    def __init__(self, layers: Mapping[str, torch.Tensor], num_blocks: int, stop_reason: str) -> None:
        super().__init__(layers)
        self.num_blocks = num_blocks
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        layers = dict.__repr__(self)
        return f"Selection({layers}, num_blocks={self.num_blocks}, stop_reason={self.stop_reason!r})"

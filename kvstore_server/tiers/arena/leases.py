"""The memory tier's bookkeeping records: extents, the two leases, what a pin returns.

Extent       blocks that lie together in one allocation (a save's, a promotion's, or
             the blocks put in parts by one put); freed once it holds no live block
             and nothing holds it
Reservation  an extent a saver writes, then commits (its blocks become resident) or
             aborts; reclaimed when its lease runs out uncommitted
Pin          extents a loader reads; reclaimed when its lease runs out unreleased
ExtentRun, PinnedRuns  what MemoryTier.pin answers: the pinned blocks as runs of positions
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore_server.tiers.base import BlockKey, LayerSpec


@dataclass
class Extent:
    offset: int
    nbytes: int
    blocks: int
    live: set[BlockKey] = field(default_factory=set)
    pins: int = 0  # pins, reads and promotions or part groups holding it: it may not leave
    last_use: float = 0.0
    waiting: int = 0  # live blocks waiting for write-behind: the extent may not leave
    tick: int = 0  # which of MemoryTier's entries of last_use is current


@dataclass
class Reservation:
    """An extent a save writes, then commits (MemoryTier.committing) or aborts. `id` 0: the
    daemon's own (blocks it copies in: a fleet hit, a block made whole from parts), no lease."""

    id: int
    tenant: bytes  # the caller's: only it may commit or abort
    namespace: bytes
    parent_hash: bytes
    hashes: list[bytes]  # the blocks to write, in extent order
    parents: list[bytes]  # each one's parent in its chain
    request_index: list[int]  # each one's index in the request
    skipped: int  # blocks of the request that were already stored
    layers: tuple[LayerSpec, ...]
    extent: int
    nbytes: int
    expires: float
    token_ids: list[list[int]] | None = None  # each one's tokens, when the request gave them (KV events)
    # a partial save (kvstore_server.parts): the extent holds these layers of full_layers
    subset: tuple[int, ...] | None = None
    full_layers: tuple[LayerSpec, ...] = ()
    placed: bool = False  # some of its blocks are resident: the extent is theirs now
    # not 0: a partial save written in place, in its blocks' part group's extent (of this
    # many blocks of full_layers; these from `position` on), held once by the
    # reservation: its end lets go of that hold instead of freeing the extent
    extent_blocks: int = 0
    position: int = 0


@dataclass
class Pin:
    id: int
    tenant: bytes  # the caller's: only it may release
    namespace: bytes
    extents: list[int]
    expires: float
    holders: int = 1  # Releases that end it (a lease taken at Lookup for several loaders)
    # a lease's hits (memory blocks, promoted blocks, bytes), counted when a loader releases
    # its share: a lease given back unused served nothing
    hits: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class ExtentRun:
    """`count` blocks of a pinned prefix, at positions position.. of the extent at `extent`
    (the wire's ArenaRun; the client's Run adds where they start in the prefix)."""

    extent: int
    extent_blocks: int
    position: int
    count: int


@dataclass(frozen=True, slots=True)
class PinnedRuns:
    """The leading blocks MemoryTier.pin pinned: `num_blocks` of the keys it was given (the
    next one is not in memory, or `layout_differs`); `pin_id` 0 when none."""

    pin_id: int
    layers: tuple[LayerSpec, ...]
    runs: list[ExtentRun]
    sums: bytes  # packed as kvstore.wire.pack_checksums does; block b, layer l at b * len(layers) + l
    kinds: list[str]  # each block's checksum kind
    layout_differs: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.kinds)

"""The memory tier: what is resident where in the arena, and the leases on it.

`MemoryTier` is the arena file (file.py), its committed records (index.py), and the
in-memory state: which blocks are resident in which extent (least recently used
first out), the write-behind queue, and the two leases: reservations (reserve ->
the client writes -> commit or abort) and pins (pin -> the client reads -> release),
each reclaimed when its lease runs out. It implements tiers.base.Tier.

Locks: `lock` guards the state; the store shares it (one lock: a pin checks the
store's index and the residency at once), and methods say when the caller holds
it; the others take it. Changes of the arena's contents (records, allocation that
evicts) run under the store's commit lock, as every tier's do.

NOTE: over 500 lines: the residency, the extents and the leases change together
under one lock (a lease holds extents, an eviction must see every lease), so they
are one class; the records they describe are in leases.py.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvstore import arena_format as fmt
from kvstore_server.datadir import claim_arena, withdraw_arena_claim
from kvstore_server.tiers.arena.allocator import Allocator
from kvstore_server.tiers.arena.file import ArenaError, ArenaFile
from kvstore_server.tiers.arena.index import ArenaIndex, Placed
from kvstore_server.tiers.arena.leases import Extent, ExtentRun, Pin, PinnedRuns, Reservation
from kvstore_server.tiers.base import (
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    Pieces,
    StorageFullError,
    StoredBlock,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# What the memory tier writes behind to the persistent tier (config.persist): every
# committed block, or only those loaded again while still in memory (a prefix used once
# costs the disk nothing: Dynamo's frequency filter, to spare SSDs)
PERSIST_EVERY = "every"
PERSIST_REUSED = "reused"
PERSIST_POLICIES = (PERSIST_EVERY, PERSIST_REUSED)

__all__ = ["ArenaCounters", "MemoryTier", "NoRoom", "open_memory_tier"]


# Extents used together are aged this much apart, in their prefix's order: of a request's
# extents (a promotion's are one per block), the least recently used is its chain's tail.
_TAIL_FIRST = 1e-6


class NoRoom(StorageFullError):
    """The memory tier cannot make room: the rest is pinned, reserved or waiting to be
    written behind (or the request is larger than the arena)."""


@dataclass
class ArenaCounters:
    reservations: int = 0
    commits: int = 0
    aborts: int = 0
    pins: int = 0
    leases_expired: int = 0
    promotions: int = 0
    promoted_blocks: int = 0
    prefetched_blocks: int = 0  # of them, read at a Lookup's prefetch (before any load asked)
    memory_hit_blocks: int = 0
    persistent_hit_blocks: int = 0
    written_behind: int = 0
    write_behind_dropped: int = 0
    persisted_on_reuse: int = 0  # blocks queued for write-behind at their first reuse (persist="reused")
    memory_evictions: int = 0


class MemoryTier:
    """The arena file, its index of committed blocks, and the in-memory state.

    Tier methods (tiers.base.Tier): stored_prefix, read, write, delete, close.
    Room: make_room, hold_extent, take_evicted (memory-only blocks evicted for room,
    for the store to drop from its index). Leases: reserve, fill, committing, commit,
    take_reservation, abort, pin, pin_owner, release_pin, expire. Write-behind: dirty,
    written_behind, drop_behind (tiers.chain)."""

    name = "memory"

    def __init__(
        self,
        file: ArenaFile,
        index: ArenaIndex,
        lease_seconds: float,
        write_behind_bytes: int,
        persist: str = PERSIST_EVERY,
    ) -> None:
        if persist not in PERSIST_POLICIES:
            raise ValueError(f"persist must be one of {', '.join(PERSIST_POLICIES)}, not {persist!r}")
        self.lock = threading.Lock()
        self.file = file
        self.index = index
        self.lease_seconds = lease_seconds
        self.write_behind_limit = write_behind_bytes
        self.allocator = Allocator(fmt.DATA_OFFSET, file.size)
        self.resident: dict[BlockKey, Placed] = {}
        self.resident_bytes = 0
        self.extents: dict[int, Extent] = {}
        # (last_use, tick, offset) of every extent, a min-heap: an entry is its extent's
        # current one while their ticks agree (older ones are skipped, and dropped when
        # they outnumber the extents). Eviction sorted every extent per call before: 1.5 ms
        # to evict one extent of a full arena of 20,000 (promoted 2 MiB blocks fill 40 GiB
        # so) on the 2-core VM, 0.008 ms now (bench/bench_commit.py)
        self._ages: list[tuple[float, int, int]] = []
        self._tick = 0
        self.reservations: dict[int, Reservation] = {}
        self.pins: dict[int, Pin] = {}
        self.dirty: OrderedDict[BlockKey, int] = OrderedDict()  # key -> bytes, commit order
        self.dirty_bytes = 0
        self.memory_only: set[BlockKey] = set()  # not written behind (queue full or tier full)
        # persist="reused": committed blocks not loaded since (memory-only until their first
        # hit queues them for write-behind; evicted before it, they leave the store)
        self.on_reuse = persist == PERSIST_REUSED
        self.unused: set[BlockKey] = set()
        self.counters = ArenaCounters()
        self._evicted: list[BlockKey] = []  # memory-only blocks evicted for room, not yet taken
        self._layout_rows: dict[tuple[int, int], tuple[tuple[LayerSpec, ...], Any, Any]] = {}

    # ---- the Tier interface
    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` are resident."""
        with self.lock:
            n = 0
            for key in keys:
                if key not in self.resident:
                    break
                n += 1
            return n

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        """The resident blocks of `keys` (None where one is not), views of the arena valid
        inside the context: their extents are held (never evicted, never reused) meanwhile."""
        with self.holding(keys) as placements:
            yield [self.block(p) if p is not None else None for p in placements]

    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then copy `puts` (one layer layout) into a new extent, committed:
        resident and queued for write-behind. Caller holds the commit lock. Raises NoRoom
        (blocks it evicted for room: take_evicted)."""
        self.delete(deletes)
        if not puts:
            return
        first = puts[0].meta
        res = self.reserve(
            tenant=b"", namespace=first.namespace, parent_hash=first.parent_hash,
            hashes=[p.meta.block_hash for p in puts], parents=[p.meta.parent_hash for p in puts],
            layers=first.layers, lease=False,
        )  # fmt: skip
        with self.committing(res):
            self.fill(res, lambda i, k: puts[i].buffers()[k])
            self.commit(res, [(i, p.meta, b"") for i, p in enumerate(puts)], time.time())

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Forget `keys` (evicted, taken, corrupt) and their records; unknown ones are ignored.
        An extent being read stays until its readers are done."""
        if not keys:
            return
        with self.lock:
            gone = self.unplace(keys)
        self.forget(gone)

    def close(self, *, remove: bool = False) -> None:
        """Close the tier; called once. `remove`: also delete the file and its index (a clean
        stop once everything is written behind: the memory goes back to the host).
        Otherwise they stay for the next start to recover."""
        self.index.close()
        try:
            self.file.close(remove=remove)
            if remove:
                shutil.rmtree(self.index.path, ignore_errors=False)
        except OSError as exc:
            log.warning("could not remove the memory tier's files: %s", exc)
        else:
            if remove and self.file.owner:
                withdraw_arena_claim(Path(self.file.owner))
                log.info("memory tier written behind and removed")
        if not remove and (self.dirty or self.memory_only):
            log.warning(
                "%d blocks are in the memory tier only; %s keeps them for the next start",
                len(self.dirty) + len(self.memory_only),
                self.file.path,
            )

    # ---- recovery
    def recover(self, records: Iterator[Placed]) -> list[Placed]:
        """Claim the extents of recovered records; return those that fit and agree (the
        caller places them: resident, and queued for write-behind where needed)."""
        kept: list[Placed] = []
        for placed in records:
            nbytes = fmt.extent_bytes(placed.meta.size, placed.extent_blocks)
            extent = self.extents.get(placed.extent)
            if extent is None:
                if (
                    placed.extent % fmt.ALIGN
                    or placed.position >= placed.extent_blocks
                    or not self.allocator.claim(placed.extent, nbytes)
                ):
                    log.warning(
                        "memory tier record of block %s overlaps another: dropped",
                        placed.meta.block_hash.hex(),
                    )
                    continue
                extent = self._new_extent(placed.extent, nbytes, placed.extent_blocks)
            elif extent.nbytes != nbytes or extent.blocks != placed.extent_blocks:
                log.warning(
                    "memory tier record of block %s disagrees with its extent: dropped",
                    placed.meta.block_hash.hex(),
                )
                continue
            kept.append(placed)
        return kept

    # ---- room
    def allocate(self, nbytes: int) -> int | None:
        """Free space of `nbytes`, or None; evicts nothing (caller holds the lock)."""
        return self.allocator.allocate(nbytes)

    def make_room(self, nbytes: int, now: float) -> int:
        """An extent of `nbytes`, evicting least recently used extents for it: their blocks
        stay stored in the persistent tier; memory-only ones leave the store (the store
        takes them: take_evicted). Caller holds the commit lock. Raises NoRoom."""
        if nbytes > self.allocator.total:
            raise NoRoom(f"{nbytes} bytes do not fit the memory tier ({self.allocator.total} bytes)")
        return self._room(lambda: self.allocator.allocate(nbytes), now)

    def _room(self, fit: Callable[[], _T | None], now: float) -> _T:
        """`fit()` once it succeeds, evicting least recently used extents until it does (and
        one deletion of their records: a promotion of a thousand blocks into a full arena
        evicts a thousand one-block extents). Caller holds the commit lock. Raises NoRoom."""
        gone: list[BlockKey] = []
        try:
            with self.lock:
                got = self._evict_until(fit, gone)
            if got is None:
                raise NoRoom(
                    "no room in the memory tier: the rest is pinned, reserved or waiting to be written behind"
                )
            return got
        finally:
            self.forget(gone)

    def _evict_until(self, fit: Callable[[], _T | None], gone: list[BlockKey]) -> _T | None:
        """`fit()`, evicting the least recently used extent that may leave before each new
        try (their keys added to `gone`); None when none is left. Caller holds the lock."""
        ages = self._ages
        held: list[tuple[float, int, int]] = []  # entries of extents that may not leave now
        try:
            got = fit()
            while got is None and ages:
                entry = heapq.heappop(ages)
                extent = self.extents.get(entry[2])
                if extent is None or extent.tick != entry[1]:  # freed, or used since
                    continue
                if extent.pins or extent.waiting:
                    held.append(entry)
                    continue
                keys = list(extent.live)
                self._evicted.extend(k for k in keys if k in self.memory_only)
                self.counters.memory_evictions += len(keys)
                gone += self.unplace(keys)
                if extent.offset in self.extents:  # (not freed: it keeps its place)
                    held.append(entry)
                got = fit()
            return got
        finally:
            for entry in held:
                heapq.heappush(ages, entry)

    def _new_extent(
        self, offset: int, nbytes: int, blocks: int, *, pins: int = 0, last_use: float = 0.0
    ) -> Extent:
        """A new extent at `offset` (caller holds the lock)."""
        extent = self.extents[offset] = Extent(offset, nbytes, blocks, pins=pins)
        self._used(extent, last_use)
        return extent

    def _used(self, extent: Extent, when: float) -> None:
        """`extent` was last used at `when` (caller holds the lock)."""
        self._tick += 1
        extent.last_use, extent.tick = when, self._tick
        ages = self._ages
        heapq.heappush(ages, (when, self._tick, extent.offset))
        if len(ages) > 2 * len(self.extents) + 1024:  # mostly entries of other times: rebuilt
            ages[:] = [(e.last_use, e.tick, e.offset) for e in self.extents.values()]
            heapq.heapify(ages)

    def hold_extent(self, nbytes: int, blocks: int, now: float, holds: int = 1) -> int:
        """make_room for an extent that is held from the start (a promotion's, a part
        group's, held once per block): never evicted until let go (unpin_extents, once per
        hold); its blocks become resident as they are placed. Caller holds the commit lock. Raises NoRoom."""
        offset = self.make_room(nbytes, now)
        with self.lock:
            self._new_extent(offset, nbytes, blocks, pins=holds, last_use=now)
        return offset

    def hold_block_extents(self, block_bytes: int, blocks: int, now: float) -> list[int]:
        """`blocks` one-block extents, each held once as hold_extent holds its one (a
        promotion's: a block's layers lie together, as the persistent tier stores them).
        Side by side where a free range holds them all, so blocks [a, b) are one range of
        the arena that a loader copies in one go; else in as few free ranges as hold them
        (a fragmented arena is not emptied for one long range); each block leaves on its own
        when evicted. Caller holds the commit lock. Raises NoRoom."""
        each = fmt.extent_bytes(block_bytes, 1)
        if each * blocks > self.allocator.total:
            raise NoRoom(f"{each * blocks} bytes do not fit the memory tier ({self.allocator.total} bytes)")
        offsets = self._room(lambda: self._block_slots(each, blocks), now)
        with self.lock:
            for at in offsets:
                self._new_extent(at, each, 1, pins=1, last_use=now)
        return offsets

    def _block_slots(self, each: int, blocks: int) -> list[int] | None:
        """`blocks` free slots of `each` bytes, taken (one range if one holds them all, else
        from the largest free ranges first), or None (nothing taken) when they do not fit."""
        allocator = self.allocator
        whole = allocator.allocate(each * blocks)
        if whole is not None:
            return [whole + i * each for i in range(blocks)]
        if allocator.free_bytes < each * blocks:
            return None
        plan: list[tuple[int, int]] = []  # (start, slots)
        wanted = blocks
        for start, length in sorted(allocator.runs(), key=lambda run: -run[1]):
            slots = min(length // each, wanted)
            if slots:
                plan.append((start, slots))
                wanted -= slots
            if not wanted:
                break
        if wanted:
            return None
        offsets: list[int] = []
        for start, slots in sorted(plan):
            allocator.claim(start, slots * each)
            offsets.extend(start + i * each for i in range(slots))
        return offsets

    def take_evicted(self) -> list[BlockKey]:
        """The memory-only blocks evicted for room since the last call: they left the store
        (caller holds the lock, and drops them from its index under it)."""
        taken, self._evicted = self._evicted, []
        return taken

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Drop the records of blocks that left the arena."""
        if not keys:
            return
        try:
            self.index.delete(keys)
        except ArenaError as exc:
            log.error("%s; %d blocks may come back from the memory tier at restart", exc, len(keys))

    # ---- residency (caller holds the lock)
    def place(self, blocks: Sequence[Placed], now: float, *, dirty: bool) -> None:
        """Make `blocks` resident in their extents (one extent, or a promotion's one-block
        extents side by side)."""
        extent: Extent | None = None
        later = 0  # each extent a little older than the one before it: the chain's tail goes first
        layers: tuple[LayerSpec, ...] | None = None
        size = 0
        for placed in blocks:
            meta = placed.meta
            if meta.layers is not layers:  # the size looked up once a layout (they are interned)
                layers, size = meta.layers, meta.size
            if extent is None or extent.offset != placed.extent:
                extent = self.extents.get(placed.extent)
                if extent is None:
                    extent = self._new_extent(
                        placed.extent, fmt.extent_bytes(size, placed.extent_blocks), placed.extent_blocks
                    )
                self._used(extent, now - later * _TAIL_FIRST)
                later += 1
            key = meta.key
            extent.live.add(key)
            self.resident[key] = placed
            self.resident_bytes += size
            if dirty and self.on_reuse:
                self.memory_only.add(key)
                self.unused.add(key)
            elif dirty:
                if self.dirty_bytes + size > self.write_behind_limit:
                    self.memory_only.add(key)
                    self.counters.write_behind_dropped += 1
                else:
                    self.dirty[key] = size
                    self.dirty_bytes += size
                    extent.waiting += 1

    def _undirty(self, key: BlockKey) -> bool:
        """Take `key` off the write-behind queue; whether it was on it."""
        size = self.dirty.pop(key, None)
        if size is None:
            return False
        self.dirty_bytes -= size
        extent = self.extents.get(self.resident[key].extent)
        if extent is not None:
            extent.waiting -= 1
        return True

    def unplace(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Forget `keys`; free extents left empty. Returns the keys that were resident
        (their records are the caller's to delete: forget)."""
        gone = []
        for key in keys:
            placed = self.resident.get(key)
            if placed is None:
                continue
            gone.append(key)
            self.memory_only.discard(key)
            self.unused.discard(key)
            self._undirty(key)
            del self.resident[key]
            self.resident_bytes -= placed.meta.size
            extent = self.extents.get(placed.extent)
            if extent is not None:
                extent.live.discard(key)
                self._maybe_free(extent)
        return gone

    def _maybe_free(self, extent: Extent) -> None:
        if not extent.live and not extent.pins:
            del self.extents[extent.offset]
            self.allocator.free(extent.offset, extent.nbytes)

    def reused(self, keys: Iterable[BlockKey]) -> int:
        """A hit on `keys` (caller holds the lock): under persist="reused", those committed
        and not loaded since join the write-behind queue (or stay memory-only past its
        bound). Returns how many joined it."""
        unused = self.unused
        if not unused:
            return 0
        queued = 0
        for key in keys:
            if key not in unused:
                continue
            unused.discard(key)
            size = self.resident[key].meta.size
            if self.dirty_bytes + size > self.write_behind_limit:
                self.counters.write_behind_dropped += 1
                continue
            self.memory_only.discard(key)
            self.dirty[key] = size
            self.dirty_bytes += size
            extent = self.extents.get(self.resident[key].extent)
            if extent is not None:
                extent.waiting += 1
            self.counters.persisted_on_reuse += 1
            queued += 1
        return queued

    def written_behind(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            if self._undirty(key):
                self.counters.written_behind += 1

    def drop_behind(self, keys: Sequence[BlockKey]) -> None:
        """The persistent tier refused these: they stay in memory only."""
        for key in keys:
            if self._undirty(key):
                self.memory_only.add(key)
                self.counters.write_behind_dropped += 1

    # ---- holding extents
    def pin_extents(self, offsets: Sequence[int], now: float) -> None:
        """Caller holds the lock. `offsets` in the order of the prefix they hold: each a
        little older than the one before it, so that the chain's tail is evicted first."""
        for later, offset in enumerate(offsets):
            extent = self.extents[offset]
            extent.pins += 1
            self._used(extent, now - later * _TAIL_FIRST)

    def unpin_extents(self, offsets: Sequence[int]) -> None:
        """Caller holds the lock."""
        for offset in offsets:
            extent = self.extents.get(offset)
            if extent is not None:
                extent.pins -= 1
                self._maybe_free(extent)

    @contextmanager
    def holding(self, keys: Sequence[BlockKey]) -> Iterator[list[Placed | None]]:
        """Where `keys` lie (None where one is not resident), their extents held while the
        context is open: their bytes are neither evicted nor reused meanwhile."""
        with self.lock:
            placements = [self.resident.get(key) for key in keys]
            extents = list(dict.fromkeys(p.extent for p in placements if p is not None))
            self.pin_extents(extents, time.time())
        try:
            yield placements
        finally:
            with self.lock:
                self.unpin_extents(extents)

    # ---- reservations: reserve -> fill (the client, or fill) -> commit or abort
    def new_id(self) -> int:
        while True:
            lease_id = secrets.randbits(63) or 1
            if lease_id not in self.reservations and lease_id not in self.pins:
                return lease_id

    def reserve(
        self,
        *,
        tenant: bytes,
        namespace: bytes,
        parent_hash: bytes,
        hashes: list[bytes],
        parents: list[bytes],
        layers: tuple[LayerSpec, ...],
        request_index: list[int] | None = None,
        skipped: int = 0,
        token_ids: list[list[int]] | None = None,
        subset: tuple[int, ...] | None = None,
        full_layers: tuple[LayerSpec, ...] = (),
        lease: bool = True,
        in_group: tuple[int, int, int] | None = None,
    ) -> Reservation:
        """An extent for `hashes` of `layers` (make_room), leased to `tenant` when `lease`
        (else the daemon's own: id 0, committed or let go by its caller). `in_group`: a
        partial save written in place, (extent, its blocks, first position) of its blocks'
        part group, which the caller has held once for it (see Reservation.extent_blocks).
        Caller holds the commit lock. Raises NoRoom."""
        extent_blocks = position = 0
        if in_group is not None:
            offset, extent_blocks, position = in_group
            nbytes = 0
        else:
            nbytes = fmt.extent_bytes(sum(layer.nbytes for layer in layers), len(hashes))
            offset = self.make_room(nbytes, time.time())
        with self.lock:
            res = Reservation(
                id=self.new_id() if lease else 0, tenant=tenant, namespace=namespace,
                parent_hash=parent_hash, hashes=hashes, parents=parents,
                request_index=request_index if request_index is not None else list(range(len(hashes))),
                skipped=skipped, layers=layers, extent=offset, nbytes=nbytes,
                expires=time.monotonic() + self.lease_seconds if lease else 0.0, token_ids=token_ids,
                subset=subset, full_layers=full_layers, extent_blocks=extent_blocks, position=position,
            )  # fmt: skip
            if lease:
                self.reservations[res.id] = res
                self.counters.reservations += 1
        return res

    def views(
        self, extent: int, layers: Sequence[LayerSpec], blocks: int
    ) -> Callable[[int, int], memoryview]:
        """view(block, layer): where that block's layer lies in an extent of `blocks` blocks
        of `layers` (the offsets computed once)."""
        sizes = [spec.nbytes for spec in layers]
        starts = [extent + blocks * start for start in fmt.layer_starts(sizes)]
        arena = self.file.view

        def view(block: int, layer: int) -> memoryview:
            at = starts[layer] + block * sizes[layer]
            return arena[at : at + sizes[layer]]

        return view

    def layer_runs(
        self, extent: int, layers: Sequence[LayerSpec], blocks: int
    ) -> Callable[[int], memoryview]:
        """run(layer): that layer of every block of an extent of `blocks` blocks of `layers`,
        back to back (an extent is laid out layer by layer)."""
        sizes = [spec.nbytes for spec in layers]
        starts = [extent + blocks * start for start in fmt.layer_starts(sizes)]
        arena = self.file.view
        return lambda layer: arena[starts[layer] : starts[layer] + blocks * sizes[layer]]

    def fill(self, res: Reservation, data: Callable[[int, int], memoryview | bytes]) -> None:
        """Copy `data(block, layer)` into the reservation's extent (the daemon's own saves)."""
        view = self.views(res.extent, res.layers, len(res.hashes))
        for i in range(len(res.hashes)):
            for k in range(len(res.layers)):
                view(i, k)[:] = data(i, k)

    def reservation(self, reservation_id: int, tenant: bytes) -> Reservation | None:
        """`tenant`'s reservation of that id, still leased (caller holds the lock)."""
        res = self.reservations.get(reservation_id)
        return res if res is not None and res.tenant == tenant else None

    def take_reservation(self, reservation_id: int, tenant: bytes) -> Reservation | None:
        """The reservation, no longer leased (its caller commits it or lets it go), or None
        when `tenant` has none of that id (caller holds the lock)."""
        res = self.reservations.get(reservation_id)
        if res is None or res.tenant != tenant:
            return None
        del self.reservations[reservation_id]
        return res

    def abort(self, reservation_id: int, tenant: bytes) -> bool:
        """Give a reservation's space back; False when there is none of that id."""
        with self.lock:
            res = self.take_reservation(reservation_id, tenant)
            if res is None:
                return False
            self._give_back(res)
            self.counters.aborts += 1
            return True

    def _give_back(self, res: Reservation) -> None:
        """A reservation's extent, none of whose blocks were placed, given back: freed, or
        the hold on its part group's let go (caller holds the lock)."""
        if res.extent_blocks:
            self.unpin_extents([res.extent])
        else:
            self.allocator.free(res.extent, res.nbytes)

    @contextmanager
    def committing(self, res: Reservation) -> Iterator[Reservation]:
        """A taken reservation being committed: however the context ends, its space comes
        back unless some of its blocks were placed (then it is theirs)."""
        try:
            yield res
        finally:
            with self.lock:
                if not res.placed:
                    self._give_back(res)

    def commit(
        self, res: Reservation, blocks: Sequence[tuple[int, BlockMeta, bytes]], now: float
    ) -> list[Placed]:
        """Make blocks of a reservation's extent resident and queue them for write-behind:
        (position, metadata, packed checksums or b"") each. The records first (one LMDB
        transaction: what a restart recovers). Caller holds the commit lock. Raises
        ArenaError with nothing changed."""
        return self.commit_blocks(res.extent, len(res.hashes), blocks, now, res)

    def commit_blocks(
        self,
        extent: int,
        extent_blocks: int,
        blocks: Sequence[tuple[int, BlockMeta, bytes]],
        now: float,
        res: Reservation | None = None,
    ) -> list[Placed]:
        """commit, for blocks of any extent the caller holds (a part group's)."""
        placed = [Placed(meta, extent, extent_blocks, position, sums) for position, meta, sums in blocks]
        if not placed:
            return placed
        self.index.put(placed)
        with self.lock:
            self.place(placed, now, dirty=True)
            if res is not None:
                res.placed = True
        return placed

    # ---- pins: pin -> the client reads -> release
    def pin(
        self,
        tenant: bytes,
        namespace: bytes,
        keys: Sequence[BlockKey],
        pending: dict[BlockKey, Placed],
        now: float,
        holders: int = 1,
    ) -> PinnedRuns:
        """Pin the leading `keys` that are resident (or `pending`: a promotion's, still being
        read) with one layer set, for the lease, until `holders` Releases (caller holds the
        lock)."""
        # runs of consecutive positions in one extent, as [extent, extent_blocks, first, count]
        spans: list[list[int]] = []
        sums: list[bytes] = []  # each block's, packed (Placed.sums)
        kinds: list[str] = []
        layers: tuple[LayerSpec, ...] = ()
        differs = False
        resident = self.resident
        for key in keys:
            placed = resident.get(key) or pending.get(key)
            if placed is None:
                break
            meta = placed.meta
            if layers is not meta.layers:  # layouts are interned: one tuple per layout
                if layers and meta.layers != layers:
                    differs = True
                    break
                layers = meta.layers
            last = spans[-1] if spans else None
            if last is not None and last[0] == placed.extent and last[2] + last[3] == placed.position:
                last[3] += 1
            else:
                spans.append([placed.extent, placed.extent_blocks, placed.position, 1])
            sums.append(placed.sums)
            kinds.append(meta.checksum_kind)
        if not spans:
            return PinnedRuns(0, (), [], b"", [], differs)
        runs = [ExtentRun(*span) for span in spans]
        extents = list(dict.fromkeys(run.extent for run in runs))
        self.pin_extents(extents, now)
        pin_id = self.new_id()
        self.pins[pin_id] = Pin(
            pin_id, tenant, namespace, extents, time.monotonic() + self.lease_seconds, holders
        )
        self.counters.pins += 1
        return PinnedRuns(pin_id, layers, runs, b"".join(sums), kinds, differs)

    def pin_owner(self, pin_id: int, tenant: bytes) -> bytes | None:
        """The namespace of `tenant`'s pin `pin_id`, or None (expired, released, another's)."""
        with self.lock:
            pin = self.pins.get(pin_id)
            return pin.namespace if pin is not None and pin.tenant == tenant else None

    def release_pin(self, pin_id: int, tenant: bytes, *, all_holders: bool = False) -> Pin | None:
        """One holder's Release (or every holder's); the pin ends with its last (caller holds
        the lock)."""
        pin = self.pins.get(pin_id)
        if pin is None or pin.tenant != tenant:
            return None
        pin.holders = 0 if all_holders else pin.holders - 1
        if pin.holders > 0:
            return pin
        del self.pins[pin_id]
        self.unpin_extents(pin.extents)
        return pin

    def corrupt(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Of `keys` (blocks a client found failing their checksums), those resident whose
        bytes here fail them too (each verified while its extent is held)."""
        bad = []
        for key in keys:
            with self.read([key]) as blocks:
                block = blocks[0]
                if block is not None and block.corrupt_layer() is not None:
                    bad.append(key)
        return bad

    def expire(self, now: float) -> int:  # time.monotonic()
        """Reclaim reservations and pins whose lease ran out; how many (caller holds the lock)."""
        expired = 0
        for res in [r for r in self.reservations.values() if r.expires <= now]:
            del self.reservations[res.id]
            self._give_back(res)
            expired += 1
        for pin in [p for p in self.pins.values() if p.expires <= now]:
            del self.pins[pin.id]
            self.unpin_extents(pin.extents)
            expired += 1
        if expired:
            self.counters.leases_expired += expired
            log.info("reclaimed %d expired memory-tier leases", expired)
        return expired

    # ---- reading
    def extent_rows(
        self,
        layers: tuple[LayerSpec, ...],
        extent: int,
        num_blocks: int,
        positions: Sequence[int] | None = None,
    ) -> Any:
        """Where the blocks at `positions` (default every one) of an extent of `num_blocks`
        blocks lie, layer by layer: a numpy uint64 array [len(positions), layers, 2] of
        (address, length) rows (iovecs), made in one step from each layout's offsets
        (computed once per layout and extent size)."""
        import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

        before, sizes = self._layer_offsets(layers, num_blocks)
        at = (
            np.arange(num_blocks, dtype=np.uint64)
            if positions is None
            else np.array(positions, dtype=np.uint64)
        )
        rows = np.empty((len(at), len(sizes), 2), dtype=np.uint64)
        rows[:, :, 0] = before[None, :] + sizes[None, :] * at[:, None] + np.uint64(self.file.address + extent)
        rows[:, :, 1] = sizes[None, :]
        return rows

    def _layer_offsets(self, layers: tuple[LayerSpec, ...], num_blocks: int) -> tuple[Any, Any]:
        """(where each layer's run starts in an extent of `num_blocks` blocks, each layer's
        bytes per block), as numpy uint64 arrays; once per layout and extent size."""
        import numpy as np

        key = (id(layers), num_blocks)
        cached = self._layout_rows.get(key)
        if cached is None or cached[0] is not layers:
            if len(self._layout_rows) > 256:
                self._layout_rows.clear()
            sizes = np.array([spec.nbytes for spec in layers], dtype=np.uint64)
            starts = np.array(fmt.layer_starts([spec.nbytes for spec in layers]), dtype=np.uint64)
            cached = self._layout_rows[key] = (layers, starts * np.uint64(num_blocks), sizes)
        return cached[1], cached[2]

    def blocks_pieces(self, blocks: Sequence[Placed]) -> list[Pieces]:
        """Where each block lies, layer by layer (tiers.base.Pieces: what write-behind writes
        from): the rows of consecutive blocks of one extent made together (extent_rows of
        their positions: numpy's per-call cost, per block, was a fifth of write-behind's
        Python), and of those blocks alone (the whole extent's rows for each block made a
        batch quadratic in the extent's size)."""
        out: list[Pieces] = []
        for (extent, count, _), run in itertools.groupby(
            blocks, key=lambda placed: (placed.extent, placed.extent_blocks, id(placed.meta.layers))
        ):
            group = list(run)
            rows = self.extent_rows(
                group[0].meta.layers, extent, count, [placed.position for placed in group]
            )
            out.extend(Pieces(block_rows, self.file) for block_rows in rows)
        return out

    def block(self, placed: Placed) -> StoredBlock:
        view = self.file.view
        offsets = placed.layer_offsets()
        layers = [view[at : at + spec.nbytes] for at, spec in zip(offsets, placed.meta.layers, strict=True)]
        return StoredBlock(placed.meta, layers)

    def stats(self) -> dict[str, int]:
        """Caller holds the lock."""
        # extents held by loads' pins; not those write-behind or a read holds for a moment
        pinned_extents = {offset for pin in self.pins.values() for offset in pin.extents}
        pinned = sum(self.extents[offset].nbytes for offset in pinned_extents if offset in self.extents)
        return {
            "memory_capacity_bytes": self.allocator.total,
            "memory_used_bytes": self.allocator.total - self.allocator.free_bytes,
            "memory_blocks": len(self.resident),
            "memory_bytes": self.resident_bytes,
            "pinned_bytes": pinned,
            "reserved_bytes": sum(r.nbytes for r in self.reservations.values()),
            "write_behind_blocks": len(self.dirty),
            "write_behind_bytes": self.dirty_bytes,
            "memory_only_blocks": len(self.memory_only),
            "unused_blocks": len(self.unused),
            **vars(self.counters),
        }


def open_memory_tier(
    memory_dir: Path,
    data_dir: Path,
    size: int,
    store_id: str,
    *,
    lease_seconds: float,
    write_behind_bytes: int,
    group: int | None = None,
    persist: str = PERSIST_EVERY,
) -> MemoryTier:
    """The data directory's arena under `memory_dir`, recovered if it outlived a daemon,
    locked while it is open and claimed by `data_dir` (see kvstore.arenas)."""
    path = fmt.arena_file(memory_dir, data_dir)
    file = ArenaFile(path, size, store_id, owner=str(data_dir.resolve()), group=group)
    try:
        index = ArenaIndex(fmt.index_path(path), file.header.arena_id)
    except ArenaError:
        file.close()
        raise
    claim_arena(data_dir, path, file.header.arena_id)
    return MemoryTier(file, index, lease_seconds, write_behind_bytes, persist)

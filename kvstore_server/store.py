"""The store: the prefix index, capacity and the hand-off wait, over a chain of tiers.

`Store` is what the gRPC servicer calls, from many worker threads at once. It
takes validated Python values and raises kvstore_server.errors; translating them
to gRPC status codes is the servicer's job.

Tiers (`tiers.chain.TierChain`, each a `tiers.base.Tier`): the memory tier
(`tiers.arena`, optional: reservations and pins are its leases) in front of the
persistent tier (`backend`: LMDB or disk), and the fleet (optional, read
through). The index holds every visible block, whichever tier has it, and
`capacity_bytes` bounds them all: the persistent tier gets every block in the end
(written behind from the arena).

The store is built in layers, one module each:

    ledger.Ledger         the index, the locks, the counters, the listeners; dropping
                          what a tier evicted or a read found corrupt, announced
    admission.Admitting   the ways in (Put, reserve/commit/abort, parts, fleet hits),
                          all ending in one admission: checks, room, the tier's write,
                          the index, the event
    loads.Loading         the ways out (Get, DropSelect, pin/release, the fleet's
                          read-through)
    store.Store           start (the index rebuilt from the tiers), lookups, the
                          operators' calls (Evict, Stats, List, Describe), stop

Locks: see ledger.
"""

from __future__ import annotations

import gc
import heapq
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvstore import wire
from kvstore_server import eviction
from kvstore_server.errors import FleetUnavailable, NoFleet, NotFoundError
from kvstore_server.index import Entry, PrefixIndex
from kvstore_server.ledger import Counters, Listener
from kvstore_server.loads import MAX_PREFETCHES, Loading, PinResult
from kvstore_server.parts import ArenaRoom, PartAssembler
from kvstore_server.tiers import Backend, BlockKey, BlockMeta, StorageError
from kvstore_server.tiers.arena import MemoryTier
from kvstore_server.tiers.chain import ReadResult, TierChain
from kvstore_server.tiers.fleet import FleetTier
from kvstore_server.tiers.writeback import FleetWriteBehind, WriteBehind

__all__ = ["BlockInfo", "PinResult", "ReadResult", "Store"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    namespace: bytes
    block_hash: bytes
    entry: Entry
    num_children: int


class Store(Loading):
    """The store (see the module docstring): admission.Admitting and loads.Loading are its
    ways in and out, ledger.Ledger the index they share; here: start, lookups, operators,
    stop."""

    def __init__(
        self,
        backend: Backend,
        capacity_bytes: int,
        *,
        memory: MemoryTier | None = None,
        fleet: FleetTier | None = None,
        fleet_queue_bytes: int = 256 << 20,
        partial_bytes: int = 2 << 30,
        partial_timeout_s: float = 30.0,
    ) -> None:
        self.backend = backend
        self.memory = memory
        self.fleet = fleet
        # the byte budget of the blocks: what the persistent tier can hold of --capacity
        # once its own index is paid for (LmdbBackend.payload_capacity), so eviction makes
        # room before the segments run out rather than after
        payload = getattr(backend, "payload_capacity", None)
        self.capacity_bytes = min(capacity_bytes, payload) if payload else capacity_bytes
        self.configured_capacity = capacity_bytes  # what stats report: the bound of the files
        self.counters = Counters()
        self.started_at = time.time()
        self._index = PrefixIndex()
        self._lock = memory.lock if memory is not None else threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()
        self._draining = False  # DropSelect waiters give up
        self._closed = False  # no more writes
        self._listeners: list[Listener] = []
        self._eviction_helps = True  # see _write
        # blocks put in parts (tensor-parallel ranks' KV heads), assembled in the arena when
        # it has room; and the layers of each block that partial DropSelects took
        room = ArenaRoom(memory.file.view, self._hold_parts, self._let_go) if memory is not None else None
        self.parts = PartAssembler(partial_bytes, partial_timeout_s, arena=room)
        self._parts_lock = threading.Lock()
        self._taken: dict[BlockKey, set[int]] = {}
        self.tiers = TierChain(backend, memory, fleet, index=self._index, commit_lock=self._commit_lock)
        self._fleet_writer = (
            FleetWriteBehind(self.tiers, fleet, fleet_queue_bytes) if fleet is not None else None
        )
        self.fleet_promoted_blocks = 0
        self._placing = {}  # pin id -> its promotion, until placed (loads.Placing)
        # Lookups' prefetches: their promotions finished (placed) here, a few at a time
        self._prefetch_slots = threading.BoundedSemaphore(MAX_PREFETCHES)
        self._prefetcher = ThreadPoolExecutor(2, thread_name_prefix="kvstore-prefetch")
        # fetches the next batch from the fleet while a read stores the one before
        self._fleet_fetcher = (
            ThreadPoolExecutor(4, thread_name_prefix="kvstore-fleet-fetch") if fleet is not None else None
        )
        # NOTE: no cyclic GC while a million records become index entries: full
        # collections over the growing heap were half of the rebuild's time
        collecting = gc.isenabled()
        gc.disable()
        try:
            for meta in backend.scan():
                self._index.add(*meta.key, meta.parent_hash, meta.size, meta.created_at, len(meta.layers))
        finally:
            if collecting:
                gc.enable()
        if memory is not None:
            self._recover_memory(memory)
        self._index.sort_leaves()
        self._writer = WriteBehind(self.tiers) if memory is not None else None
        self._after_load(backend)

    def _recover_memory(self, memory: MemoryTier) -> None:
        """Take back the blocks a previous daemon committed to the arena: those the
        persistent tier has are resident copies; the others wait for write-behind."""
        recovered = memory.recover(memory.index.scan())
        queued = 0
        for placed in recovered:
            m = placed.meta
            persisted = self._index.get(*m.key) is not None
            if not persisted:
                self._index.add(*m.key, m.parent_hash, m.size, m.created_at, len(m.layers))
            memory.place([placed], m.created_at, dirty=not persisted)
            queued += not persisted
        if recovered:
            log.info("memory tier: recovered %d committed blocks from %s (%d not yet written behind)",
                     len(recovered), memory.file.path, queued)  # fmt: skip

    def _after_load(self, backend: Backend) -> None:
        """Evict down to the capacity, and let the backend move what lies beyond it."""
        if self._index.bytes_used > self.capacity_bytes:
            with self._commit_lock, self._lock:
                victims = eviction.down_to(self._index, self.capacity_bytes)
            self.tiers.delete(victims)
            log.info("evicted %d blocks to fit the configured capacity", len(victims))
        relocate = getattr(backend, "relocate", None)
        if relocate is not None:  # what lies beyond a capacity that shrank moves inside it
            for key in relocate():
                self._index.remove(*key)
        log.info(
            "loaded %d blocks (%d bytes) in %d namespaces from the %s backend",
            self._index.num_blocks,
            self._index.bytes_used,
            len(self._index.namespaces()),
            backend.name,
        )

    # ---- serving path
    def lookup(self, namespace: bytes, hashes: Sequence[bytes], *, probe: bool = False) -> int:
        """The stored prefix: from the index, continued in the fleet (within its lookup
        deadline) where the local tiers stop short. A probe (a router asking ahead of
        the request) changes no recency and counts only as a probe."""
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
            if not probe:
                self._index.touch(namespace, hashes[:n])
        if n < len(hashes) and self.fleet is not None:
            n += self.tiers.fleet_prefix([(namespace, h) for h in hashes[n:]])
        with self._lock:
            if probe:
                self.counters.probe_lookups += 1
                return n
            self.counters.lookups += 1
            self.counters.hit_blocks += n
            self.counters.miss_blocks += len(hashes) - n
        return n

    def tiers_of(self, namespace: bytes, hashes: Sequence[bytes], n: int) -> bytes:
        """Where each of the first `n` blocks of `hashes` (a prefix lookup found) is read
        from: a byte per block, kvstore.wire.TIER_* (blocks the local index lacks: the fleet)."""
        resident = self.memory.resident if self.memory is not None else {}
        out = bytearray(n)
        with self._lock:
            for i, block_hash in enumerate(hashes[:n]):
                if (namespace, block_hash) in resident:
                    out[i] = wire.TIER_MEMORY
                elif self._index.get(namespace, block_hash) is not None:
                    out[i] = wire.TIER_PERSISTENT
                else:
                    out[i] = wire.TIER_FLEET
        return bytes(out)

    # ---- operators
    def evict(self, select: Callable[[PrefixIndex], list[BlockKey]]) -> tuple[int, int]:
        """Evict what `select` picks (one of kvstore_server.eviction's functions)."""
        with self._commit_lock:
            with self._lock:
                before = self._index.bytes_used
                victims = select(self._index)
                freed = before - self._index.bytes_used
                self._emit_removed(victims)
                self.counters.evictions += len(victims)
            self.tiers.delete(victims)
        if victims:
            log.info("evicted %d blocks (%d bytes) on request", len(victims), freed)
        return len(victims), freed

    def evict_fleet(self, namespace: bytes, *, whole: bool = True) -> int:
        """Remove from the fleet every object of `namespace` (whole=False: of every namespace
        starting with it); how many. Local tiers are untouched (evict does those)."""
        if self.fleet is None:
            raise NoFleet("this daemon runs without a fleet tier (--fleet)")
        try:
            removed = self.fleet.delete_matching(namespace, exact=whole)
        except StorageError as exc:
            raise FleetUnavailable(str(exc)) from exc
        log.info("removed %d objects from the fleet", removed)
        return removed

    def stats(self) -> dict[str, int | float | str]:
        with self._parts_lock:
            parts = self.parts.stats()
        with self._lock:
            return {
                **parts,
                "blocks": self._index.num_blocks,
                "bytes_used": self._index.bytes_used,
                "capacity_bytes": self.configured_capacity,
                "namespaces": len(self._index.namespaces()),
                "backend": self.backend.name,
                "uptime_seconds": time.time() - self.started_at,
                **vars(self.counters),
                **(self.memory.stats() if self.memory is not None else {}),
                **self.tiers.rates(),
                **self._fleet_stats(),
            }

    def _fleet_stats(self) -> dict[str, int]:
        if self.fleet is None or self._fleet_writer is None:
            return {}
        return {
            **self.fleet.stats(),
            **self._fleet_writer.stats(),
            "fleet_promoted_blocks": self.fleet_promoted_blocks,
            "fleet_enabled": True,
        }

    def list_blocks(
        self, namespace: bytes | None, limit: int, after: BlockKey | None, tenant: bytes = b""
    ) -> tuple[list[BlockInfo], BlockKey | None]:
        """Blocks in (namespace, hash) order, after `after`; at most `limit`; and the key
        to continue after (None: that was the last page).

        `namespace` None: every namespace of `tenant` (starting with its bytes). The lock is
        held only to copy one namespace's hashes at a time (C speed) and to read
        the page's entries: ordering a large store's keys (seconds for millions)
        never stalls lookups and puts. A block removed meanwhile is left out.
        """
        with self._lock:
            spaces = [namespace] if namespace is not None else self._index.namespaces()
        keys: list[BlockKey] = []
        for ns in sorted(s for s in spaces if s.startswith(tenant) and (after is None or s >= after[0])):
            with self._lock:
                hashes = self._index.hashes(ns)
            if after is not None and ns == after[0]:
                hashes = [h for h in hashes if h > after[1]]
            keys.extend((ns, h) for h in heapq.nsmallest(limit - len(keys), hashes))
            if len(keys) == limit:
                break
        with self._lock:
            infos = [self._info(k) for k in keys if self._index.get(*k) is not None]
        return infos, keys[-1] if len(keys) == limit else None

    def namespaces(self, tenant: bytes = b"") -> list[bytes]:
        """The namespaces of `tenant` (starting with its bytes) that hold blocks, sorted."""
        with self._lock:
            spaces = self._index.namespaces()
        return sorted(ns for ns in spaces if ns.startswith(tenant))

    def describe(self, namespace: bytes, block_hash: bytes) -> tuple[BlockInfo, BlockMeta]:
        with self._lock:
            if self._index.get(namespace, block_hash) is None:
                raise NotFoundError(f"block {block_hash.hex()} is not stored in this namespace")
            info = self._info((namespace, block_hash))
        with self.tiers.read([(namespace, block_hash)]) as blocks:
            block = blocks[0]
            if block is None:
                raise NotFoundError(f"block {block_hash.hex()} vanished while being described")
            return info, block.meta

    def _info(self, key: BlockKey) -> BlockInfo:
        entry = self._index.get(*key)
        if entry is None:
            raise NotFoundError(key[1].hex())
        return BlockInfo(key[0], key[1], entry, self._index.num_children(*key))

    # ---- lifecycle
    def begin_shutdown(self) -> None:
        """Release DropSelect waiters (UNAVAILABLE); everything else keeps working."""
        with self._changed:
            self._draining = True
            self._changed.notify_all()

    def close(self) -> None:
        """Write behind what waits, close the tiers; called once, after the server stopped."""
        self.begin_shutdown()
        if self._writer is not None:
            self._writer.close()
        if self._fleet_writer is not None:
            self._fleet_writer.close()
        if self._fleet_fetcher is not None:
            self._fleet_fetcher.shutdown(wait=True)
        self._prefetcher.shutdown(wait=True)  # the prefetches' blocks placed, before the tiers close
        with self._commit_lock:
            with self._lock:
                self._closed = True
            self.tiers.close()

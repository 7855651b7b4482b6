"""What every part of the store shares: the prefix index and what guards and announces it.

`Ledger` is the base of `kvstore_server.store.Store`, whose parts build on it in
layers: admission.Admitting (every way in), loads.Loading (every way out: reads,
DropSelect, pins, the fleet's read-through), store.Store (lookups, operators,
start and stop). It holds no logic of its own beyond what they all use: the
index, the locks, the counters and the listeners, and dropping blocks that left
the store (evicted by a tier, found corrupt) with their "removed" event.

Locks: `_lock` (the memory tier's, shared) guards the index, the memory tier's
state and the counters, and is held only for in-memory work. `_commit_lock`
serialises everything that changes a tier's contents (puts, commits, promotions,
write-behind, evictions, drop-selects), so the index and the tiers change
together. Order: `_parts_lock`, then `_commit_lock`, then `_lock`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore_server.errors import NoMemoryTier
from kvstore_server.index import PrefixIndex
from kvstore_server.parts import PartAssembler
from kvstore_server.tiers import Backend, BlockKey
from kvstore_server.tiers.arena import MemoryTier
from kvstore_server.tiers.chain import TierChain
from kvstore_server.tiers.fleet import FleetTier
from kvstore_server.tiers.writeback import FleetWriteBehind, WriteBehind

if TYPE_CHECKING:
    from kvstore_server.loads import Placing

log = logging.getLogger(__name__)


@dataclass
class Counters:
    lookups: int = 0
    probe_lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    puts: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    checksum_failures: int = 0


Listener = Callable[
    [str, bytes, Sequence[bytes], Sequence[bytes], "Sequence[Sequence[int]] | None", "str | None"], None
]
"""Called as listener(kind, namespace, hashes, parents, tokens, tier) with kind "stored" or
"removed", under the store's lock, in commit order; `tokens`: each stored block's token
ids when its put gave them, else None; `tier`: for "stored", the tier the commit put the
blocks in (kvstore.kv_events_media MEMORY or PERSISTENT), None for "removed" (the blocks
left the store: every tier)."""


class Ledger:
    """The state the store's parts share (set by Store.__init__) and the helpers they all use."""

    backend: Backend
    memory: MemoryTier | None
    fleet: FleetTier | None
    tiers: TierChain
    capacity_bytes: int
    counters: Counters
    parts: PartAssembler
    fleet_promoted_blocks: int
    _index: PrefixIndex
    _lock: threading.Lock
    _changed: threading.Condition
    _commit_lock: threading.Lock
    _parts_lock: threading.Lock
    _draining: bool
    _closed: bool
    _eviction_helps: bool
    _listeners: list[Listener]
    _taken: dict[BlockKey, set[int]]
    _writer: WriteBehind | None
    _fleet_writer: FleetWriteBehind | None
    _fleet_fetcher: ThreadPoolExecutor | None
    _placing: dict[int, Placing]
    _prefetch_slots: threading.BoundedSemaphore
    _prefetcher: ThreadPoolExecutor

    def _tier(self) -> MemoryTier:
        if self.memory is None:
            raise NoMemoryTier("this daemon runs without a memory tier (--memory 0)")
        return self.memory

    def _drop_evicted(self) -> None:
        """Drop what the memory tier evicted for room (memory-only blocks: they left the
        store). Called after every allocation in the arena, and before every admission
        (under the commit lock: a block evicted and put again is dropped before it is put)."""
        if self.memory is not None:
            with self._lock:
                self._drop(self.memory.take_evicted())

    def _drop(self, keys: Sequence[BlockKey]) -> None:
        """Blocks a tier evicted: out of the index, announced (caller holds the lock)."""
        gone = [key for key in keys if self._index.remove(*key) is not None]
        self._emit_removed(gone)
        self.counters.evictions += len(gone)

    def _emit_removed(self, keys: Sequence[BlockKey]) -> None:
        if self._taken:  # a block gone no longer needs its partial takes remembered
            for key in keys:
                self._taken.pop(key, None)
        if not keys or not self._listeners:
            return
        by_ns: dict[bytes, list[bytes]] = {}
        for ns, h in keys:
            by_ns.setdefault(ns, []).append(h)
        for ns, hashes in by_ns.items():
            for listener in self._listeners:
                listener("removed", ns, hashes, [], None, None)

    def _remove_corrupt(self, key: BlockKey) -> None:
        with self._commit_lock:
            with self._lock:
                if self._index.remove(*key) is not None:
                    self._emit_removed([key])
            # deleting inside a read snapshot is safe: the snapshot keeps its pages (and an
            # arena extent being read is held)
            self.tiers.delete([key])

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

"""The store: the prefix index, capacity and the hand-off wait, over a chain of tiers.

`Store` is what the gRPC servicer calls, from many worker threads at once. It
takes validated Python values and raises kvstore_server.errors; translating them
to gRPC status codes is the servicer's job.

Tiers (`tiers.chain.TierChain`, each a `tiers.base.Tier`): the memory tier
(`tiers.arena`, optional) in front of the persistent tier (`backend`: LMDB or
disk), and the fleet (optional, read through). The index holds every visible
block, whichever tier has it, and `capacity_bytes` bounds them all: the persistent
tier gets every block in the end (written behind from the arena).

Every way in ends in `_admit` (checks, room by eviction, the tier's write, the
index, the events): a gRPC Put writes the persistent tier; a commit records a
reservation's extent in the memory tier (reservations and pins are the memory
tier's); blocks put in parts (one tensor-parallel rank's KV heads:
kvstore_server.parts) are assembled in place in one arena extent and committed
there once whole; fleet hits are copied into the arena and committed like a
save. Loads pin blocks in the arena, promoting those only the persistent tier
holds; gRPC reads take each block from the first tier that has it. What a tier
evicts or a read finds corrupt comes back to the store, which drops it from the
index and announces it.

Locks: `_lock` (the memory tier's, shared) guards the index, the memory tier's
state and the counters, and is held only for in-memory work. `_commit_lock`
serialises everything that changes a tier's contents (puts, commits, promotions,
write-behind, evictions, drop-selects), so the index and the tiers change
together. Order: `_parts_lock`, then `_commit_lock`, then `_lock`.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from kvstore import arena_format as fmt
from kvstore import wire
from kvstore.blocks import (
    CHECKSUMS,
    STOP_EVICTED,
    STOP_LAYER_SET_DIFFERS,
    STOP_NO_ROOM,
    STOP_NONE,
    STOP_NOT_STORED,
    XXH3,
    BlockPrefix,
    PutResult,
)
from kvstore.kv_events_media import MEMORY, PERSISTENT
from kvstore_server import eviction
from kvstore_server.errors import (
    CapacityError,
    FleetUnavailable,
    InvalidChain,
    InvalidCommit,
    InvalidPart,
    LeaseNotFound,
    NoFleet,
    NoMemoryTier,
    NotFoundError,
    ShuttingDown,
    StoreError,
    WaitTimeout,
)
from kvstore_server.index import Entry, PrefixIndex
from kvstore_server.parts import ArenaRoom, PartAssembler, PartError, PartsFull, Whole, check_subset
from kvstore_server.tiers import (
    Backend,
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    StorageError,
    StorageFullError,
    StoredBlock,
    checksum,
)
from kvstore_server.tiers.arena import MemoryTier, NoRoom, Placed, Reservation, Run
from kvstore_server.tiers.chain import ReadResult, Started, TierChain, verified_prefix
from kvstore_server.tiers.fleet import FleetTier
from kvstore_server.tiers.writeback import FleetWriteBehind, WriteBehind

__all__ = [
    "CapacityError",
    "FleetUnavailable",
    "InvalidChain",
    "InvalidCommit",
    "InvalidPart",
    "LeaseNotFound",
    "NoFleet",
    "NoMemoryTier",
    "NotFoundError",
    "PinResult",
    "ReadResult",
    "Run",
    "ShuttingDown",
    "Store",
    "StoreError",
    "WaitTimeout",
]

log = logging.getLogger(__name__)

# Blocks fetched from the fleet per round trip: a few first (their size is not known
# yet), then about this many bytes' worth.
_FLEET_FIRST_BATCH = 4
_FLEET_FETCH_BYTES = 64 << 20


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


@dataclass(frozen=True, slots=True)
class PinResult:
    pin_id: int  # 0: nothing pinned (a miss)
    layers: tuple[LayerSpec, ...]
    runs: list[Run]
    checksums: bytes  # packed as kvstore.wire.pack_checksums does; block b, layer l at b * len(layers) + l
    num_blocks: int
    lease_seconds: float
    kinds: list[str] = field(default_factory=list)  # each block's checksum kind
    stop: str = STOP_NONE  # why num_blocks is short of the request (kvstore.blocks.STOP_*)
    ready_layers: int = -1  # leading layers in place for every block (-1: all of them)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    namespace: bytes
    block_hash: bytes
    entry: Entry
    num_children: int


@dataclass(frozen=True, slots=True)
class Admission:
    """Blocks on their way into the store, whichever way they came (Store._admit)."""

    what: str  # "put" or "commit", for messages
    namespace: bytes
    parent_hash: bytes  # the request's parent (of its first block)
    hashes: Sequence[bytes]  # in chain order
    parents: Sequence[bytes]  # each block's parent
    layers: tuple[LayerSpec, ...]
    tokens: Sequence[Sequence[int]] | None = None  # each block's token ids (KV events)
    skipped: int = 0  # blocks of the request found stored before (a reservation's)
    to_fleet: bool = True  # queue the new blocks for the fleet (not blocks that came from it)


Place = Callable[[list[int], list[BlockKey], set[BlockKey], float], "tuple[str, list[BlockKey]]"]
"""place(fresh, victims, protect, now): write blocks `fresh` (indices into the admission)
to their tier, created at `now`, and delete `victims` from every tier; returns the tier's
KV-events medium and the blocks it had to evict beyond the victims (already dropped)."""

Listener = Callable[
    [str, bytes, Sequence[bytes], Sequence[bytes], "Sequence[Sequence[int]] | None", "str | None"], None
]
"""Called as listener(kind, namespace, hashes, parents, tokens, tier) with kind "stored" or
"removed", under the store's lock, in commit order; `tokens`: each stored block's token
ids when its put gave them, else None; `tier`: for "stored", the tier the commit put the
blocks in (kvstore.kv_events_media MEMORY or PERSISTENT), None for "removed" (the blocks
left the store: every tier)."""


def _block_tokens(token_ids: Sequence[int], blocks: int, indices: Sequence[int]) -> list[list[int]] | None:
    """The tokens of blocks `indices` of a put's `blocks` (None: the put gave none)."""
    if not token_ids:
        return None
    per = len(token_ids) // blocks
    return [list(token_ids[i * per : (i + 1) * per]) for i in indices]


def _chained(parent_hash: bytes, hashes: Sequence[bytes]) -> list[bytes]:
    """Each block's parent in a chain of `hashes` that continues `parent_hash`."""
    return [hashes[i - 1] if i else parent_hash for i in range(len(hashes))]


def _selection(blocks: Sequence[StoredBlock | None], layers: Sequence[int]) -> tuple[int, ...] | None:
    """A read's layer selection, checked against the first block's layout (None: all)."""
    first = blocks[0] if blocks else None
    if not layers or first is None:
        return None
    try:
        return check_subset(layers, len(first.meta.layers))
    except PartError as exc:
        raise InvalidPart(str(exc)) from exc


def _log_short(what: str, namespace: bytes, hashes: Sequence[bytes], got: int, stop: str) -> None:
    """One DEBUG line for a read that returned fewer blocks than asked, and why (a miss is
    routine; a layer set that differs, a checksum failure or an eviction is logged where it
    is found, at WARNING or ERROR)."""
    if got < len(hashes) and log.isEnabledFor(logging.DEBUG):
        log.debug(
            "%s of %d blocks in namespace %r returned %d: %s at block %s",
            what, len(hashes), namespace, got, stop, hashes[got].hex(),
        )  # fmt: skip


def _runs(whole: Sequence[Whole]) -> list[list[Whole]]:
    """Blocks made whole, split into runs that are chains (each block's parent is the one
    before it) lying in one place (an arena extent, or the heap): each run is one put."""
    runs: list[list[Whole]] = []
    for block in whole:
        if runs and runs[-1][-1].block_hash == block.parent and runs[-1][-1].extent == block.extent:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _sum(results: Sequence[PutResult], skipped: int = 0) -> PutResult:
    return PutResult(
        sum(r.blocks_written for r in results),
        skipped + sum(r.blocks_skipped for r in results),
        sum(r.bytes_written for r in results),
        sum(r.blocks_evicted for r in results),
    )


class Store:
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

    def _from_fleet(self, namespace: bytes, hashes: Sequence[bytes]) -> None:
        """Bring the blocks after the local prefix of `hashes` that the fleet holds into the
        arena (or, without room there, the persistent tier), verified, like a save, so a
        read or pin serves them like any other. Nothing happens without a fleet, or when
        the local tiers have them all.

        In batches of about _FLEET_FETCH_BYTES: while one batch is stored, the next is
        fetched (on the fleet's fetch thread), so a request holds at most two batches
        from the fleet in memory, however long it is."""
        if self.fleet is None:
            return
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
        if n == len(hashes):
            return
        fetch = self.tiers.fetch_from_fleet
        keys = [(namespace, h) for h in hashes[n : n + _FLEET_FIRST_BATCH]]
        got = fetch(keys)
        while got.blocks:
            blocks = got.blocks
            n += len(blocks)
            ahead = None
            if len(blocks) == len(keys) and n < len(hashes):  # the fleet may hold more: fetch it meanwhile
                batch = max(1, _FLEET_FETCH_BYTES // blocks[0].meta.size)
                keys = [(namespace, h) for h in hashes[n : n + batch]]
                ahead = self._fleet_fetcher.submit(fetch, keys) if self._fleet_fetcher is not None else None
            try:
                result = self._fleet_hit(namespace, got)
            except (StoreError, StorageError) as exc:
                log.info("%d blocks found in the fleet are not stored here: %s", len(blocks), exc)
                if ahead is not None:
                    ahead.cancel()
                return
            with self._lock:
                self.fleet_promoted_blocks += result.blocks_written
            if ahead is None:
                return  # the fleet's part of the prefix ended in this batch
            got = ahead.result()

    def _fleet_hit(self, namespace: bytes, got: BlockPrefix) -> PutResult:
        """Blocks fetched from the fleet (verified as they were decoded) stored like a save:
        straight into the arena, so the load that asked for them finds them in memory and
        write-behind persists them off the request path; a put to the persistent tier when
        the arena has no room (or the blocks mix checksum kinds). Never back to the fleet."""
        blocks, width = got.blocks, len(got.layers)
        kinds = {b.meta.checksum_kind for b in blocks}
        if self.memory is not None and len(kinds) == 1:
            hashes = [b.meta.block_hash for b in blocks]
            parents = [b.meta.parent_hash for b in blocks]
            into = self._into_arena(
                namespace, got.layers, hashes, parents, lambda i, k: blocks[i].layers[k],
                [b.meta.checksums for b in blocks], kinds.pop(), to_fleet=False,
            )  # fmt: skip
            if into is not None:
                return into
        return self.put(
            namespace, blocks[0].meta.parent_hash, [b.meta.block_hash for b in blocks], got.layers,
            [[b.layers[k] for b in blocks] for k in range(width)],
            [[b.meta.checksums[k] for b in blocks] for k in range(width)], to_fleet=False,
        )  # fmt: skip

    # ---- the way in
    def put(
        self,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        data: Sequence[Sequence[memoryview]],
        checksums: Sequence[Sequence[int]] | None = None,
        joined: Sequence[memoryview] | None = None,
        *,
        to_fleet: bool = True,
        token_ids: Sequence[int] = (),
        subset: tuple[int, ...] | None = None,
    ) -> PutResult:
        """Store blocks in the persistent tier; data[layer][block] is one block's bytes of one layer.

        `checksums[layer][block]` may come precomputed (the servicer sums each
        chunk as it arrives, outside the commit lock); else they are computed here.
        `joined[block]`, when given, is that block's layers back to back (see BlockWrite).
        `to_fleet`: queue the blocks written for the fleet (not for blocks that came from it).
        `subset`: a partial put of these layers of `layers` (data[k] is layer subset[k]):
        its blocks are stored once parts have covered all their layers (see put_part).
        """
        if subset is not None:
            return self.put_part(
                namespace, parent_hash, hashes, layers, subset, lambda k, i: data[k][i], token_ids=token_ids,
                sums=None if checksums is None else lambda k, i: checksums[k][i],
            )  # fmt: skip
        spec = tuple(layers)
        parents = _chained(parent_hash, hashes)
        tokens = _block_tokens(token_ids, len(hashes), range(len(hashes)))

        def place(
            fresh: list[int], victims: list[BlockKey], protect: set[BlockKey], now: float
        ) -> tuple[str, list[BlockKey]]:
            writes = [
                BlockWrite(
                    BlockMeta(
                        namespace,
                        hashes[i],
                        parents[i],
                        spec,
                        tuple(
                            checksums[k][i] if checksums is not None else checksum(data[k][i])
                            for k in range(len(spec))
                        ),
                        now,
                    ),  # fmt: skip
                    [data[k][i] for k in range(len(spec))],
                    joined[i] if joined is not None else None,
                )
                for i in fresh
            ]
            return PERSISTENT, self._write(writes, victims, protect)

        admission = Admission("put", namespace, parent_hash, hashes, parents, spec, tokens, to_fleet=to_fleet)
        with self._commit_lock:
            return self._admit(admission, place)

    def _admit(self, blocks: Admission, place: Place) -> PutResult:
        """The one way into the store (caller holds the commit lock): refuse a closed
        store, a cycle, what exceeds the capacity; make room by evicting (chain tails
        first, never the blocks' own chain); `place` the blocks the index lacks in their
        tier; index and announce them."""
        ns, hashes, spec = blocks.namespace, blocks.hashes, blocks.layers
        block_bytes = sum(layer.nbytes for layer in spec)
        chain = {(ns, h) for h in hashes} | ({(ns, blocks.parent_hash)} if blocks.parent_hash else set())
        self._drop_evicted()
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            fresh = [i for i, h in enumerate(hashes) if self._index.get(ns, h) is None]
            if fresh and blocks.parent_hash:
                self._check_acyclic(ns, blocks.parent_hash, hashes)
            incoming = block_bytes * len(fresh)
            if incoming > self.capacity_bytes:
                raise CapacityError(f"{blocks.what} of {incoming} bytes exceeds the store's capacity "
                                    f"of {self.capacity_bytes} bytes")  # fmt: skip
            victims = eviction.make_room(self._index, incoming, self.capacity_bytes, chain)
            self._emit_removed(victims)
            self.counters.evictions += len(victims)
            fits = self._index.bytes_used + incoming <= self.capacity_bytes
        if not fits:
            self.tiers.delete(victims)
            raise CapacityError(f"not enough evictable data to make room for this {blocks.what}")
        now = time.time()
        tier, extra = place(fresh, victims, chain, now)
        with self._lock:
            for i in fresh:
                self._index.add(ns, hashes[i], blocks.parents[i], block_bytes, now, len(spec))
            self.counters.puts += 1
            self.counters.blocks_written += len(fresh)
            self.counters.bytes_written += incoming
            if fresh:
                if blocks.to_fleet and self._fleet_writer is not None:
                    self._fleet_writer.add([(ns, hashes[i]) for i in fresh], block_bytes)
                tokens = [blocks.tokens[i] for i in fresh] if blocks.tokens else None
                for listener in self._listeners:
                    listener("stored", ns, [hashes[i] for i in fresh], [blocks.parents[i] for i in fresh],
                             tokens, tier)  # fmt: skip
            self._changed.notify_all()
        return PutResult(
            len(fresh), blocks.skipped + len(hashes) - len(fresh), incoming, len(victims) + len(extra)
        )

    def _admit_in_place(
        self,
        blocks: Admission,
        extent: int,
        extent_blocks: int,
        positions: Sequence[int],
        checksums: Sequence[Sequence[int]],
        kind: str,
        res: Reservation | None = None,
    ) -> PutResult:
        """_admit blocks whose bytes lie in an arena extent the caller holds (a reservation's,
        or a part group's), block i at positions[i], into the memory tier (committed there:
        resident, queued for write-behind). Caller holds the commit lock."""
        memory = self._tier()

        def place(
            fresh: list[int], victims: list[BlockKey], _: set[BlockKey], now: float
        ) -> tuple[str, list[BlockKey]]:
            self.tiers.delete(victims)
            metas = [(positions[i], BlockMeta(blocks.namespace, blocks.hashes[i], blocks.parents[i],
                      blocks.layers, tuple(checksums[i]), now, kind), b"") for i in fresh]  # fmt: skip
            memory.commit_blocks(extent, extent_blocks, metas, now, res)
            return MEMORY, []

        return self._admit(blocks, place)

    def _into_arena(
        self,
        namespace: bytes,
        layers: tuple[LayerSpec, ...],
        hashes: list[bytes],
        parents: list[bytes],
        data: Callable[[int, int], memoryview | bytes],
        checksums: Sequence[Sequence[int]],
        kind: str,
        tokens: list[list[int]] | None = None,
        *,
        to_fleet: bool = True,
    ) -> PutResult | None:
        """Blocks whose bytes the daemon holds (`data(block, layer)`) copied into a fresh
        extent and committed like a reservation. None when the arena has no room for them
        (nothing changed)."""
        memory = self._tier()
        with self._commit_lock:
            try:
                res = memory.reserve(prefix=b"", namespace=namespace, parent_hash=parents[0],
                                     hashes=hashes, parents=parents, layers=layers, token_ids=tokens,
                                     lease=False)  # fmt: skip
            except NoRoom as exc:
                log.debug("blocks go to the persistent tier: %s", exc)
                return None
            finally:
                self._drop_evicted()
            with memory.committing(res):
                memory.fill(res, data)
                admission = Admission("commit", namespace, parents[0], hashes, parents, layers, tokens,
                                      to_fleet=to_fleet)  # fmt: skip
                result = self._admit_in_place(admission, res.extent, len(hashes), range(len(hashes)),
                                              checksums, kind, res)  # fmt: skip
        if self._writer is not None:
            self._writer.wake()
        return result

    def put_part(
        self,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        subset: tuple[int, ...],
        data: Callable[[int, int], memoryview],
        *,
        token_ids: Sequence[int] = (),
        parents: Sequence[bytes] | None = None,
        sums: Callable[[int, int], int] | None = None,
    ) -> PutResult:
        """Put layers `subset` of blocks `hashes` (`data(k, i)`: block i's layer subset[k];
        `sums(k, i)`: its xxh3, when the caller has it). `parents`: each block's parent,
        where they are not a chain from `parent_hash`.
        Blocks already stored are skipped; the others wait in `parts` (in place in the
        arena when it has room) until puts have covered all their layers, then are stored
        (the result counts those this part completed).
        Raises InvalidPart, or CapacityError when the parts held would exceed the bound."""
        if parents is None:
            parents = _chained(parent_hash, hashes)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            fresh = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
        tokens = _block_tokens(token_ids, len(hashes), fresh)
        with self._parts_lock:
            try:
                whole = self.parts.add(
                    namespace, hashes, parents, tuple(layers), subset, data, indices=fresh, tokens=tokens,
                    sums=sums,
                )  # fmt: skip
            except PartError as exc:
                raise InvalidPart(str(exc)) from exc
            except PartsFull as exc:
                raise CapacityError(str(exc)) from exc
        results = [self._store_whole(namespace, run) for run in _runs(whole)]
        return _sum(results, len(hashes) - len(fresh))

    def _store_whole(self, namespace: bytes, run: list[Whole]) -> PutResult:
        """Store a chain of blocks that parts made whole: committed where they lie when that
        is the arena, else copied into the arena when it has room (so the next Pin finds
        them there; write-behind persists them as any commit's), else put to the
        persistent tier."""
        first = run[0]
        hashes, parents = [w.block_hash for w in run], [w.parent for w in run]
        tokens = [w.tokens or [] for w in run] if all(w.tokens for w in run) else None
        sums = [w.checksums for w in run]
        if first.extent is not None:
            admission = Admission("commit", namespace, first.parent, hashes, parents, first.layers, tokens)
            try:
                with self._commit_lock:
                    return self._admit_in_place(admission, first.extent, first.extent_blocks,
                                                [w.position for w in run], sums, XXH3)  # fmt: skip
            finally:
                for _ in run:
                    self._let_go(first.extent)
                if self._writer is not None:
                    self._writer.wake()
        if self.memory is not None:
            into = self._into_arena(namespace, first.layers, hashes, parents, lambda i, k: run[i].layer(k),
                                    sums, XXH3, tokens)  # fmt: skip
            if into is not None:
                return into
        width = len(first.layers)
        return self.put(namespace, first.parent, hashes, first.layers,
                        [[w.layer(k) for w in run] for k in range(width)],
                        [[w.checksums[k] for w in run] for k in range(width)],
                        token_ids=[t for block in tokens for t in block] if tokens else ())  # fmt: skip

    def _hold_parts(self, layers: tuple[LayerSpec, ...], blocks: int) -> int | None:
        """An arena extent for `blocks` new blocks put in parts, held once per block (parts
        ArenaRoom); None when the arena has no room: they wait in the heap."""
        memory = self._tier()
        with self._commit_lock:
            try:
                return memory.hold_extent(fmt.extent_bytes(sum(s.nbytes for s in layers), blocks), blocks,
                                          time.time(), holds=blocks)  # fmt: skip
            except NoRoom as exc:
                log.debug("parts wait in the heap: %s", exc)
                return None
            finally:
                self._drop_evicted()

    def _let_go(self, extent: int) -> None:
        with self._lock:
            self._tier().unpin_extents([extent])

    def _check_acyclic(self, namespace: bytes, parent_hash: bytes, hashes: Sequence[bytes]) -> None:
        # Within a put the chain is linear (hashes are unique); a cycle needs an
        # ancestor of the parent to be one of the new blocks.
        new = set(hashes)
        seen: set[bytes] = set()
        ancestor: bytes = parent_hash
        while ancestor and ancestor not in seen:
            if ancestor in new:
                raise InvalidChain("the put's blocks are ancestors of its parent: parents would form a cycle")
            seen.add(ancestor)
            entry = self._index.get(namespace, ancestor)
            if entry is None:
                return
            ancestor = entry.parent

    def _write(
        self, writes: list[BlockWrite], victims: list[BlockKey], protect: set[BlockKey]
    ) -> list[BlockKey]:
        """Write to the persistent tier and delete `victims` from every tier; return what
        else had to be evicted.

        When the backend is full below the byte budget (the filesystem, or LMDB's
        map), eviction gets one chance: as many more bytes as the put brings (and
        one block), and only if that much is evictable. If the write still fails,
        eviction evidently does not help (another process holds the space, a reader
        pins LMDB's pages): later full writes fail at once, without evicting, until
        a write succeeds. So a full disk never empties the store for puts that fail.
        """
        if self.memory is not None:
            self.memory.delete(victims)
        try:
            self.backend.write(writes, victims)
            self._eviction_helps = True
            return []
        except StorageFullError as exc:
            full = exc
        except StorageError:
            self.tiers.delete(victims)
            raise
        if not writes:  # only the victims' deletion failed: nothing needs room
            self.tiers.delete(victims)
            return []
        incoming = sum(w.meta.size for w in writes)
        with self._lock:
            if not self._eviction_helps:
                reason = "the last eviction for room did not help; none is tried until a put succeeds"
            elif eviction.evictable_bytes(self._index, protect) < incoming:
                reason = f"evicting everything evictable would not free the {incoming} bytes it needs"
            else:
                reason = ""
                # NOTE: one block more than the put brings: LMDB stores a block in
                # contiguous pages, and the put's own small allocations split one
                # freed run; the disk backend just frees a little more than it needs.
                need = incoming + max(w.meta.size for w in writes)
                extra = eviction.down_to(self._index, self._index.bytes_used - need, protect)
                self._emit_removed(extra)
                self.counters.evictions += len(extra)
        if reason:
            self.tiers.delete(victims)
            raise CapacityError(f"no room for this put ({full}); {reason}") from full
        log.warning("%s; evicted %d more blocks to make room for a put", full, len(extra))
        try:
            self.backend.write(writes, victims + extra)
            if self.memory is not None:
                self.memory.delete(extra)
            return extra
        except StorageFullError as exc:
            self._eviction_helps = False
            self.tiers.delete(victims + extra)
            log.warning("no room after evicting %d blocks: full puts fail without eviction now", len(extra))
            raise CapacityError(f"no room for this put after evicting {len(extra)} blocks: {exc}") from exc
        except StorageError:
            self.tiers.delete(victims + extra)
            raise

    # ---- reads
    @contextmanager
    def read(
        self, namespace: bytes, hashes: Sequence[bytes], layers: Sequence[int] = ()
    ) -> Iterator[ReadResult]:
        """The stored prefix of `hashes`, verified; a bad or vanished block ends it.
        `layers`: the read uses only these (verified, counted); empty: all."""
        self._from_fleet(namespace, hashes)
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
            self._index.touch(namespace, hashes[:n])
        keys = [(namespace, h) for h in hashes[:n]]
        with self.tiers.read(keys) as blocks:
            result = self._verified_prefix(blocks, keys, selected=_selection(blocks, layers))
            if result.stop == STOP_NONE and n < len(hashes):
                result = dataclasses.replace(result, stop=STOP_NOT_STORED)
            _log_short("read", namespace, hashes, result.num_blocks, result.stop)
            yield result
        self._count_read(result)

    @contextmanager
    def take(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        wait_seconds: float,
        is_active: Callable[[], bool],
        layers: Sequence[int] = (),
    ) -> Iterator[ReadResult]:
        """DropSelect: wait until the whole prefix is stored, then read and remove it.
        `layers`: take only these; a block is removed once takes have covered all of its
        layers (each tensor-parallel rank takes its own heads)."""
        deadline = time.monotonic() + wait_seconds
        keys = [(namespace, h) for h in hashes]
        with ExitStack() as stack:
            while True:
                self._wait_for_prefix(namespace, hashes, deadline, wait_seconds, is_active)
                with self._commit_lock:
                    with self._lock:
                        if self._index.prefix_len(namespace, hashes) != len(hashes):
                            continue  # another DropSelect or an eviction was first: wait again
                    blocks = stack.enter_context(self.tiers.read(keys))
                    selected = _selection(blocks, layers)
                    with self._lock:
                        gone = self._taken_whole(keys, blocks, selected)
                        for key in reversed(gone):  # tail first: nothing left below to walk
                            self._index.remove(*key)
                        self._emit_removed(gone)
                    # The read snapshot keeps the bytes readable after this delete.
                    self.tiers.delete(gone)
                break
            result = self._verified_prefix(blocks, keys, remove_bad=False, selected=selected)
            _log_short("take", namespace, hashes, result.num_blocks, result.stop)
            yield result
        self._count_read(result)

    def _taken_whole(
        self, keys: list[BlockKey], blocks: list[StoredBlock | None], selected: tuple[int, ...] | None
    ) -> list[BlockKey]:
        """Of a DropSelect's blocks, those it takes the last layers of (all of them when it
        takes every layer); the others remember which layers are taken (caller holds the lock)."""
        if selected is None:
            return keys
        gone = []
        for key, block in zip(keys, blocks, strict=True):
            taken = self._taken.setdefault(key, set())
            taken.update(selected)
            if block is None or len(taken) >= len(block.meta.layers):
                gone.append(key)
        return gone

    def _wait_for_prefix(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        deadline: float,
        wait_seconds: float,
        is_active: Callable[[], bool],
    ) -> None:
        while True:
            with self._changed:
                if self._draining:
                    raise ShuttingDown("the store is shutting down")
                if self._index.prefix_len(namespace, hashes) == len(hashes):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"prefix of {len(hashes)} blocks not stored within {wait_seconds:g}s")
                # Bounded waits: notice a cancelled caller within half a second.
                self._changed.wait(min(remaining, 0.5))
            if not is_active():
                raise WaitTimeout("caller went away")

    def _verified_prefix(
        self,
        blocks: list[StoredBlock | None],
        keys: list[BlockKey],
        remove_bad: bool = True,
        selected: tuple[int, ...] | None = None,
    ) -> ReadResult:
        result, bad = verified_prefix(blocks, keys, selected)
        if bad is not None:
            with self._lock:
                self.counters.checksum_failures += 1
            if remove_bad:
                self._remove_corrupt(bad)
        elif result.stop == STOP_EVICTED and remove_bad:
            # the index has it, no tier could read it (a file cut short, a failing disk):
            # it leaves the store, so a lookup stops counting it
            missing = keys[result.num_blocks]
            with self._lock:
                unreadable = self._index.get(*missing) is not None
            if unreadable:
                log.warning("block %s cannot be read from any tier: removed", missing[1].hex())
                self._remove_corrupt(missing)
        return result

    def _remove_corrupt(self, key: BlockKey) -> None:
        with self._commit_lock:
            with self._lock:
                if self._index.remove(*key) is not None:
                    self._emit_removed([key])
            # deleting inside a read snapshot is safe: the snapshot keeps its pages (and an
            # arena extent being read is held)
            self.tiers.delete([key])

    def _count_read(self, result: ReadResult) -> None:
        with self._lock:
            used = sum(result.layers[k].nbytes for k in result.used) if result.layers else 0
            self.counters.bytes_read += used * result.num_blocks

    # ---- the memory tier's leases: reserve -> the client writes -> commit or abort
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

    def reserve(
        self,
        prefix: bytes,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        token_ids: Sequence[int] = (),
        subset: tuple[int, ...] | None = None,
    ) -> Reservation | None:
        """Reserve an extent for the blocks of `hashes` not stored yet (None: all are).
        The caller writes them, layer-major, then commits within the lease. `subset`: a
        partial save of these layers of `layers` (the extent holds only them; see put_part)."""
        memory = self._tier()
        full = tuple(layers)
        carried = full if subset is None else tuple(full[k] for k in subset)
        block_bytes = sum(layer.nbytes for layer in carried)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            memory.expire(time.monotonic())
            todo = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
        if not todo:
            return None
        if block_bytes * len(todo) > self.capacity_bytes:
            raise CapacityError(f"save of {block_bytes * len(todo)} bytes exceeds the store's capacity of "
                                f"{self.capacity_bytes} bytes")  # fmt: skip
        nbytes = fmt.extent_bytes(block_bytes, len(todo))
        if nbytes > memory.allocator.total:
            raise CapacityError(
                f"a save of {nbytes} bytes does not fit the memory tier ({memory.allocator.total} bytes)"
            )
        parents = _chained(parent_hash, hashes)
        with self._commit_lock:
            try:
                return memory.reserve(
                    prefix=prefix, namespace=namespace, parent_hash=parent_hash,
                    hashes=[hashes[i] for i in todo], parents=[parents[i] for i in todo], layers=carried,
                    request_index=todo, skipped=len(hashes) - len(todo),
                    token_ids=_block_tokens(token_ids, len(hashes), todo), subset=subset, full_layers=full,
                )  # fmt: skip
            except NoRoom as exc:
                raise CapacityError(str(exc)) from exc
            finally:
                self._drop_evicted()

    def commit(
        self, prefix: bytes, reservation_id: int, checksums: Sequence[int], kind: str = XXH3
    ) -> PutResult:
        """Make a reservation's blocks visible, all or nothing; `checksums` block-major, of
        `kind` (kvstore.blocks.CHECKSUMS). A partial save's layers go to its blocks' parts."""
        memory = self._tier()
        if kind not in CHECKSUMS:
            raise InvalidCommit(f"unknown checksum kind {kind!r}; known: {', '.join(CHECKSUMS)}")
        with self._lock:
            res = memory.reservation(reservation_id, prefix)
            if res is None:
                raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")
            n, width = len(res.hashes), len(res.layers)
            if len(checksums) != n * width:
                raise InvalidCommit(f"a commit of {n} blocks of {width} layers needs {n * width} checksums, "
                                    f"not {len(checksums)}")  # fmt: skip
            memory.take_reservation(reservation_id, prefix)
        with memory.committing(res):
            if res.subset is not None:
                result = self._commit_part(memory, res, checksums, kind)
            else:
                sums = [checksums[i * width : (i + 1) * width] for i in range(n)]
                admission = Admission("commit", res.namespace, res.parent_hash, res.hashes, res.parents,
                                      res.layers, res.token_ids, res.skipped)  # fmt: skip
                with self._commit_lock:
                    result = self._admit_in_place(admission, res.extent, n, range(n), sums, kind, res)
        with self._lock:
            memory.counters.commits += 1
        if self._writer is not None:
            self._writer.wake()
        return result

    def _commit_part(
        self, memory: MemoryTier, res: Reservation, checksums: Sequence[int], kind: str
    ) -> PutResult:
        """A partial save's reservation: its layers are copied into their blocks' one extent
        (parts, in place), and the blocks they complete are committed there."""
        n, width = len(res.hashes), len(res.layers)
        view = memory.views(res.extent, res.layers, n)
        if kind == XXH3:  # what the client summed is what the arena holds (a torn write fails)
            for i in range(n):
                for k in range(width):
                    if checksum(view(i, k)) != checksums[i * width + k]:
                        raise InvalidCommit(
                            f"block {res.hashes[i].hex()} layer {res.layers[k].name!r}: the bytes "
                            "in the arena do not match the commit's checksum"
                        )
        tokens = [t for block in res.token_ids for t in block] if res.token_ids else ()
        if res.subset is None:
            raise ValueError("not a partial save's reservation")
        result = self.put_part(
            res.namespace, res.parent_hash, res.hashes, res.full_layers, res.subset, lambda k, i: view(i, k),
            token_ids=tokens, parents=res.parents,
            sums=(lambda k, i: checksums[i * width + k]) if kind == XXH3 else None,  # verified above
        )  # fmt: skip
        return _sum([result], res.skipped)

    def abort(self, prefix: bytes, reservation_id: int) -> None:
        if not self._tier().abort(reservation_id, prefix):
            raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")

    # ---- pins: pin -> the client reads -> release
    def pin(self, prefix: bytes, namespace: bytes, hashes: Sequence[bytes]) -> PinResult:
        """Pin the stored prefix of `hashes` in the arena (promoting blocks only the
        persistent tier holds, and waiting for them) for the lease; a miss pins nothing
        (pin_id 0)."""
        memory = self._tier()
        keys, cold, now, stop = self._pin_prefix(memory, namespace, hashes)
        started = self._started(self.tiers.promote(keys, now)) if cold else Started()
        return self._pinned(memory, prefix, namespace, hashes, keys, cold, now, stop, started.left_out, {})

    def pin_stream(
        self, prefix: bytes, namespace: bytes, hashes: Sequence[bytes]
    ) -> Generator[PinResult | int | str, None, None]:
        """Pin without waiting for the promotion: yields the PinResult at once (its
        ready_layers: -1 when every block is in place; else 0), then the count of leading
        layers in place for every pinned block as the persistent tier's reads land (the
        last is the layer count), or, when a read failed, its STOP_* reason last (the rest
        never comes). The promotion is finished (its blocks placed)
        when the iteration ends or is closed."""
        memory = self._tier()
        keys, cold, now, stop = self._pin_prefix(memory, namespace, hashes)
        started = self._started(self.tiers.promote_start(keys, now)) if cold else Started()
        promotion = started.promotion
        finished = False
        try:
            pending = {p.meta.key: p for p in promotion.placed} if promotion is not None else {}
            result = self._pinned(memory, prefix, namespace, hashes, keys, cold, now, stop, started.left_out,
                                  pending)  # fmt: skip
            if promotion is None or not any(k in pending for k in keys[: result.num_blocks]):
                yield result  # every pinned block is in place
                return
            yield dataclasses.replace(result, ready_layers=0)
            width = len(result.layers)
            for ready in promotion.progress():
                if ready >= width:
                    # NOTE: placed before the client hears that the last layers are in: its
                    # load may report a corrupt block at once, and Release verifies what is
                    # resident
                    finished = True
                    promotion.finish()
                yield ready
            if promotion.failed:
                yield STOP_EVICTED
        finally:
            if promotion is not None and not finished:
                promotion.finish()

    def _started(self, started: Started) -> Started:
        """Drop what a promotion's room took out of the store."""
        self._drop_evicted()
        return started

    def _pin_prefix(
        self, memory: MemoryTier, namespace: bytes, hashes: Sequence[bytes]
    ) -> tuple[list[BlockKey], list[BlockKey], float, str]:
        """The stored prefix's keys, those not in memory, the time, and the stop reason so far."""
        self._from_fleet(namespace, hashes)
        now = time.time()
        with self._lock:
            memory.expire(time.monotonic())
            n = self._index.prefix_len(namespace, hashes)
            self._index.touch(namespace, hashes[:n], now)
            keys = [(namespace, h) for h in hashes[:n]]
            cold = [k for k in keys if k not in memory.resident]
        return keys, cold, now, STOP_NOT_STORED if n < len(hashes) else STOP_NONE

    def _pinned(
        self,
        memory: MemoryTier,
        prefix: bytes,
        namespace: bytes,
        hashes: Sequence[bytes],
        keys: list[BlockKey],
        cold: list[BlockKey],
        now: float,
        stop: str,
        left_out: tuple[BlockKey, str] | None,
        pending: dict[BlockKey, Placed],
    ) -> PinResult:
        """Pin the leading `keys` that are still stored and resident (or `pending`: a
        promotion's, still being read) with one layer set, for the lease."""
        with self._lock:
            stored = 0
            while stored < len(keys) and self._index.get(*keys[stored]) is not None:
                stored += 1
            pinned = memory.pin(prefix, namespace, keys[:stored], pending, now)
            got = pinned.num_blocks
            if got < len(keys):
                key = keys[got]
                if pinned.layout_differs:
                    stop = STOP_LAYER_SET_DIFFERS
                elif left_out is not None and left_out[0] == key:  # the promotion left it out
                    stop = left_out[1]
                else:  # gone since the prefix was found, or not brought into memory
                    stop = STOP_EVICTED if self._index.get(*key) is None else STOP_NO_ROOM
            if got:
                promoted = len(set(cold).intersection(keys[:got]))
                memory.counters.memory_hit_blocks += got - promoted
                memory.counters.persistent_hit_blocks += promoted
                self.counters.bytes_read += got * sum(layer.nbytes for layer in pinned.layers)
        _log_short("pin", namespace, hashes, got, stop)
        return PinResult(pinned.pin_id, pinned.layers, pinned.runs, pinned.sums, got, memory.lease_seconds,
                         pinned.kinds, stop)  # fmt: skip

    def release(self, prefix: bytes, pin_id: int, corrupt: Sequence[bytes] = ()) -> bool:
        """End a pin; `corrupt`: blocks the client found failing their checksum (verified
        here again, and removed if so). False: the pin had already expired."""
        memory = self._tier()
        namespace = memory.pin_owner(pin_id, prefix)
        if namespace is not None and corrupt:
            for key in memory.corrupt([(namespace, h) for h in corrupt]):
                log.error("block %s fails its checksum in the memory tier (reported by a client): removed",
                          key[1].hex())  # fmt: skip
                with self._lock:
                    self.counters.checksum_failures += 1
                self._remove_corrupt(key)
        with self._lock:
            memory.release_pin(pin_id, prefix)
        return namespace is not None

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
        self, namespace: bytes | None, limit: int, after: BlockKey | None, prefix: bytes = b""
    ) -> tuple[list[BlockInfo], BlockKey | None]:
        """Blocks in (namespace, hash) order, after `after`; at most `limit`; and the key
        to continue after (None: that was the last page).

        `namespace` None: every namespace that starts with `prefix`. The lock is
        held only to copy one namespace's hashes at a time (C speed) and to read
        the page's entries: ordering a large store's keys (seconds for millions)
        never stalls lookups and puts. A block removed meanwhile is left out.
        """
        with self._lock:
            spaces = [namespace] if namespace is not None else self._index.namespaces()
        keys: list[BlockKey] = []
        for ns in sorted(s for s in spaces if s.startswith(prefix) and (after is None or s >= after[0])):
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

    def namespaces(self, prefix: bytes = b"") -> list[bytes]:
        """The namespaces that hold blocks and start with `prefix`, sorted."""
        with self._lock:
            spaces = self._index.namespaces()
        return sorted(ns for ns in spaces if ns.startswith(prefix))

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

    # ---- events and lifecycle
    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

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
        with self._commit_lock:
            with self._lock:
                self._closed = True
            self.tiers.close()

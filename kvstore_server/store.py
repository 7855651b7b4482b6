"""The store: the prefix index, capacity and the hand-off wait, over a chain of tiers.

`Store` is what the gRPC servicer calls, from many worker threads at once. It
takes validated Python values and raises the errors below; translating them to
gRPC status codes is the servicer's job.

Tiers (`tiers.chain.TierChain`): the memory tier (`tiers.arena`, optional) in
front of the persistent tier (`backend`: LMDB or disk). The index holds every
visible block, whichever tier has it, and `capacity_bytes` bounds them all: the
persistent tier gets every block in the end (written behind from the arena).
Saves through the arena (reserve -> the client writes -> commit) land in the
memory tier and are written behind; gRPC Puts go to the persistent tier. A
partial save or put (one tensor-parallel rank's KV heads: kvstore_server.parts)
waits in memory for the block's other parts; the block made whole goes to the
memory tier like a commit's (a Put's way when the arena has no room). Loads
pin blocks in the arena, promoting those only the persistent tier holds; gRPC
reads take each block from the first tier that has it. The chain moves blocks
between tiers; the store decides what is stored (the index, capacity,
eviction, the chains' shape, reservations and pins, events).

Locks: `_lock` guards the index, the memory tier's state and the counters, and
is held only for in-memory work. `_commit_lock` serialises everything that
changes a tier's contents (puts, commits, promotions, write-behind, evictions,
drop-selects), so the index and the tiers change together. The chain shares both.
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
from kvstore_server.index import Entry, PrefixIndex
from kvstore_server.parts import PartAssembler, PartError, PartsFull, Whole, check_subset
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
from kvstore_server.tiers.arena import MemoryTier, Pin, Placed, Reservation
from kvstore_server.tiers.chain import NoRoom, Promotion, ReadResult, TierChain, verified_prefix
from kvstore_server.tiers.fleet import FleetTier
from kvstore_server.tiers.writeback import FleetWriteBehind, WriteBehind

__all__ = ["ReadResult", "Store"]

log = logging.getLogger(__name__)

# Blocks fetched from the fleet per round trip: a few first (their size is not known
# yet), then about this many bytes' worth.
_FLEET_FIRST_BATCH = 4
_FLEET_FETCH_BYTES = 64 << 20


class StoreError(Exception):
    """Base of the errors the store raises to the servicer."""


class InvalidChain(StoreError):
    """The put would link blocks into a cycle (parents are what clients claim)."""


class CapacityError(StoreError):
    """The request cannot fit in the store's byte budget."""


class NotFoundError(StoreError):
    """The named block is not stored."""


class WaitTimeout(StoreError):
    """DropSelect's wait ran out before the whole prefix was stored."""


class ShuttingDown(StoreError):
    """The store is closing; the call should be retried elsewhere or later."""


class LeaseNotFound(StoreError):
    """No reservation or pin with that id (never made, expired, or already ended)."""


class InvalidCommit(StoreError):
    """A commit that does not match its reservation (checksum count)."""


class NoMemoryTier(StoreError):
    """The daemon runs without a memory tier."""


class NoFleet(StoreError):
    """The daemon runs without a fleet tier."""


class InvalidPart(StoreError):
    """A partial put or read that does not fit the block (the caller's error)."""


class FleetUnavailable(StoreError):
    """The fleet did not answer a call that needs it (not a lookup or a read: those miss)."""


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


def _block_tokens(token_ids: Sequence[int], blocks: int, indices: Sequence[int]) -> list[list[int]] | None:
    """The tokens of blocks `indices` of a put's `blocks` (None: the put gave none)."""
    if not token_ids:
        return None
    per = len(token_ids) // blocks
    return [list(token_ids[i * per : (i + 1) * per]) for i in indices]


def _selection(blocks: Sequence[StoredBlock | None], layers: Sequence[int]) -> tuple[int, ...] | None:
    """A read's layer selection, checked against the first block's layout (None: all)."""
    first = blocks[0] if blocks else None
    if not layers or first is None:
        return None
    try:
        return check_subset(layers, len(first.meta.layers))
    except PartError as exc:
        raise InvalidPart(str(exc)) from exc


def _run_tokens(run: Sequence[Whole]) -> list[int]:
    """A run's token ids, block after block; none unless every block's parts gave them."""
    tokens: list[int] = []
    for block in run:
        if not block.tokens:
            return []
        tokens.extend(block.tokens)
    return tokens


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
    before it): each run is one put."""
    runs: list[list[Whole]] = []
    for block in whole:
        if runs and runs[-1][-1].block_hash == block.parent:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


@dataclass(frozen=True, slots=True)
class Run:
    """`count` blocks of a pinned prefix, at positions first.. of the extent at `extent`."""

    extent: int
    extent_blocks: int
    first: int
    count: int


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


Listener = Callable[
    [str, bytes, Sequence[bytes], Sequence[bytes], "Sequence[Sequence[int]] | None", "str | None"], None
]
"""Called as listener(kind, namespace, hashes, parents, tokens, tier) with kind "stored" or
"removed", under the store's lock, in commit order; `tokens`: each stored block's token
ids when its put gave them, else None; `tier`: for "stored", the tier the commit put the
blocks in (kvstore.kv_events_media MEMORY or PERSISTENT), None for "removed" (the blocks
left the store: every tier)."""


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
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()
        self._draining = False  # DropSelect waiters give up
        self._closed = False  # no more writes
        self._listeners: list[Listener] = []
        self._eviction_helps = True  # see _write
        # blocks put in parts (tensor-parallel ranks' KV heads), and the layers of each
        # block that partial DropSelects took (removed once all are taken)
        self.parts = PartAssembler(partial_bytes, partial_timeout_s)
        self._parts_lock = threading.Lock()
        self._taken: dict[BlockKey, set[int]] = {}
        self.tiers = TierChain(
            backend, memory, fleet, lock=self._lock, commit_lock=self._commit_lock, owner=self
        )
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
            self._load_index(backend)
        finally:
            if collecting:
                gc.enable()
        if memory is not None:
            self._recover_memory(memory)
        self._index.sort_leaves()
        self._writer = WriteBehind(self.tiers) if memory is not None else None
        self._after_load(backend)

    def _load_index(self, backend: Backend) -> None:
        for meta in backend.scan():
            self._index.add(
                meta.namespace,
                meta.block_hash,
                meta.parent_hash,
                meta.size,
                meta.created_at,
                len(meta.layers),
            )

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
        memory = self.memory
        out = bytearray(n)
        with self._lock:
            for i, block_hash in enumerate(hashes[:n]):
                key = (namespace, block_hash)
                if memory is not None and key in memory.resident:
                    out[i] = wire.TIER_MEMORY
                elif self._index.get(namespace, block_hash) is not None:
                    out[i] = wire.TIER_PERSISTENT
                else:
                    out[i] = wire.TIER_FLEET
        return bytes(out)

    def _from_fleet(self, namespace: bytes, hashes: Sequence[bytes]) -> None:
        """Bring the blocks after the local prefix of `hashes` that the fleet holds into the
        persistent tier (verified, like a put), so a read or pin serves them like any
        other. Nothing happens without a fleet, or when the local tiers have them all.

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
            blocks, width = got.blocks, len(got.layers)
            n += len(blocks)
            ahead = None
            if len(blocks) == len(keys) and n < len(hashes):  # the fleet may hold more: fetch it meanwhile
                batch = max(1, _FLEET_FETCH_BYTES // blocks[0].meta.size)
                keys = [(namespace, h) for h in hashes[n : n + batch]]
                ahead = self._fleet_fetcher.submit(fetch, keys) if self._fleet_fetcher is not None else None
            try:
                result = self._fleet_into_arena(namespace, got) if self.memory is not None else None
                if result is None:  # no arena, or no room in it: a put to the persistent tier
                    result = self.put(
                        namespace,
                        blocks[0].meta.parent_hash,
                        [b.meta.block_hash for b in blocks],
                        got.layers,
                        [[b.layers[k] for b in blocks] for k in range(width)],
                        [[b.meta.checksums[k] for b in blocks] for k in range(width)],
                        to_fleet=False,
                    )
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

    def _fleet_into_arena(self, namespace: bytes, got: BlockPrefix) -> PutResult | None:
        """Blocks fetched from the fleet (verified as they were decoded) straight into the
        arena, committed like a save: the load that asked for them finds them in memory,
        and write-behind persists them afterwards, off the request path. None when the arena
        has no room (or the blocks mix checksum kinds): the caller puts them instead."""
        memory = self.memory
        blocks = got.blocks
        kinds = {b.meta.checksum_kind for b in blocks}
        if memory is None or len(kinds) != 1:
            return None
        result = self._into_arena(
            memory, namespace, got.layers, [b.meta.block_hash for b in blocks],
            [b.meta.parent_hash for b in blocks], lambda i, k: blocks[i].layers[k],
            [c for b in blocks for c in b.meta.checksums], kinds.pop(), to_fleet=False,
        )  # fmt: skip
        if result is not None and self._writer is not None:
            self._writer.wake()
        return result

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
        """Store blocks; data[layer][block] is one block's bytes of one layer.

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
        block_bytes = sum(layer.nbytes for layer in layers)
        chain = {(namespace, h) for h in hashes}
        if parent_hash:
            chain.add((namespace, parent_hash))
        with self._commit_lock:
            with self._lock:
                if self._closed:
                    raise ShuttingDown("the store is closed")
                fresh = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
                if fresh and parent_hash:
                    self._check_acyclic(namespace, parent_hash, hashes)
                incoming = block_bytes * len(fresh)
                if incoming > self.capacity_bytes:
                    raise CapacityError(
                        f"put of {incoming} bytes exceeds the store's capacity of {self.capacity_bytes} bytes"
                    )
                victims = eviction.make_room(self._index, incoming, self.capacity_bytes, chain)
                self._emit_removed(victims)
                self.counters.evictions += len(victims)
                fits = self._index.bytes_used + incoming <= self.capacity_bytes
            if not fits:
                self.tiers.delete(victims)
                raise CapacityError("not enough evictable data to make room for this put")
            now = time.time()
            writes = [
                BlockWrite(
                    BlockMeta(
                        namespace=namespace,
                        block_hash=hashes[i],
                        parent_hash=hashes[i - 1] if i else parent_hash,
                        layers=tuple(layers),
                        checksums=tuple(
                            checksums[k][i] if checksums is not None else checksum(data[k][i])
                            for k in range(len(layers))
                        ),
                        created_at=now,
                    ),
                    [data[k][i] for k in range(len(layers))],
                    joined[i] if joined is not None else None,
                )
                for i in fresh
            ]
            extra = self._write(writes, victims, chain)
            with self._lock:
                for w in writes:
                    m = w.meta
                    self._index.add(namespace, m.block_hash, m.parent_hash, block_bytes, now, len(layers))
                self.counters.puts += 1
                self.counters.blocks_written += len(writes)
                self.counters.bytes_written += incoming
                if writes and to_fleet and self._fleet_writer is not None:
                    self._fleet_writer.add([w.meta.key for w in writes], block_bytes)
                if writes:
                    tokens = _block_tokens(token_ids, len(hashes), fresh)
                    for listener in self._listeners:
                        listener(
                            "stored",
                            namespace,
                            [w.meta.block_hash for w in writes],
                            [w.meta.parent_hash for w in writes],
                            tokens,
                            PERSISTENT,
                        )
                self._changed.notify_all()
        return PutResult(len(writes), len(hashes) - len(writes), incoming, len(victims) + len(extra))

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
        Blocks already stored are skipped; the others wait in `parts` until puts have
        covered all their layers, then are stored (_store_whole: in the arena when it has
        room, else as a put's blocks; the result counts those this part completed).
        Raises InvalidPart, or CapacityError when the parts held would exceed the bound."""
        if parents is None:
            parents = [hashes[i - 1] if i else parent_hash for i in range(len(hashes))]
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
        written = skipped = nbytes = evicted = 0
        for run in _runs(whole):
            result = self._store_whole(namespace, run)
            written += result.blocks_written
            skipped += result.blocks_skipped
            nbytes += result.bytes_written
            evicted += result.blocks_evicted
        return PutResult(written, len(hashes) - len(fresh) + skipped, nbytes, evicted)

    def _store_whole(self, namespace: bytes, run: list[Whole]) -> PutResult:
        """Store a chain of blocks that parts made whole: in the arena when there is one and
        it has room (so the next Pin finds them there; write-behind persists them as any
        commit's), else as a put to the persistent tier."""
        layers = run[0].layers
        memory = self.memory
        if memory is not None:
            placed = self._whole_into_arena(memory, namespace, run)
            if placed is not None:
                if self._writer is not None:
                    self._writer.wake()
                return placed
        return self.put(
            namespace,
            run[0].parent,
            [w.block_hash for w in run],
            layers,
            [[w.layer(k) for w in run] for k in range(len(layers))],
            [[w.checksums[k] for w in run] for k in range(len(layers))],
            token_ids=_run_tokens(run),
        )

    def _whole_into_arena(self, memory: MemoryTier, namespace: bytes, run: list[Whole]) -> PutResult | None:
        """`run` copied into a fresh extent and committed like a reservation; None when the
        arena has no room for it (nothing changed)."""
        tokens = [block.tokens or [] for block in run] if all(block.tokens for block in run) else None
        return self._into_arena(
            memory, namespace, run[0].layers, [block.block_hash for block in run],
            [block.parent for block in run], lambda i, k: run[i].layer(k),
            [c for block in run for c in block.checksums], XXH3, tokens,
        )  # fmt: skip

    def _into_arena(
        self,
        memory: MemoryTier,
        namespace: bytes,
        layers: tuple[LayerSpec, ...],
        hashes: list[bytes],
        parents: list[bytes],
        data: Callable[[int, int], memoryview | bytes],
        checksums: list[int],
        kind: str,
        tokens: list[list[int]] | None = None,
        *,
        to_fleet: bool = True,
    ) -> PutResult | None:
        """Blocks whose bytes the daemon holds (`data(block, layer)`) copied into a fresh
        extent and committed like a reservation: resident, queued for write-behind,
        announced. None when the arena has no room for them (nothing changed)."""
        n = len(hashes)
        sizes = [layer.nbytes for layer in layers]
        nbytes = fmt.extent_bytes(sum(sizes), n)
        if nbytes > memory.allocator.total:
            return None
        with self._commit_lock:
            try:
                offset = self.tiers.allocate(nbytes, time.time())
            except NoRoom as exc:
                log.debug("blocks go to the persistent tier: %s", exc)
                return None
            view = memory.file.view
            for i in range(n):
                for k, (at, size) in enumerate(zip(fmt.block_offsets(sizes, n, i), sizes, strict=True)):
                    view[offset + at : offset + at + size] = data(i, k)
            res = Reservation(
                id=0, prefix=b"", namespace=namespace, parent_hash=parents[0], hashes=hashes,
                parents=parents, request_index=list(range(n)), skipped=0, layers=layers, extent=offset,
                nbytes=nbytes, expires=0.0, token_ids=tokens,
            )  # fmt: skip
            return self._record_taken(memory, res, checksums, kind, to_fleet=to_fleet)

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
        """Write and delete `victims`; return what else had to be evicted.

        When the backend is full below the byte budget (the filesystem, or LMDB's
        map), eviction gets one chance: as many more bytes as the put brings (and
        one block), and only if that much is evictable. If the write still fails,
        eviction evidently does not help (another process holds the space, a reader
        pins LMDB's pages): later full writes fail at once, without evicting, until
        a write succeeds. So a full disk never empties the store for puts that fail.
        """
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
            return extra
        except StorageFullError as exc:
            self._eviction_helps = False
            self.tiers.delete(victims + extra)
            log.warning("no room after evicting %d blocks: full puts fail without eviction now", len(extra))
            raise CapacityError(f"no room for this put after evicting {len(extra)} blocks: {exc}") from exc
        except StorageError:
            self.tiers.delete(victims + extra)
            raise

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
            self._remove_corrupt_locked(key)

    def _remove_corrupt_locked(self, key: BlockKey) -> None:
        with self._lock:
            if self._index.remove(*key) is not None:
                self._emit_removed([key])
        # deleting inside a read snapshot is safe: the snapshot keeps its pages (and an
        # arena extent being read is pinned)
        self.tiers.delete([key])

    def _count_read(self, result: ReadResult) -> None:
        with self._lock:
            used = sum(result.layers[k].nbytes for k in result.used) if result.layers else 0
            self.counters.bytes_read += used * result.num_blocks

    # ---- the memory tier: recovery, reservations, pins (promotion, write-behind: tiers.chain)
    def _recover_memory(self, memory: MemoryTier) -> None:
        """Take back the blocks a previous daemon committed to the arena: those the
        persistent tier has are resident copies; the others wait for write-behind."""
        recovered = memory.recover(memory.index.scan())
        queued = 0
        for placed in recovered:
            m = placed.meta
            persisted = self._index.get(*m.key) is not None
            if not persisted:
                self._index.add(m.namespace, m.block_hash, m.parent_hash, m.size, m.created_at, len(m.layers))
            memory.place([placed], m.created_at, dirty=not persisted)
            queued += not persisted
        if recovered:
            log.info(
                "memory tier: recovered %d committed blocks from %s (%d not yet written behind)",
                len(recovered),
                memory.file.path,
                queued,
            )

    def _tier(self) -> MemoryTier:
        if self.memory is None:
            raise NoMemoryTier("this daemon runs without a memory tier (--memory 0)")
        return self.memory

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
        if subset is not None:
            layers = [full[k] for k in subset]
        block_bytes = sum(layer.nbytes for layer in layers)
        now = time.time()
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            memory.expire(time.monotonic())
            todo = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
        if not todo:
            return None
        if block_bytes * len(todo) > self.capacity_bytes:
            raise CapacityError(
                f"save of {block_bytes * len(todo)} bytes exceeds the store's capacity of "
                f"{self.capacity_bytes} bytes"
            )
        nbytes = fmt.extent_bytes(block_bytes, len(todo))
        if nbytes > memory.allocator.total:
            raise CapacityError(
                f"a save of {nbytes} bytes does not fit the memory tier ({memory.allocator.total} bytes)"
            )
        with self._commit_lock:
            try:
                offset = self.tiers.allocate(nbytes, now)
            except NoRoom as exc:
                raise CapacityError(str(exc)) from exc
            with self._lock:
                res = Reservation(
                    id=memory.new_id(),
                    prefix=prefix,
                    namespace=namespace,
                    parent_hash=parent_hash,
                    hashes=[hashes[i] for i in todo],
                    parents=[hashes[i - 1] if i else parent_hash for i in todo],
                    request_index=todo,
                    token_ids=_block_tokens(token_ids, len(hashes), todo),
                    skipped=len(hashes) - len(todo),
                    layers=tuple(layers),
                    extent=offset,
                    nbytes=nbytes,
                    expires=time.monotonic() + memory.lease_seconds,
                    subset=subset,
                    full_layers=full,
                )
                memory.reservations[res.id] = res
                memory.counters.reservations += 1
        return res

    def commit(
        self, prefix: bytes, reservation_id: int, checksums: Sequence[int], kind: str = XXH3
    ) -> PutResult:
        """Make a reservation's blocks visible, all or nothing; `checksums` block-major, of
        `kind` (kvstore.blocks.CHECKSUMS)."""
        memory = self._tier()
        if kind not in CHECKSUMS:
            raise InvalidCommit(f"unknown checksum kind {kind!r}; known: {', '.join(CHECKSUMS)}")
        with self._lock:
            part = memory.reservations.get(reservation_id)
            if part is not None and part.prefix == prefix and part.subset is not None:
                self._check_commit(part, checksums)
                memory.take_reservation(reservation_id, prefix)
                subset = part.subset
            else:
                part = subset = None
        if part is not None and subset is not None:  # its blocks are put (taking the commit lock) when whole
            return self._commit_part(memory, part, subset, checksums, kind)
        with self._commit_lock:
            with self._lock:
                res = memory.reservations.get(reservation_id)
                if res is None or res.prefix != prefix:
                    raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")
                self._check_commit(res, checksums)
                memory.take_reservation(reservation_id, prefix)
            result = self._record_taken(memory, res, checksums, kind)
            with self._lock:
                memory.counters.commits += 1
        if self._writer is not None:
            self._writer.wake()
        return result

    def _record_taken(
        self,
        memory: MemoryTier,
        res: Reservation,
        checksums: Sequence[int],
        kind: str,
        *,
        to_fleet: bool = True,
    ) -> PutResult:
        """Make a taken reservation's blocks visible (under the commit lock): recorded in
        the arena's index, queued for write-behind, announced; its extent is freed when
        nothing of it was placed or the records failed."""
        recorded = False
        try:
            placed, victims, incoming = self._commit_records(memory, res, checksums, kind)
            recorded = True
        finally:
            if not recorded:  # whatever failed, the reservation is gone: its space comes back
                with self._lock:
                    memory.allocator.free(res.extent, res.nbytes)
        ns, n = res.namespace, len(res.hashes)
        with self._lock:
            if placed:
                for p in placed:
                    m = p.meta
                    self._index.add(ns, m.block_hash, m.parent_hash, m.size, m.created_at, len(m.layers))
                memory.place(placed, placed[0].meta.created_at, dirty=True)
                if self._fleet_writer is not None and to_fleet:
                    self._fleet_writer.add([p.meta.key for p in placed], placed[0].meta.size)
                tokens = [res.token_ids[p.position] for p in placed] if res.token_ids else None
                for listener in self._listeners:
                    listener("stored", ns, [p.meta.block_hash for p in placed],
                             [p.meta.parent_hash for p in placed], tokens, MEMORY)  # fmt: skip
            else:
                memory.allocator.free(res.extent, res.nbytes)
            self.counters.puts += 1
            self.counters.blocks_written += len(placed)
            self.counters.bytes_written += incoming
            self._changed.notify_all()
        return PutResult(len(placed), res.skipped + n - len(placed), incoming, len(victims))

    @staticmethod
    def _check_commit(res: Reservation, checksums: Sequence[int]) -> None:
        if len(checksums) != len(res.hashes) * len(res.layers):
            raise InvalidCommit(
                f"a commit of {len(res.hashes)} blocks of {len(res.layers)} layers needs "
                f"{len(res.hashes) * len(res.layers)} checksums, not {len(checksums)}"
            )

    def _commit_part(
        self,
        memory: MemoryTier,
        res: Reservation,
        subset: tuple[int, ...],
        checksums: Sequence[int],
        kind: str,
    ) -> PutResult:
        """A taken reservation of a partial save: its parts go to `parts` (copied out of the
        extent, which is then freed), and the blocks they complete are stored."""
        try:
            sizes = [layer.nbytes for layer in res.layers]
            n, width, view = len(res.hashes), len(res.layers), memory.file.view
            starts = fmt.layer_starts(sizes)

            def data(k: int, i: int) -> memoryview:
                at = res.extent + n * starts[k] + i * sizes[k]
                return view[at : at + sizes[k]]

            if kind == XXH3:  # what the client summed is what the arena holds (a torn write fails)
                for i in range(n):
                    for k in range(width):
                        if checksum(data(k, i)) != checksums[i * width + k]:
                            raise InvalidCommit(
                                f"block {res.hashes[i].hex()} layer {res.layers[k].name!r}: the bytes "
                                "in the arena do not match the commit's checksum"
                            )
            tokens = [t for block in res.token_ids for t in block] if res.token_ids else ()
            result = self.put_part(
                res.namespace, res.parent_hash, res.hashes, res.full_layers, subset, data,
                token_ids=tokens, parents=res.parents,
                sums=(lambda k, i: checksums[i * width + k]) if kind == XXH3 else None,  # verified above
            )  # fmt: skip
        finally:  # whatever happened, the reservation is gone: its space comes back
            with self._lock:
                memory.allocator.free(res.extent, res.nbytes)
        with self._lock:
            memory.counters.commits += 1
        return PutResult(result.blocks_written, res.skipped + result.blocks_skipped, result.bytes_written,
                         result.blocks_evicted)  # fmt: skip

    def _commit_records(
        self, memory: MemoryTier, res: Reservation, checksums: Sequence[int], kind: str
    ) -> tuple[list[Placed], list[BlockKey], int]:
        """A taken reservation's blocks the index lacks, made room for and recorded in the
        arena's index: (their placements, the blocks evicted for them, their bytes). Raises
        with nothing changed but the evictions."""
        ns = res.namespace
        with self._lock:
            fresh = [i for i, h in enumerate(res.hashes) if self._index.get(ns, h) is None]
            if fresh and res.parent_hash:
                self._check_acyclic(ns, res.parent_hash, res.hashes)
            incoming = sum(layer.nbytes for layer in res.layers) * len(fresh)
            if incoming > self.capacity_bytes:  # (capacity is checked at reserve too)
                raise CapacityError(
                    f"commit of {incoming} bytes exceeds the store's capacity of {self.capacity_bytes} bytes"
                )
            chain = {(ns, h) for h in res.hashes} | ({(ns, res.parent_hash)} if res.parent_hash else set())
            victims = eviction.make_room(self._index, incoming, self.capacity_bytes, chain)
            self._emit_removed(victims)
            self.counters.evictions += len(victims)
            fits = self._index.bytes_used + incoming <= self.capacity_bytes
        self.tiers.delete(victims)
        if not fits:
            raise CapacityError("not enough evictable data to make room for this commit")
        now = time.time()
        n, width = len(res.hashes), len(res.layers)
        packed = wire.pack_checksums(checksums)
        placed = [
            Placed(
                BlockMeta(
                    ns,
                    res.hashes[i],
                    res.parents[i],
                    res.layers,
                    tuple(checksums[i * width : (i + 1) * width]),
                    now,
                    kind,
                ),  # fmt: skip
                res.extent,
                n,
                i,
                packed[8 * i * width : 8 * (i + 1) * width],
            )
            for i in fresh
        ]
        memory.index.put(placed)
        return placed, victims, incoming

    def abort(self, prefix: bytes, reservation_id: int) -> None:
        memory = self._tier()
        with self._lock:
            res = memory.take_reservation(reservation_id, prefix)
            if res is None:
                raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")
            memory.allocator.free(res.extent, res.nbytes)
            memory.counters.aborts += 1

    def pin(self, prefix: bytes, namespace: bytes, hashes: Sequence[bytes]) -> PinResult:
        """Pin the stored prefix of `hashes` in the arena (promoting blocks only the
        persistent tier holds, and waiting for them) for the lease; a miss pins nothing
        (pin_id 0)."""
        memory = self._tier()
        keys, cold, now, stop = self._pin_prefix(memory, namespace, hashes)
        left_out = self.tiers.promote(keys, now) if cold else None
        return self._pinned(memory, prefix, namespace, hashes, keys, cold, now, stop, left_out, {})

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
        started = self.tiers.promote_start(keys, now) if cold else None
        promotion = started if isinstance(started, Promotion) else None
        left_out = started if isinstance(started, tuple) else None
        finished = False
        try:
            pending = {p.meta.key: p for p in promotion.placed} if promotion is not None else {}
            result = self._pinned(memory, prefix, namespace, hashes, keys, cold, now, stop, left_out, pending)
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
        """Pin the leading `keys` that are resident (or `pending`: a promotion's, still
        being read) with one layer set, for the lease."""
        with self._lock:
            # runs of consecutive positions in one extent, as [extent, extent_blocks, first, count]
            spans: list[list[int]] = []
            sums: list[bytes] = []  # each block's, packed (Placed.sums)
            kinds: list[str] = []
            layers: tuple[LayerSpec, ...] = ()
            resident = memory.resident
            for key in keys:
                placed = resident.get(key) or pending.get(key)
                if placed is None or self._index.get(*key) is None:
                    if left_out is not None and left_out[0] == key:  # the promotion left it out
                        stop = left_out[1]
                    else:  # gone since the prefix was found, or not brought into memory
                        stop = STOP_EVICTED if self._index.get(*key) is None else STOP_NO_ROOM
                    break
                meta = placed.meta
                if layers is not meta.layers:  # layouts are interned: one tuple per layout
                    if layers and meta.layers != layers:
                        stop = STOP_LAYER_SET_DIFFERS
                        break
                    layers = meta.layers
                last = spans[-1] if spans else None
                if last is not None and last[0] == placed.extent and last[2] + last[3] == placed.position:
                    last[3] += 1
                else:
                    spans.append([placed.extent, placed.extent_blocks, placed.position, 1])
                sums.append(placed.sums)
                kinds.append(meta.checksum_kind)
            runs = [Run(*span) for span in spans]
            if not runs:
                _log_short("pin", namespace, hashes, 0, stop)
                return PinResult(0, (), [], b"", 0, memory.lease_seconds, stop=stop)
            extents = list(dict.fromkeys(run.extent for run in runs))
            memory.pin_extents(extents, now)
            pin_id = memory.new_id()
            memory.pins[pin_id] = Pin(
                pin_id, prefix, namespace, extents, time.monotonic() + memory.lease_seconds
            )
            memory.counters.pins += 1
            got = sum(run.count for run in runs)
            promoted = len(set(cold).intersection(keys[:got]))
            memory.counters.memory_hit_blocks += got - promoted
            memory.counters.persistent_hit_blocks += promoted
            self.counters.bytes_read += got * sum(layer.nbytes for layer in layers)
        _log_short("pin", namespace, hashes, got, stop)
        return PinResult(pin_id, layers, runs, b"".join(sums), got, memory.lease_seconds, kinds, stop)

    def release(self, prefix: bytes, pin_id: int, corrupt: Sequence[bytes] = ()) -> bool:
        """End a pin; `corrupt`: blocks the client found failing their checksum (verified
        here again, and removed if so). False: the pin had already expired."""
        memory = self._tier()
        with self._lock:
            pin = memory.pins.get(pin_id)
            if pin is None or pin.prefix != prefix:
                found, namespace = False, b""
            else:
                found, namespace = True, pin.namespace
        if found and corrupt:
            self._check_reported(memory, namespace, corrupt)
        with self._lock:
            memory.release_pin(pin_id, prefix)
        return found

    def _check_reported(self, memory: MemoryTier, namespace: bytes, hashes: Sequence[bytes]) -> None:
        for block_hash in hashes:
            key = (namespace, block_hash)
            with self._lock:
                placed = memory.resident.get(key)
                if placed is None:
                    continue
                bad = memory.block(placed).corrupt_layer() is not None
            if bad:
                log.error("block %s fails its checksum in the memory tier (reported by a client): removed",
                          block_hash.hex())  # fmt: skip
                with self._lock:
                    self.counters.checksum_failures += 1
                self._remove_corrupt(key)

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

    # ---- what the chain of tiers asks of the index (tiers.chain.Owner)
    def indexed(self, key: BlockKey) -> bool:
        return self._index.get(*key) is not None

    def drop_evicted(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self._index.remove(*key)
        self._emit_removed(keys)
        self.counters.evictions += len(keys)

    def remove_corrupt(self, key: BlockKey) -> None:
        self._remove_corrupt_locked(key)

    def count_checksum_failures(self, n: int) -> None:
        self.counters.checksum_failures += n

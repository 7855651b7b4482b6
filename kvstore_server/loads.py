"""The ways out of the store: reads, DropSelect, pins, and the fleet's read-through.

read         a gRPC Get: the stored prefix, each block from the first tier that has
             it, verified (a block that fails leaves the store)
take         DropSelect: wait for the whole prefix, read it and remove it
pin          the same-host load: pin the prefix in the arena (promoting blocks only
             the persistent tier holds), the client reads it, then `release`s;
             `pin_stream` answers before the promotion's reads land; `lease` pins
             what a Lookup found in memory, for the load that follows it
_from_fleet  before a read or pin: the blocks the fleet holds past the local prefix,
             stored here like a save (admission)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from kvstore.blocks import (
    STOP_EVICTED,
    STOP_LAYER_SET_DIFFERS,
    STOP_NO_ROOM,
    STOP_NONE,
    STOP_NOT_IN_MEMORY,
    STOP_NOT_STORED,
    BlockPrefix,
    PutResult,
)
from kvstore_server.admission import Admitting
from kvstore_server.errors import InvalidPart, ShuttingDown, StoreError, WaitTimeout
from kvstore_server.parts import PartError, check_subset
from kvstore_server.tiers import BlockKey, LayerSpec, StorageError, StoredBlock
from kvstore_server.tiers.arena import ExtentRun, MemoryTier, Placed
from kvstore_server.tiers.chain import Promotion, ReadResult, Ready, Started, verified_prefix

log = logging.getLogger(__name__)

# Prefetches (Lookup's) whose reads may run at once: past it a lookup starts none, so a
# burst of lookups never queues reads ahead of the pins that need them now.
MAX_PREFETCHES = 4

# Blocks fetched from the fleet per round trip: a few first (their size is not known
# yet), then about this many bytes' worth.
_FLEET_FIRST_BATCH = 4
_FLEET_FETCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PinResult:
    pin_id: int  # 0: nothing pinned (a miss)
    layers: tuple[LayerSpec, ...]
    runs: list[ExtentRun]
    checksums: bytes  # packed as kvstore.wire.pack_checksums does; block b, layer l at b * len(layers) + l
    num_blocks: int
    lease_seconds: float
    kinds: list[str] = field(default_factory=list)  # each block's checksum kind
    stop: str = STOP_NONE  # why num_blocks is short of the request (kvstore.blocks.STOP_*)
    ready_layers: int = -1  # leading layers in place for every block (-1: all of them)
    ready_blocks: int = -1  # leading blocks with every layer in place (-1: all of them)


@dataclass(frozen=True, slots=True)
class Placing:
    """A streamed pin's promotion, until its blocks are placed (Loading.pin_stream)."""

    promotion: Promotion
    done: threading.Event = field(default_factory=threading.Event)


def _read_subset(blocks: Sequence[StoredBlock | None], subset: Sequence[int]) -> tuple[int, ...] | None:
    """A read's layer subset, checked against the first block's layout (None: all)."""
    first = blocks[0] if blocks else None
    if not subset or first is None:
        return None
    try:
        return check_subset(subset, len(first.meta.layers))
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


class Loading(Admitting):
    """The ways out (see the module docstring); a layer of kvstore_server.store.Store."""

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

    @contextmanager
    def read(
        self, namespace: bytes, hashes: Sequence[bytes], subset: Sequence[int] = ()
    ) -> Iterator[ReadResult]:
        """The stored prefix of `hashes`, verified; a bad or vanished block ends it.
        `subset`: the read's layer subset, the only layers it verifies and counts; empty: all."""
        self._from_fleet(namespace, hashes)
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
            self._index.touch(namespace, hashes[:n])
            keys = [(namespace, h) for h in hashes[:n]]
            queued = self.memory.reused(keys) if self.memory is not None else 0
        if queued and self._writer is not None:
            self._writer.wake()
        with self.tiers.read(keys) as blocks:
            result = self._verified_prefix(blocks, keys, subset=_read_subset(blocks, subset))
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
        subset: Sequence[int] = (),
    ) -> Iterator[ReadResult]:
        """DropSelect: wait until the whole prefix is stored, then read and remove it.
        `subset`: take only this layer subset; a block is removed once takes have covered
        all of its layers (each tensor-parallel rank takes its own heads)."""
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
                    checked_subset = _read_subset(blocks, subset)
                    with self._lock:
                        gone = self._taken_whole(keys, blocks, checked_subset)
                        for key in reversed(gone):  # tail first: nothing left below to walk
                            self._index.remove(*key)
                        self._emit_removed(gone)
                    # The read snapshot keeps the bytes readable after this delete.
                    self.tiers.delete(gone)
                break
            result = self._verified_prefix(blocks, keys, remove_bad=False, subset=checked_subset)
            _log_short("take", namespace, hashes, result.num_blocks, result.stop)
            yield result
        self._count_read(result)

    def _taken_whole(
        self, keys: list[BlockKey], blocks: list[StoredBlock | None], subset: tuple[int, ...] | None
    ) -> list[BlockKey]:
        """Of a DropSelect's blocks, those it takes the last layers of (all of them when it
        takes every layer: `subset` None); the others remember which layers are taken
        (caller holds the lock)."""
        if subset is None:
            return keys
        gone = []
        for key, block in zip(keys, blocks, strict=True):
            taken = self._taken.setdefault(key, set())
            taken.update(subset)
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
        subset: tuple[int, ...] | None = None,
    ) -> ReadResult:
        result, bad = verified_prefix(blocks, keys, subset)
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

    def _count_read(self, result: ReadResult) -> None:
        with self._lock:
            per_block = sum(result.layers[k].nbytes for k in result.subset_indices) if result.layers else 0
            self.counters.bytes_read += per_block * result.num_blocks

    # ---- pins: pin -> the client reads -> release
    def pin(self, tenant: bytes, namespace: bytes, hashes: Sequence[bytes]) -> PinResult:
        """Pin the stored prefix of `hashes` in the arena (promoting blocks only the
        persistent tier holds, and waiting for them) for the lease; a miss pins nothing
        (pin_id 0)."""
        memory = self._tier()
        keys, cold, now, stop = self._pin_prefix(memory, namespace, hashes)
        started = self._started(self.tiers.promote(keys, now)) if cold else Started()
        pending: dict[BlockKey, Placed] = {}
        left_out = started.left_out
        if started.joined and started.promotion is not None:  # read, perhaps not placed yet
            read, left_out = started.promotion.read_prefix()
            pending = {p.meta.key: p for p in read}
        try:
            return self._pinned(memory, tenant, namespace, hashes, keys, cold, now, stop, left_out,
                                pending)  # fmt: skip
        finally:
            self.tiers.let_go(started)

    def lease(self, tenant: bytes, namespace: bytes, hashes: Sequence[bytes], holders: int) -> PinResult:
        """A Lookup's lease: pin the leading blocks of `hashes` (a found prefix, the lookup
        touched them) that the memory tier holds, until `holders` Releases or the lease
        ends. Never promotes nor asks the fleet: a lookup does not wait for reads."""
        memory = self._tier()
        keys = [(namespace, h) for h in hashes]
        with self._lock:
            memory.expire(time.monotonic())
        result = self._pinned(memory, tenant, namespace, hashes, keys, [], time.time(), STOP_NONE, None, {},
                              holders, lease=True)  # fmt: skip
        if result.stop == STOP_NO_ROOM:  # not brought into memory: a lease never does
            result = dataclasses.replace(result, stop=STOP_NOT_IN_MEMORY)
        return result

    def prefetch(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        """Have the blocks of the stored prefix of `hashes` that only the persistent tier
        holds read into the memory tier, and return at once: how many are to be read, not
        counting those a promotion reads already (0: none, or MAX_PREFETCHES are under
        way). A Lookup's, for the load that follows it a step later: its Pin finds them in
        memory, or joins their reads in flight. The promotion starts and is finished (its
        blocks placed) on a prefetch thread: a lookup never waits for a read, nor for
        finding where the blocks lie. Never asks the fleet."""
        memory = self._tier()
        if not self._prefetch_slots.acquire(blocking=False):
            return 0
        handed_on = False
        try:
            with self._lock:
                if self._closed:
                    return 0
                n = self._index.prefix_len(namespace, hashes)
                keys = [(namespace, h) for h in hashes[:n]]
                cold = [k for k in keys if k not in memory.resident]
            reading = self.tiers.reading(cold) if cold else set()
            if len(reading) == len(cold):  # none, or all being read already (asked again)
                return 0
            self._prefetcher.submit(self._prefetched, keys)
            handed_on = True
            return len(cold) - len(reading)
        finally:
            if not handed_on:
                self._prefetch_slots.release()

    def _prefetched(self, keys: list[BlockKey]) -> None:
        """A prefetch, on a prefetch thread: its promotion started (a load of the same
        blocks meanwhile waits for that, then joins it: TierChain.promote_start), and
        finished."""
        try:
            started = self._started(self.tiers.promote_start(keys, time.time()))
            promotion = started.promotion
            if promotion is None or started.joined:  # nothing to read, or a load reads them already
                self.tiers.let_go(started)
                return
            with self._lock:
                self._tier().counters.prefetched_blocks += len(promotion.placed)
            left_out = promotion.finish()
            if left_out is not None:
                log.debug("a prefetch stopped at block %s: %s", left_out[0][1].hex(), left_out[1])
        except (StoreError, StorageError, OSError) as exc:
            log.warning("a prefetch into the memory tier failed: %s", exc)
        except Exception:  # noqa: BLE001 - on a pool thread nobody waits on: said here, or never
            log.exception("a prefetch into the memory tier failed")
        finally:
            self._prefetch_slots.release()

    def pin_stream(
        self, tenant: bytes, namespace: bytes, hashes: Sequence[bytes]
    ) -> Generator[PinResult | Ready | str, None, None]:
        """Pin without waiting for the promotion: yields the PinResult at once (its
        ready_layers: -1 when every block is in place; else 0, and its ready_blocks the
        leading pinned blocks in memory already), then a Ready (layers [0, layers) of every
        pinned block, and every layer of pinned blocks [0, blocks), are in place) as the
        persistent tier's reads land (the last is (layer count, block count)), or, when a
        read failed, its STOP_* reason last (the rest never comes). The promotion is
        finished (its blocks placed) when the iteration ends or is closed."""
        memory = self._tier()
        keys, cold, now, stop = self._pin_prefix(memory, namespace, hashes)
        started = self._started(self.tiers.promote_start(keys, now)) if cold else Started()
        promotion = started.promotion
        placing: Placing | None = None
        try:
            pending = {p.meta.key: p for p in promotion.placed} if promotion is not None else {}
            try:
                result = self._pinned(memory, tenant, namespace, hashes, keys, cold, now, stop,
                                      started.left_out, pending)  # fmt: skip
            finally:
                self.tiers.let_go(started)
            if promotion is None or not any(k in pending for k in keys[: result.num_blocks]):
                yield result  # every pinned block is in place
                return
            # each pinned block's position in the promotion (-1: it was in memory)
            position = {p.meta.key: i for i, p in enumerate(promotion.placed)}
            order = [position.get(key, -1) for key in keys[: result.num_blocks]]

            def pinned_whole(promoted: int) -> int:
                """Leading pinned blocks in place once the promotion's first `promoted` are."""
                n = 0
                while n < len(order) and order[n] < promoted:
                    n += 1
                return n

            yield dataclasses.replace(result, ready_layers=0, ready_blocks=pinned_whole(0))
            # NOTE: the blocks are placed after the client hears that the last ones are in
            # (finish, below, runs while it copies them): its Release waits for that. A
            # load that joined another's promotion waits for no placement (its owner's
            # client may be slow): its blocks stay pinned where they were read.
            if not started.joined:
                placing = Placing(promotion)
                with self._lock:
                    self._placing[result.pin_id] = placing
            for ready in promotion.progress():
                yield Ready(ready.layers, pinned_whole(ready.blocks))
            if promotion.failed:
                yield STOP_EVICTED
        finally:
            if promotion is not None and not started.joined:  # a joined one is its owner's
                try:
                    promotion.finish()
                finally:
                    if placing is not None:
                        with self._lock:
                            del self._placing[result.pin_id]
                        placing.done.set()

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
        tenant: bytes,
        namespace: bytes,
        hashes: Sequence[bytes],
        keys: list[BlockKey],
        cold: list[BlockKey],
        now: float,
        stop: str,
        left_out: tuple[BlockKey, str] | None,
        pending: dict[BlockKey, Placed],
        holders: int = 1,
        *,
        lease: bool = False,
    ) -> PinResult:
        """Pin the leading `keys` that are still stored and resident (or `pending`: a
        promotion's, still being read) with one layer set, for the lease."""
        with self._lock:
            stored = 0
            while stored < len(keys) and self._index.get(*keys[stored]) is not None:
                stored += 1
            pinned = memory.pin(tenant, namespace, keys[:stored], pending, now, holders)
            got = pinned.num_blocks
            queued = memory.reused(keys[:got])
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
                hits = (got - promoted, promoted, got * sum(layer.nbytes for layer in pinned.layers))
                if lease:  # counted when a loader releases its share (release)
                    memory.pins[pinned.pin_id].hits = hits
                else:
                    self._count_hits(hits)
        if queued and self._writer is not None:
            self._writer.wake()
        _log_short("pin", namespace, hashes, got, stop)
        return PinResult(pinned.pin_id, pinned.layers, pinned.runs, pinned.sums, got, memory.lease_seconds,
                         pinned.kinds, stop)  # fmt: skip

    def release(
        self, tenant: bytes, pin_id: int, corrupt: Sequence[bytes] = (), *, all_holders: bool = False
    ) -> bool:
        """End a pin (one holder's share of a lease, or with `all_holders` all of it);
        `corrupt`: blocks the client found failing their checksum (verified here again, and
        removed if so). False: the pin had already expired."""
        memory = self._tier()
        namespace = memory.pin_owner(pin_id, tenant)
        with self._lock:
            placing = self._placing.get(pin_id) if namespace is not None else None
        if placing is not None and (corrupt or placing.promotion.all_read):
            # what the client reports is verified against what is resident, and a release
            # after the load leaves its blocks in memory for the next (a Pin meanwhile
            # would read them again): both wait for the placement (which waits for no read
            # unless the client reports before the last one)
            if not placing.done.wait(memory.lease_seconds):
                log.warning("pin %d released before its promotion was placed", pin_id)
        if namespace is not None and corrupt:
            for key in memory.corrupt([(namespace, h) for h in corrupt]):
                log.error("block %s fails its checksum in the memory tier (reported by a client): removed",
                          key[1].hex())  # fmt: skip
                with self._lock:
                    self.counters.checksum_failures += 1
                self._remove_corrupt(key)
        with self._lock:
            pin = memory.release_pin(pin_id, tenant, all_holders=all_holders)
            if pin is not None and pin.hits is not None and not all_holders:  # a lease, loaded
                self._count_hits(pin.hits)
                pin.hits = None
        return namespace is not None

    def _count_hits(self, hits: tuple[int, int, int]) -> None:
        """A load's blocks served (from memory, promoted) and bytes (caller holds the lock)."""
        memory = self._tier()
        memory.counters.memory_hit_blocks += hits[0]
        memory.counters.persistent_hit_blocks += hits[1]
        self.counters.bytes_read += hits[2]

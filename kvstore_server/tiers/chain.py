"""The chain of tiers behind the store, in lookup order, and the moves between them.

    memory tier (tiers.arena, optional: the hot arena, bounded by --memory)
      -> persistent tier (a Backend: LMDB or disk, bounded by --capacity)

A block is read from the first tier that holds it (`read`); a load through the
arena copies what only the persistent tier holds into a new extent (`promote`);
blocks committed to the arena reach the persistent tier through `write_behind_once`
(called by tiers.writeback's thread); `delete` removes blocks from every tier; the
memory tier makes room by evicting its least recently used extents.

The chain knows which tier has a block; whether a block is in the store, the
store's prefix index says (`index`: read here, never changed). What the chain
finds it returns (`Started`, `verified_prefix`: the block that failed its checksum);
memory-only blocks the memory tier evicts for room the store takes from it
(MemoryTier.take_evicted); the store drops both from its index and announces them.
The locks are the store's:
the memory tier's `lock` guards its state and the index, held only for in-memory
work; `commit_lock` serialises everything that changes a tier's contents, so the
index and the tiers change together. Methods say which lock the caller must hold;
the others take what they need.

NOTE: over 500 lines: a Promotion and the chain share the locks, the extents' holds
and the registry of promotions under way (which a load of the same blocks joins);
apart, each would reach into the other's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvstore.blocks import (
    STOP_EVICTED,
    STOP_LAYER_SET_DIFFERS,
    STOP_NO_ROOM,
    STOP_NONE,
    BlockPrefix,
    leading_blocks,
    subset_indices,
)
from kvstore_server.index import PrefixIndex
from kvstore_server.rates import Rate
from kvstore_server.tiers.arena import ArenaError, MemoryTier, NoRoom, Placed
from kvstore_server.tiers.base import (
    Backend,
    BlockKey,
    BlockWrite,
    LayerSpec,
    Located,
    Pieces,
    StorageError,
    StorageFullError,
    StoredBlock,
)
from kvstore_server.tiers.fleet import FleetTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Started:
    """What TierChain.promote_start did: the promotion under way (its `finish` must be
    called), and the first block left out and why (kvstore.blocks.STOP_*; None: none).
    The memory-only blocks its room evicted the store takes from the memory tier
    (MemoryTier.take_evicted)."""

    promotion: Promotion | None = None
    left_out: tuple[BlockKey, str] | None = None
    # the promotion is another load's, joined: its extents are held once for this one
    # (TierChain.let_go once pinned); its owner finishes it
    joined: bool = False


class _Claim(NamedTuple):
    """What TierChain.promote_start found and took under the lock (see _claim)."""

    hot: list[int]  # extents of the blocks in memory, pinned meanwhile
    cold: list[BlockKey]
    joined: Promotion | None  # the promotion reading every cold block already
    mine: threading.Event | None  # set once this load's promotion is under way, or did not start


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A stored prefix being read: `blocks` are valid inside the context only."""

    layers: tuple[LayerSpec, ...]
    blocks: list[StoredBlock] = field(default_factory=list)
    subset: tuple[int, ...] | None = None
    """The read's layer subset (the layers it verifies and sends), by index; None: all."""
    stop: str = STOP_NONE
    """Why the read stopped before the end of the keys it was given (kvstore.blocks.STOP_*)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def subset_indices(self) -> list[int]:
        """Indices of the layers of the read's subset (all of them when it has none)."""
        return subset_indices(self.subset or (), len(self.layers))


def verified_prefix(
    blocks: Sequence[StoredBlock | None], keys: Sequence[BlockKey], subset: tuple[int, ...] | None = None
) -> tuple[ReadResult, BlockKey | None]:
    """The leading blocks that are present, pass their checksums (of layer subset `subset`,
    default all) and share one layer layout (kvstore.blocks.leading_blocks), logged where
    that ends early; and the key of the block that failed its checksum, if one did. A block
    missing from the read (the caller found it in the index) counts as evicted."""
    prefix = leading_blocks(blocks, subset=subset)
    n = len(prefix.blocks)
    stop = prefix.stop_reason(missing=STOP_EVICTED)
    if prefix.stop == "corrupt" and prefix.bad_layer is not None:
        block = blocks[n]  # the one that failed (present: it was verified)
        layer = block.meta.layers[prefix.bad_layer].name if block is not None else "?"
        log.error(
            "checksum mismatch in block %s layer %r: treating it as a miss and removing it",
            keys[n][1].hex(),
            layer,
        )
        return ReadResult(prefix.layers, prefix.blocks, subset, stop), keys[n]
    if prefix.stop == "layout":
        log.warning("block %s has another layer layout than its prefix; stopping there", keys[n][1].hex())
    return ReadResult(prefix.layers, prefix.blocks, subset, stop), None


# Promotions read each block's layers in groups of about this many bytes (at most
# _MAX_GROUPS), first groups first: a loader may use the first layers while the rest land.
# NOTE: large: a read's fixed cost dominates small ones where syscalls are dear (on a
# sandboxed H200 host page-cache preadv ran 14 GB/s at 2 MiB, 7 at 1 MiB, 2-5 at 256 KiB:
# bench/results/io_paths_h200.txt), and overlap matters little when the disk is the limit
_GROUP_READ_BYTES = 4 << 20
_MAX_GROUPS = 8
# A promotion's reads: tasks of at least this many bytes (a task's Python costs tens of
# microseconds under the GIL), at most _TASKS_PER_THREAD per I/O thread; progress is
# reported about every _READY_STEP_BYTES of blocks read.
_READ_TASK_BYTES = 4 << 20
_TASKS_PER_THREAD = 8
_READY_STEP_BYTES = 8 << 20
_READY_REPORTS = 16
# How long a load waits for another's promotion of its blocks to start (to find where they
# lie: milliseconds) before it reads them itself.
_START_WAIT_S = 5.0


def layer_groups(sizes: Sequence[int]) -> list[range]:
    """Consecutive layer ranges of about equal bytes, each at least _GROUP_READ_BYTES of a
    block (fewer groups for small blocks), at most _MAX_GROUPS. A small block is read
    whole (adjacent blocks of a promotion merge into one read) and a loader waits for it:
    groups sized by the request instead (a 2 MiB block of 128 in 8 reads of 256 KiB) took
    a cold load from the page cache on the H200 from 13 GB/s to 4, and laying payloads out
    group-major to keep the reads large still lost (9-10 GB/s; Python planning per block
    per group)."""
    total = sum(sizes)
    count = max(1, min(_MAX_GROUPS, total // _GROUP_READ_BYTES, len(sizes)))
    groups: list[range] = []
    start = acc = 0
    for i, size in enumerate(sizes):
        acc += size
        if acc * count >= total * (len(groups) + 1) and len(groups) < count - 1:
            groups.append(range(start, i + 1))
            start = i + 1
    groups.append(range(start, len(sizes)))
    return [g for g in groups if len(g)]


def _group_rows(one: Any, group: range, extents: Sequence[int]) -> Any:
    """Each block's iovec rows ([block, rows, 2]) of the layers in `group`, for one-block
    extents at `extents` of one layout whose rows at the arena's start are `one` ([layer,
    2]): one row per block where those layers lie back to back, as they do in a one-block
    extent (made from the extents alone: the rows of every layer of 512 blocks of 256
    layers took longer to make than the reads they planned took to start)."""
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    first = one[group.start : group.stop]
    shift = np.asarray(extents, dtype=np.uint64)
    length = int(first[:, 1].sum())
    if int(first[-1, 0] + first[-1, 1] - first[0, 0]) == length:
        spans = np.empty((len(shift), 1, 2), dtype=np.uint64)
        spans[:, 0, 0] = shift + first[0, 0]
        spans[:, 0, 1] = length
        return spans
    rows = np.repeat(first[None], len(shift), axis=0)
    rows[:, :, 0] += shift[:, None]
    return rows


class Ready(NamedTuple):
    """A promotion's progress: layers [0, layers) of every block are in place, and every
    layer of blocks [0, blocks)."""

    layers: int
    blocks: int


class Promotion:
    """Blocks being read from the persistent tier into new one-block extents side by side
    (TierChain.promote_start; MemoryTier.hold_block_extents): each block's layers lie
    together, as the tier stores them, so a block is one read into one range, and blocks
    [a, b) are one range of the arena that a loader may copy as soon as they are read
    (Ready.blocks). The extents are held by the promotion (pinned, so they cannot be
    evicted) but their blocks are not resident: no other read sees them until `finish`
    places them. Reads are issued group of layers by group (layer_groups: one group for
    blocks under 8 MiB), all blocks' first group first.

    The reads are issued by `issue` (by the first of progress, read_prefix and finish, or
    earlier), not when it is made: a streamed Pin answers first (the extents and sums are
    known), then issues them. Answering after them, the answer's Python waited for the GIL
    behind 16 I/O threads: on the H200 host the client had it 6.5 ms after sending the Pin
    at 2048 tokens and 31 ms at 8192, though every read was issued after 1.3-2.3 and
    4-7 ms (bench/results/cold_timeline_h200_run1.txt)."""

    def __init__(
        self,
        chain: TierChain,
        memory: MemoryTier,
        cold: list[BlockKey],
        located: list[Located],
        extents: list[int],
        stopped: tuple[BlockKey, str] | None,
        window: ExitStack,
        now: float,
        started: float,
    ) -> None:
        self._chain = chain
        self._memory = memory
        self._cold = cold
        self._window = window  # the persistent tier's extents stay as they are while open
        self._now = now
        self._stopped = stopped
        self._finished = False
        self._started = started
        self.extents = extents
        layers = located[0].specs
        n = len(located)
        self.width = len(layers)
        self.groups = layer_groups([layer.nbytes for layer in layers])
        self.block_bytes = sum(layer.nbytes for layer in layers)
        found = time.perf_counter()
        self._located = located
        # per group, the blocks in chunks of about _READ_TASK_BYTES, a task each (at most
        # _TASKS_PER_THREAD per I/O thread): taken in order by the I/O threads, so the
        # leading blocks land first, and a loader starts on them a few reads in.
        # NOTE: tasks shrinking to 2 MiB towards the end (so the threads' last reads, which
        # a loader copies after the last ends, are small) read slower on an H100 host:
        # 128 blocks in 22-27 ms against 15-19 (bench/results/chunks_h100_ab.txt)
        threads = getattr(chain.persistent, "io_threads", 1)
        size = max(-(-n // (_TASKS_PER_THREAD * threads)), _READ_TASK_BYTES // max(1, self.block_bytes), 1)
        self._chunks = [range(first, min(n, first + size)) for first in range(0, n, size)]
        self._futures: list[list[Future[None]]] = []
        self._issue_lock = threading.Lock()
        self.issued = 0.0  # when the last read was issued (perf_counter); 0: not yet
        self._failed_at = n  # the first block a read failed for
        # (the sums: the meta's packed ones, PackedSums.packed: not copied again)
        self.placed = [Placed(h.meta, at, 1, 0) for at, h in zip(extents, located, strict=True)]
        self._found_ms = (found - started) * 1e3

    def issue(self) -> None:
        """Issue every read (once; later calls return at once): each group's planned before
        its first is issued (read_batches). A read that cannot be issued fails the
        promotion from its first block (`failed`), after the reads already issued end."""
        with self._issue_lock:
            if self.issued:
                return
            memory = self._memory
            one = memory.extent_rows(self._located[0].specs, 0, 1)[0]  # [layer, (address, length)], at 0
            try:
                for group in self.groups:
                    spans = _group_rows(one, group, self.extents)
                    batches = [[(self._located[p], Pieces(spans[p], memory.file)) for p in chunk]
                               for chunk in self._chunks]  # fmt: skip
                    self._futures.append(self._chain.persistent.read_batches(batches, group))
            except (StorageError, OSError, ValueError, TypeError, RuntimeError) as exc:
                for futures in self._futures:  # no read may still write into the extents
                    for future in futures:
                        future.exception()
                log.error("reading blocks from %s for a load failed: %s", self._cold[0][1].hex(), exc)
                self._futures, self._failed_at = [], 0
            self.issued = time.perf_counter()
            self._located = []  # (the records are not needed any more)

    def progress(self) -> Iterator[Ready]:
        """What is in place, as it grows: layers [0, layers) of every block, and every layer
        of blocks [0, blocks) (the chunks of the last group complete their blocks in order:
        a loader may start on the first blocks of a promotion read in one group, reported
        every _READY_STEP_BYTES or so); the last is (layer count, block count). Stops early
        when a read failed (then `failed` is True). Issues the reads if no one has yet."""
        self.issue()
        if not self._futures:  # none could be issued
            return
        n, last = len(self.placed), len(self.groups) - 1
        # each report costs Python on both ends while the reads hold the GIL's other users:
        # ~8 MiB apart, but at most about _READY_REPORTS in all (128 for 1 GB lagged the
        # reads by 15 ms on an H100 host)
        step = max(1, _READY_STEP_BYTES // max(1, self.block_bytes), -(-n // _READY_REPORTS))
        layers = reported = 0
        for g, (group, futures) in enumerate(zip(self.groups, self._futures, strict=True)):
            for chunk, future in zip(self._chunks, futures, strict=True):
                failure = future.exception()
                if failure is not None and chunk.start < self._failed_at:
                    log.error(
                        "reading blocks from %s for a load failed: %s",
                        self._cold[chunk.start][1].hex(),
                        failure,
                    )
                    self._failed_at = chunk.start  # (a block of the chunk: the first, to be sure)
                if g == last and chunk.stop < n and self._failed_at == n and chunk.stop - reported >= step:
                    reported = chunk.stop
                    yield Ready(layers, chunk.stop)
            if self._failed_at < n:
                return
            layers = group.stop
            yield Ready(layers, n if g == last else 0)

    def read_prefix(self) -> tuple[list[Placed], tuple[BlockKey, str] | None]:
        """Wait for every read (not for the placement: a joined load does not wait for
        its owner); the leading blocks read whole, and the first left out and why."""
        for _ in self.progress():
            pass
        if self.failed:
            return self.placed[: self._failed_at], (self._cold[self._failed_at], STOP_EVICTED)
        return self.placed, self._stopped

    @property
    def all_read(self) -> bool:
        """Every read has ended (a failed one too); False before they are issued."""
        return bool(self.issued) and all(future.done() for futures in self._futures for future in futures)

    @property
    def failed(self) -> bool:
        return self._failed_at < len(self.placed)

    def finish(self) -> tuple[BlockKey, str] | None:
        """Wait for every read, place the blocks read whole (resident, clean) and let the
        extent go if none was; called exactly once. Returns the first block left out and
        why, or None."""
        if self._finished:
            raise RuntimeError("a promotion is finished once")
        self._finished = True
        try:
            return self._finish()
        finally:
            self._chain.promoted(self)  # (done where it places them, unless that failed)

    def _finish(self) -> tuple[BlockKey, str] | None:
        chain, memory = self._chain, self._memory
        try:
            for _ in self.progress():
                pass
            for futures in self._futures:  # the failed group's later blocks, and later groups
                for future in futures:
                    future.exception()
        finally:
            self._window.close()
        read = self._failed_at
        done = time.perf_counter()
        chain.read_rate.add(read * self.block_bytes, done - self._started)
        stopped = self._stopped
        if read < len(self.placed):
            stopped = self._cold[read], STOP_EVICTED
        placed = self.placed[:read]
        live: list[Placed] = []
        with chain._commit_lock:  # (blocks become resident only under it)
            with memory.lock:  # not those another promotion of them placed meanwhile
                placed = [p for p in placed if p.meta.key not in memory.resident]
            try:
                memory.index.put(placed)
            except ArenaError as exc:
                log.error("%s; promotion skipped", exc)
                placed, stopped = [], (self._cold[0], STOP_NO_ROOM)
            with memory.lock:
                live = [p for p in placed if chain.index.get(*p.meta.key) is not None]
                memory.place(live, self._now, dirty=False)
                chain.promoted(self, locked=True)  # resident now: a Pin finds them so
                memory.unpin_extents(self.extents)  # frees those whose block was not placed
                memory.counters.promotions += 1
                memory.counters.promoted_blocks += len(live)
        if len(live) < len(placed):
            kept = {p.meta.key for p in live}
            memory.forget([p.meta.key for p in placed if p.meta.key not in kept])
        if log.isEnabledFor(logging.DEBUG):
            nbytes = read * self.block_bytes
            log.debug(
                "promoted %d blocks (%d MB): found %.1f ms, all issued after %.1f ms (%d tasks), "
                "all read after %.1f ms (%.2f GB/s), placed %.1f ms",
                len(live), nbytes // 1_000_000, self._found_ms, (self.issued - self._started) * 1e3,
                len(self._chunks) * len(self.groups),
                (done - self._started) * 1e3, nbytes / max(done - self._started, 1e-9) / 1e9,
                (time.perf_counter() - done) * 1e3,
            )  # fmt: skip
        return stopped


class TierChain:
    def __init__(
        self,
        persistent: Backend,
        memory: MemoryTier | None,
        fleet: FleetTier | None = None,
        *,
        index: PrefixIndex,
        commit_lock: threading.Lock,
    ) -> None:
        self.persistent = persistent
        self.memory = memory
        self.fleet = fleet
        self.read_rate = Rate()  # promotions: persistent tier -> memory
        self.write_rate = Rate()  # write-behind: memory -> persistent tier
        self.fleet_rate = Rate()  # fetches from the fleet
        self.index = index  # the store's: read under the lock, never changed here
        self._lock = memory.lock if memory is not None else threading.Lock()
        self._commit_lock = commit_lock
        self._writing: set[BlockKey] = set()  # blocks a write-behind batch is writing now
        # blocks being promoted, by promotion: a load of the same blocks joins it
        self._promoting: dict[BlockKey, Promotion] = {}
        # blocks whose promotion is starting (finding where they lie), until it is under
        # way or did not start: a load of them waits, then joins it (promote_start)
        self._starting: dict[BlockKey, threading.Event] = {}
        self._last_written = 0.0  # perf_counter when the last batch ended

    # ---- reads
    @contextmanager
    def read(self, keys: list[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        """Each block from the first tier that has it (None where none has); arena extents
        stay held meanwhile."""
        memory = self.memory
        if memory is None:
            with self.persistent.read(keys) as blocks:
                yield blocks
            return
        with memory.read(keys) as hot:
            cold = [key for key, block in zip(keys, hot, strict=True) if block is None]
            with self._lock:
                memory.counters.memory_hit_blocks += len(keys) - len(cold)
                memory.counters.persistent_hit_blocks += len(cold)
            with self.persistent.read(cold) if cold else nullcontext([]) as cold_blocks:
                rest = iter(cold_blocks)
                yield [block if block is not None else next(rest) for block in hot]

    # ---- the fleet (read through; never deleted from by local removals: other hosts use it)
    def fleet_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` the fleet holds (0 without one, or when it does not answer)."""
        return self.fleet.stored_prefix(keys) if self.fleet is not None else 0

    def fetch_from_fleet(self, keys: Sequence[BlockKey]) -> BlockPrefix:
        """The leading `keys` the fleet holds, read and verified (each object is checked
        against its key and checksums as it is decoded), of one layer layout."""
        if self.fleet is None:
            return BlockPrefix([])
        started = time.perf_counter()
        with self.fleet.read(keys) as blocks:  # (the fleet's blocks are the daemon's own bytes)
            prefix = leading_blocks(blocks, verify=False)
        self.fleet_rate.add(sum(b.meta.size for b in prefix.blocks), time.perf_counter() - started)
        return prefix

    def rates(self) -> dict[str, int | float]:
        return {
            "promoted_bytes": self.read_rate.bytes,
            "written_behind_bytes": self.write_rate.bytes,
            "persistent_read_rate": self.read_rate.value,
            "write_behind_rate": self.write_rate.value,
            "fleet_read_rate": self.fleet_rate.value,
        }

    # ---- removal
    def delete(self, keys: list[BlockKey]) -> None:
        """Delete from every tier blocks the index already dropped (the fleet excepted: other
        hosts use it). A tier that cannot (a failing disk) is logged: the blocks are not
        served, and return at restart."""
        if not keys:
            return
        if self.memory is not None:
            self.memory.delete(keys)
        try:
            self.persistent.delete(keys)
        except StorageError as exc:
            log.error("could not delete %d evicted blocks; they return at restart: %s", len(keys), exc)

    # ---- promotion: persistent -> memory
    def promote(self, keys: list[BlockKey], now: float) -> Started:
        """promote_start, then wait for the promotion: its `left_out` is the first block it
        left out and why (kvstore.blocks.STOP_*), or None. A joined one (another load's) is
        returned as it is: its caller waits for its reads (Promotion.read_prefix)."""
        started = self.promote_start(keys, now)
        if started.promotion is None:
            return started
        if started.joined:  # its caller waits for the reads (read_prefix), not the placement
            return started
        return Started(None, started.promotion.finish())

    def reading(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Those of `keys` that a promotion reads, or is starting to read."""
        with self._lock:
            return {k for k in keys if k in self._promoting or k in self._starting}

    def let_go(self, started: Started) -> None:
        """A joined promotion's hold for this load, ended (it has pinned what it uses)."""
        if started.joined and started.promotion is not None and self.memory is not None:
            with self._lock:
                self.memory.unpin_extents(started.promotion.extents)

    def promoted(self, promotion: Promotion, *, locked: bool = False) -> None:
        """`promotion` is finished (or its blocks are placed): no load joins it any more."""
        if not locked:
            with self._lock:
                self.promoted(promotion, locked=True)
            return
        for placed in promotion.placed:
            if self._promoting.get(placed.meta.key) is promotion:
                del self._promoting[placed.meta.key]

    def promote_start(self, keys: list[BlockKey], now: float) -> Started:
        """Start reading the blocks of `keys` that only the persistent tier holds into one
        new extent: the reads run on the persistent tier's I/O threads, straight into the
        extent, outside the commit lock (taken only to allocate and to place), group of
        layers by group so that a loader can start on the first layers while the rest is
        read (Promotion.progress). The request's blocks already in memory stay pinned
        meanwhile.

        NOTE: the bytes are not verified here: every reader of the arena verifies the
        checksums of what it uses (a client on its device, the daemon before it sends
        a Get), and a block that fails is removed then. A second check here would
        serialise a cold load behind xxh3 on one core."""
        memory = self._memory()
        deadline = time.monotonic() + _START_WAIT_S
        while not isinstance(claim := self._claim(memory, keys, now, time.monotonic() < deadline), _Claim):
            # another load is finding where some of these lie (ms): once its reads are under
            # way this one joins them, where it would otherwise read them twice (two TP
            # ranks' pins of one prompt come together; a Lookup's prefetch)
            for event in claim:
                event.wait(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                log.warning("a promotion of the same blocks took over %.0f s to start; reading them again",
                            _START_WAIT_S)  # fmt: skip
        hot, cold, joined, mine = claim
        try:
            if joined is not None:
                return Started(joined, joined._stopped, joined=True)
            return self._start(memory, cold, now) if cold else Started()
        finally:
            with self._lock:
                memory.unpin_extents(hot)
                if mine is not None:
                    for key in cold:
                        if self._starting.get(key) is mine:
                            del self._starting[key]
            if mine is not None:
                mine.set()

    def _claim(
        self, memory: MemoryTier, keys: list[BlockKey], now: float, wait: bool
    ) -> _Claim | list[threading.Event]:
        """Under the lock: where another load is starting a promotion of some of the cold
        blocks, its events to wait for (when `wait`); else the blocks in memory (their
        extents pinned), the cold ones, the promotion reading all of those already (joined:
        its extents held until this load pins), or this load's event, its start announced."""
        with self._lock:
            cold = [k for k in keys if k not in memory.resident and self.index.get(*k) is not None]
            starting = {id(e): e for e in (self._starting.get(k) for k in cold) if e is not None}
            if starting and wait:
                return list(starting.values())
            hot = list(dict.fromkeys(memory.resident[k].extent for k in keys if k in memory.resident))
            memory.pin_extents(hot, now)
            running = {id(p): p for p in (self._promoting.get(k) for k in cold)}
            joined = running.popitem()[1] if len(running) == 1 and None not in running.values() else None
            if joined is not None:
                memory.pin_extents(joined.extents, now)
            mine = threading.Event() if joined is None and cold else None
            if mine is not None:
                self._starting.update(dict.fromkeys(cold, mine))
            return _Claim(hot, cold, joined, mine)

    def _start(self, memory: MemoryTier, cold: list[BlockKey], now: float) -> Started:
        started = time.perf_counter()
        window = ExitStack()
        try:
            # NOTE: every block found before the first read is issued: finding the rest
            # while the first reads ran (their Python competing for the GIL) made cold loads
            # on the H200 slower, not faster (bench/results/persistent_h200_run9.txt). Only
            # the records' meta is made while they run (Promotion), at the daemon's 1 ms
            # switch interval: not yet measured through the daemon on a GPU host
            located, stopped = self._located(cold, window.enter_context(self.persistent.locate(cold)))
            if not located:
                window.close()
                return Started(None, stopped)
            with self._commit_lock:
                try:  # held by the promotion itself until it is placed
                    extents = memory.hold_block_extents(located[0].meta.size, len(located), now)
                except NoRoom as exc:  # the load is served from what is in memory
                    log.info("no promotion of %d blocks: %s", len(located), exc)
                    window.close()
                    return Started(None, (cold[0], STOP_NO_ROOM))
            try:
                promotion = Promotion(self, memory, cold, located, extents, stopped, window, now, started)
            except BaseException:  # (it issues no read: they wait for Promotion.issue)
                with self._lock:
                    memory.unpin_extents(extents)
                raise
            with self._lock:
                for placed in promotion.placed:
                    self._promoting[placed.meta.key] = promotion
            return Started(promotion, stopped)
        except BaseException:
            window.close()
            raise

    @staticmethod
    def _located(
        keys: list[BlockKey], found: Sequence[Located | None]
    ) -> tuple[list[Located], tuple[BlockKey, str] | None]:
        """The leading found blocks of the first one's layer set, and the first left out and
        why (None: all of them)."""
        located: list[Located] = []
        first: tuple[LayerSpec, ...] | None = None
        for key, handle in zip(keys, found, strict=True):
            if handle is None:
                return located, (key, STOP_EVICTED)
            layers = handle.specs
            if first is None:
                first = layers
            elif layers is not first and layers != first:  # (interned: the same tuple, as a rule)
                return located, (key, STOP_LAYER_SET_DIFFERS)
            located.append(handle)
        return located, None

    # ---- write-behind: memory -> persistent
    def write_behind_once(self, batch_bytes: int) -> bool:
        """Write the oldest committed blocks the persistent tier lacks (up to `batch_bytes`);
        False when nothing was waiting, or the tier has no room for them until reads end
        (they wait, queued, for the next wake: a commit, or the writers' tick).

        NOTE: the backend write runs outside the commit lock (a batch takes tens of ms,
        and a save's commit would wait behind it); the batch's extents are pinned
        meanwhile, so their bytes stay. The bytes go as they lie in the arena (gathered
        by the persistent tier's I/O threads), with the checksums their writer committed,
        not verified here: every later reader verifies them, and a block a client changed
        after its commit fails there and is removed. A block removed from the index during
        the write (evicted, taken, dropped) is deleted from the backend afterwards, under
        the commit lock, as the removal's own deletion may have run first.

        Safe to call from several threads: each takes the oldest blocks no other call is
        writing, so one batch's writes overlap another's fdatasync and LMDB commit."""
        memory = self.memory
        if memory is None:
            return False
        with self._lock:
            batch: list[Placed] = []
            size = 0
            writing = self._writing
            for key, nbytes in memory.dirty.items():
                if key in writing:
                    continue
                if batch and size + nbytes > batch_bytes:
                    break
                batch.append(memory.resident[key])
                size += nbytes
            if not batch:
                return False
            extents = list(dict.fromkeys(p.extent for p in batch))
            memory.pin_extents(extents, time.time())
            taken = [placed.meta.key for placed in batch]
            writing.update(taken)
        try:
            return self._write_behind(memory, batch, extents)
        finally:
            with self._lock:
                writing.difference_update(taken)

    def _write_behind(self, memory: MemoryTier, batch: list[Placed], extents: list[int]) -> bool:
        """Write `batch`; False when none of it was written or refused (it waits, queued:
        see _write_all_it_can)."""
        started = time.perf_counter()
        waited = time.time() - batch[0].meta.created_at
        try:
            writes = [
                BlockWrite(placed.meta, (), pieces=pieces)
                for placed, pieces in zip(batch, memory.blocks_pieces(batch), strict=True)
            ]
            planned = time.perf_counter()
            written, refused = self._write_all_it_can(writes, wait=True)
            if refused and len(refused) < len(writes):
                log.warning("write-behind: the persistent tier is full for %d of %d blocks; they stay "
                            "in memory only", len(refused), len(writes))  # fmt: skip
            elif refused:
                log.warning("write-behind: the persistent tier is full; %d blocks stay in memory only",
                            len(refused))  # fmt: skip
        finally:
            with self._lock:
                memory.unpin_extents(extents)
        ended = time.perf_counter()
        keys = [w.meta.key for w in written]
        wrote = {p.meta.key: p for p in batch}
        nbytes = sum(w.meta.size for w in written)
        with self._commit_lock:
            with self._lock:
                stale = [key for key in keys if self.index.get(*key) is None]
                # NOTE: only where the block is still the one written: a block removed and
                # put again meanwhile has a new placement, still waiting to be written behind
                # (its write replaces what this one wrote)
                resident = memory.resident
                memory.written_behind([key for key in keys if resident.get(key) is wrote[key]])
                memory.drop_behind(
                    [w.meta.key for w in refused if resident.get(w.meta.key) is wrote[w.meta.key]]
                )
                if written:
                    # batches overlap: time since the last one ended counts, not twice
                    elapsed = ended - max(started, self._last_written)
                    self.write_rate.add(nbytes, elapsed)
                self._last_written = max(self._last_written, ended)
            if stale:
                self.delete(stale)
        if log.isEnabledFor(logging.DEBUG) and written:
            writing = max(ended - planned, 1e-9)
            log.debug("wrote behind %d blocks (%.0f MB) in %.1f ms, the oldest committed %.1f ms before: "
                      "planned %.1f ms, the tier's write %.1f ms (%.2f GB/s), then %.1f ms",
                      len(written), nbytes / 1e6, (time.perf_counter() - started) * 1e3, waited * 1e3,
                      (planned - started) * 1e3, writing * 1e3, nbytes / writing / 1e9,
                      (time.perf_counter() - ended) * 1e3)  # fmt: skip
        return bool(written or refused)

    def _write_all_it_can(
        self, writes: list[BlockWrite], *, wait: bool = False
    ) -> tuple[list[BlockWrite], list[BlockWrite]]:
        """Write `writes` to the persistent tier; when it refuses them all, the halves on
        their own, down to single blocks: a full tier (room held by reads, or too scattered
        for a large block) refuses the blocks that do not fit, not the whole batch.
        Returns (written, refused): the refused stay in memory only (logged).

        With `wait`, a batch the tier has no room for until reads end
        (Backend.room_returning) is neither: it stays queued, as the room of blocks
        deleted while reads saw them comes back when the reads end. Tried down the halves
        instead, such a batch of thousands of small blocks cost a try per half while the
        reads ran on, and was then dropped (a trace replay)."""
        try:
            self.persistent.write(writes)
            return writes, []
        except StorageFullError:
            if wait and self.persistent.room_returning():
                log.debug("write-behind: %d blocks wait for room that reads hold", len(writes))
                return [], []
            if len(writes) == 1:
                return [], writes
        except StorageError as exc:
            log.warning("write-behind of %d blocks failed; they stay in memory only: %s", len(writes), exc)
            return [], writes
        half = len(writes) // 2
        first, first_refused = self._write_all_it_can(writes[:half])
        second, second_refused = self._write_all_it_can(writes[half:])
        return first + second, first_refused + second_refused

    def expire_leases(self) -> int:
        """Reclaim reservations and pins whose lease ran out; how many."""
        if self.memory is None:
            return 0
        with self._lock:
            return self.memory.expire(time.monotonic())

    # ---- lifecycle
    def close(self) -> None:
        """Close every tier; the arena file is removed when nothing in it is memory-only or
        waiting to be written behind. Caller holds the commit lock; called once."""
        self.persistent.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.memory is not None:
            self.memory.close(remove=not self.memory.dirty and not self.memory.memory_only)

    def _memory(self) -> MemoryTier:
        if self.memory is None:
            raise RuntimeError("a memory-tier operation on a chain without a memory tier")
        return self.memory

"""Write-behind: copies blocks committed to the memory tier into the persistent tier
(`WriteBehind`), and blocks stored on this host into the fleet (`FleetWriteBehind`).

Two threads per daemon (two batches in flight). Commits wake them; they write the
oldest waiting blocks in batches, with the checksums their writers committed (every
reader verifies them), until none wait; every second one of them also reclaims
expired reservations and pins. The queue is bounded by
`write_behind_bytes` (see MemoryTier.place): a commit beyond it is still
visible, but stays in memory only, counted as `write_behind_dropped`, and
leaves the store when the arena evicts it. A persistent tier that refuses a
batch (full, failing) does the same to that batch: saves are never delayed by
the tier behind. A batch refused for room that open reads hold until they end
(Backend.room_returning) waits, queued, instead (TierChain._write_all_it_can).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvstore.blocks import XXH3, BlockKey, StorageError, StoredBlock, checksum
from kvstore_server.tiers.base import BlockWrite

if TYPE_CHECKING:
    from kvstore_server.tiers.chain import TierChain
    from kvstore_server.tiers.fleet import FleetTier

log = logging.getLogger(__name__)

_BATCH_BYTES = 256 << 20  # written at once by the persistent tier's I/O pool (outside the commit lock)
_WRITERS = 2  # batches in flight at once
_TICK_SECONDS = 1.0


class WriteBehind:
    """`writers` threads, each writing the oldest waiting blocks no other one is writing:
    with two, one batch's writes overlap the other's fdatasync and LMDB commit, so the
    disk is not left idle between batches."""

    def __init__(self, tiers: TierChain, batch_bytes: int = _BATCH_BYTES, writers: int = _WRITERS) -> None:
        self._tiers = tiers
        self._batch = batch_bytes
        self._wakes = [threading.Event() for _ in range(writers)]
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"kvstore-write-behind-{i}", daemon=True)
            for i in range(writers)
        ]
        for thread in self._threads:
            thread.start()

    def wake(self) -> None:
        for event in self._wakes:
            event.set()

    def _run(self, worker: int) -> None:
        wake = self._wakes[worker]
        while not self._stop:
            wake.wait(_TICK_SECONDS)
            wake.clear()
            try:
                if worker == 0:
                    self._tiers.expire_leases()
                while not self._stop and self._tiers.write_behind_once(self._batch):
                    pass
            except Exception:
                # Never let the thread die silently: the next tick tries again.
                log.exception("write-behind failed; retrying")

    def flush(self) -> None:
        """Write everything waiting now (at shutdown, before the tiers close)."""
        while self._tiers.write_behind_once(self._batch):
            pass

    def close(self) -> None:
        self._stop = True
        self.wake()
        for thread in self._threads:
            thread.join()
        self.flush()


class FleetWriteBehind:
    """Copies the blocks stored on this host to the fleet, in the background.

    The queue holds block keys, de-duplicated, up to `queue_bytes` of their blocks;
    beyond it a block is not queued but dropped from the fleet's copy and counted
    (`fleet_dropped`): saves never wait for the fleet. Each batch asks the fleet which
    blocks it has already (one pipelined EXISTS: another host may have stored the same
    prefix), reads the others from the local tiers (a block evicted meanwhile is
    skipped) and SETs them; a fleet that does not answer drops the batch (counted).
    """

    def __init__(
        self, tiers: TierChain, fleet: FleetTier, queue_bytes: int, batch_bytes: int = 4 << 20
    ) -> None:
        self._tiers = tiers
        self._fleet = fleet
        self._limit = queue_bytes
        self._batch = batch_bytes
        self._queue: OrderedDict[BlockKey, int] = OrderedDict()
        self._queued_bytes = 0
        self.dropped = 0
        self.skipped = 0  # already in the fleet
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="kvstore-fleet-write-behind", daemon=True)
        self._thread.start()

    def add(self, keys: Sequence[BlockKey], block_bytes: int) -> None:
        """Queue blocks stored here (cheap: called under the store's lock)."""
        with self._cond:
            for key in keys:
                if key in self._queue:
                    continue
                if self._queued_bytes + block_bytes > self._limit:
                    self.dropped += 1
                    continue
                self._queue[key] = block_bytes
                self._queued_bytes += block_bytes
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "fleet_backlog_blocks": len(self._queue),
                "fleet_backlog_bytes": self._queued_bytes,
                "fleet_dropped": self.dropped,
                "fleet_skipped": self.skipped,
            }

    def _take(self) -> list[BlockKey]:
        """The next batch; waits for one (empty: stopping)."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            while not self._queue and not self._stop:
                self._cond.wait()
            batch: list[BlockKey] = []
            size = 0
            while self._queue and (not batch or size + next(iter(self._queue.values())) <= self._batch):
                key, nbytes = self._queue.popitem(last=False)
                batch.append(key)
                size += nbytes
            self._queued_bytes -= size
            self._busy = bool(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            try:
                self._copy(batch)
            except Exception:
                # Never let the thread die silently: the batch is dropped, the next goes on.
                log.exception("fleet write-behind of %d blocks failed", len(batch))
                with self._cond:
                    self.dropped += len(batch)

    def _copy(self, batch: list[BlockKey]) -> None:
        present = self._fleet.present(batch)
        if present is None:  # the fleet is away (logged once by the tier)
            with self._cond:
                self.dropped += len(batch)
            return
        todo = [key for key, there in zip(batch, present, strict=True) if not there]
        with self._cond:
            self.skipped += len(batch) - len(todo)
        if not todo:
            return
        with self._tiers.read(todo) as blocks:
            writes = [_fleet_write(block) for block in blocks if block is not None]
            try:
                self._fleet.write(writes)
            except StorageError as exc:
                log.debug("fleet write-behind of %d blocks dropped: %s", len(writes), exc)
                with self._cond:
                    self.dropped += len(writes)

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty and no batch is in flight (shutdown); False when
        `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Copy what is queued (for `timeout` seconds at most), then stop."""
        if not self.flush(timeout):
            log.warning("fleet write-behind: %d blocks not copied at shutdown", len(self._queue))
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join()


def _fleet_write(block: StoredBlock) -> BlockWrite:
    """A block read from a local tier, as the fleet stores it (xxh3 checksums; the arena
    may hold a block checksummed on a GPU)."""
    meta = block.meta
    if meta.checksum_kind != XXH3:
        meta = msgspec.structs.replace(
            meta, checksums=tuple(checksum(view) for view in block.layers), checksum_kind=XXH3
        )
    return BlockWrite(meta, block.layers)

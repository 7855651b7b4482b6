"""The memory tier: a shared-memory arena the daemon owns and same-host clients map.

Three parts, all used by `kvstore_server.store.Store` under its locks:

    ArenaFile    the file (created, sized and pre-faulted by the daemon, mode 0600 or a
                 group), its header (kvstore.arena_format) and the daemon's mapping
    Allocator    first-fit free list of ALIGN-sized pages, coalescing on free
    ArenaIndex   committed blocks -> where they lie, in a small LMDB environment beside
                 the file (same filesystem, so it lives and dies with it). A commit writes
                 its blocks' records in one transaction: after a SIGKILL the daemon
                 recovers exactly the committed blocks; a reservation that was never
                 committed has no record, so its bytes are free space, never data.
    MemoryTier   the two above and what is resident where, reservations and pins with their leases, the
                 write-behind queue. In-memory only; guarded by the store's lock.

The arena is a cache in front of the persistent tier: a committed block stays
here until the persistent tier has it (write-behind), then may be evicted; a
block that only the persistent tier holds is promoted into a fresh extent when
it is loaded. Clients write reserved extents and read pinned ones directly; the
daemon never trusts those bytes: every block-layer carries its xxh3 checksum,
verified before bytes are written behind, served over gRPC, or used by a client.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import secrets
import shutil
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from kvstore import arena_format as fmt
from kvstore import arenas, records
from kvstore.blocks import Layout
from kvstore.memory import MADV_POPULATE_WRITE
from kvstore_server.datadir import claim_arena, withdraw_arena_claim
from kvstore_server.tiers.base import (
    NO_SPACE,
    BlockKey,
    BlockMeta,
    LayerSpec,
    Pieces,
    StorageError,
    StoredBlock,
)

log = logging.getLogger(__name__)

_ID_KEY = b"arena-id"  # in the main database, beside the two named ones
_INDEX_FORMAT = "2"  # another format's records are dropped like another arena's
_INDEX_MAP_BYTES = 1 << 30  # sparse: address space, not memory


class ArenaError(StorageError):
    """The arena file cannot be created, opened or used."""


# ---- the file ---------------------------------------------------------------------
class ArenaFile:
    """The arena file and the daemon's shared mapping of it.

    An existing file of the same size and format is kept (its committed blocks are
    recovered); anything else at the path is replaced by a fresh, zeroed arena.
    """

    def __init__(
        self, path: Path, size: int, store_id: str, *, owner: str = "", group: int | None = None
    ) -> None:
        if size < fmt.DATA_OFFSET + fmt.ALIGN:
            raise ArenaError(
                f"memory tier of {size} bytes is too small (at least {fmt.DATA_OFFSET + fmt.ALIGN})"
            )
        size -= size % fmt.ALIGN
        self.path = path
        self.size = size
        self.owner = owner
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Held for the daemon's life: the lock tells orphan removers it is live.
            self._fd = arenas.open_locked(path)
        except OSError as exc:
            raise ArenaError(f"cannot create the memory tier's file {path}: {exc.strerror or exc}") from exc
        fd = self._fd
        old = self._existing_header(fd, size)
        self.fresh = old is None
        arena_id = old.arena_id if old is not None else secrets.token_hex(16)
        try:
            if self.fresh:
                os.ftruncate(fd, 0)  # another size or format: nothing of it is kept
            os.fchmod(fd, 0o660 if group is not None else 0o600)
            if group is not None:
                os.fchown(fd, -1, group)
            os.ftruncate(fd, size)
            # Allocates every page now (tmpfs): a full /dev/shm is an error here, at
            # start, rather than a SIGBUS when a client writes its first save.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            if self.fresh:
                path.unlink(missing_ok=True)
            os.close(fd)
            if exc.errno in NO_SPACE:
                raise ArenaError(
                    f"no room for a memory tier of {size} bytes in {path.parent} "
                    "(a container's /dev/shm is 64 MiB unless shm_size says more)"
                ) from exc
            raise ArenaError(f"cannot size the memory tier's file {path}: {exc.strerror}") from exc
        started = time.perf_counter()
        try:
            self._map.madvise(MADV_POPULATE_WRITE)
        except OSError as exc:  # older kernels: pages fault in as they are first used
            log.debug("memory tier not pre-faulted in this process: %s", exc)
        log.debug("memory tier mapped in %.2fs", time.perf_counter() - started)
        self.view = memoryview(self._map)
        anchor = ctypes.c_char.from_buffer(self.view)
        self.address = ctypes.addressof(anchor)  # where the mapping starts (for iovecs)
        del anchor  # releases its export of the mapping: close() can unmap
        self.header = fmt.Header(size, arena_id, store_id, owner=owner)
        self.view[: fmt.HEADER_BYTES] = self.header.pack()

    @staticmethod
    def _existing_header(fd: int, size: int) -> fmt.Header | None:
        try:
            if os.fstat(fd).st_size == 0:
                return None
            header = fmt.Header.unpack(os.pread(fd, fmt.HEADER_BYTES, 0))
            if header.size != size or os.fstat(fd).st_size != size:
                log.info("memory tier resized to %d bytes: starting it empty", size)
                return None
            return header
        except (OSError, fmt.ArenaFormatError) as exc:
            log.warning("replacing the memory tier's file: %s", exc)
            return None

    def publish(self, store_id: str) -> None:
        """Write the serving daemon run's id into the header (clients check it)."""
        self.header = fmt.Header(self.size, self.header.arena_id, store_id, owner=self.owner)
        self.view[: fmt.HEADER_BYTES] = self.header.pack()

    def close(self, *, remove: bool = False) -> None:
        """Unmap; `remove`: also delete the file (before its lock goes with the descriptor)."""
        try:
            self.view.release()
            self._map.close()
        except BufferError:  # a view of a read is still referenced: the mapping goes with it
            log.debug("memory tier mapping still in use at close; left to the garbage collector")
        try:
            if remove:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)


# ---- allocation -------------------------------------------------------------------
class Allocator:
    """Free extents of [start, end), in units of fmt.ALIGN bytes; first fit."""

    def __init__(self, start: int, end: int) -> None:
        self._starts: list[int] = [start]
        self._lengths: dict[int, int] = {start: end - start}
        self.free_bytes = end - start
        self.total = end - start

    def allocate(self, nbytes: int, align: int = 1) -> int | None:
        """The first free run that holds `nbytes` at an offset that is a multiple of `align`."""
        for start in self._starts:
            length = self._lengths[start]
            at = start if align == 1 else -(-start // align) * align
            if length >= nbytes + (at - start):
                if at == start:
                    i = bisect.bisect_left(self._starts, start)
                    del self._starts[i]
                    del self._lengths[start]
                    if length > nbytes:
                        self._starts.insert(i, start + nbytes)
                        self._lengths[start + nbytes] = length - nbytes
                    self.free_bytes -= nbytes
                    return start
                self.claim(at, nbytes)
                return at
        return None

    def claim(self, offset: int, nbytes: int) -> bool:
        """Mark [offset, offset + nbytes) used (recovery); False if any of it is not free."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        length = self._lengths[start]
        if offset + nbytes > start + length:
            return False
        del self._starts[i]
        del self._lengths[start]
        if offset > start:
            self._starts.insert(i, start)
            self._lengths[start] = offset - start
            i += 1
        tail = start + length - (offset + nbytes)
        if tail:
            self._starts.insert(i, offset + nbytes)
            self._lengths[offset + nbytes] = tail
        self.free_bytes -= nbytes
        return True

    def free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        end = offset + nbytes
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next
            nbytes += self._lengths.pop(end)
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:  # merge with the previous
                self._lengths[prev] += nbytes
                self.free_bytes += end - offset
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = nbytes
        self.free_bytes += end - offset

    def runs(self) -> Iterator[tuple[int, int]]:
        """The free runs, as (start, length), in address order."""
        for start in list(self._starts):
            yield start, self._lengths[start]

    @property
    def largest(self) -> int:
        return max(self._lengths.values(), default=0)


# ---- committed records ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Placed:
    """A committed block in the arena: its metadata and where its extent is. `sums`: its
    checksums packed as a Pin sends them (little-endian uint64s, made from the metadata
    when not given): a Pin of 512 blocks of 256 store layers spent 77% of its time
    turning 131,072 ints into bytes."""

    meta: BlockMeta
    extent: int
    extent_blocks: int
    position: int
    sums: bytes = b""

    def __post_init__(self) -> None:
        if len(self.sums) != 8 * len(self.meta.checksums):
            if self.sums:
                raise ValueError(f"{len(self.sums)} bytes of checksums for {len(self.meta.checksums)} layers")
            object.__setattr__(self, "sums", records.pack_sums(self.meta.checksums))

    def layer_offset(self, layer: int) -> int:
        sizes = [spec.nbytes for spec in self.meta.layers]
        return self.extent + fmt.block_layer_offset(sizes, self.extent_blocks, layer, self.position)

    def layer_offsets(self) -> list[int]:
        """Where each layer of the block lies in the arena (one pass over the layers)."""
        sizes = [spec.nbytes for spec in self.meta.layers]
        return [self.extent + at for at in fmt.block_offsets(sizes, self.extent_blocks, self.position)]


class ArenaIndex:
    """Committed blocks' records, in an LMDB environment beside the arena file: named
    databases `blocks` (key: namespace length, namespace, hash) and `layouts`."""

    def __init__(self, path: Path, arena_id: str) -> None:
        marker = f"{arena_id}/{_INDEX_FORMAT}".encode()
        try:
            env = self._open(path)
            with env.begin() as txn:
                current = txn.get(_ID_KEY) == marker
            if not current:  # another arena's records, or another format: start empty
                env.close()
                shutil.rmtree(path)
                env = self._open(path)
            self._env = env
            self._blocks = env.open_db(b"blocks")
            self._layouts = env.open_db(b"layouts")
            with env.begin(write=True) as txn:
                txn.put(_ID_KEY, marker)
        except (lmdb.Error, OSError) as exc:
            raise ArenaError(f"cannot open the memory tier's index {path}: {exc}") from exc
        self.path = path

    @staticmethod
    def _open(path: Path) -> lmdb.Environment:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        return lmdb.open(
            str(path), map_size=_INDEX_MAP_BYTES, sync=False, metasync=False, max_dbs=2, readahead=False
        )

    def scan(self) -> Iterator[Placed]:
        with self._env.begin(buffers=True) as txn:
            layouts = {}
            for digest, record in txn.cursor(db=self._layouts):
                try:
                    layouts[bytes(digest)] = Layout.parse(record)
                except (ValueError, TypeError) as exc:
                    log.warning("skipping an unreadable memory-tier layout: %s", exc)
            for key, raw in txn.cursor(db=self._blocks):
                try:
                    yield self._parse(bytes(key), raw, layouts)
                except (struct.error, ValueError, KeyError, IndexError) as exc:
                    log.warning("skipping an unreadable memory-tier record: %s", exc)

    @staticmethod
    def _parse(key: bytes, raw: memoryview, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> Placed:
        record = records.parse(key, raw, layouts)
        extent, n, position = record.where
        return Placed(record.meta, extent, n, position, record.sums)

    def put(self, blocks: Sequence[Placed]) -> None:
        items, layouts = [], {}
        for p in blocks:
            raw, layout = records.pack((p.extent, p.extent_blocks, p.position), p.meta, p.sums)
            layouts[layout.digest] = layout.record
            items.append((records.index_key(*p.meta.key), raw))
        try:
            with self._env.begin(write=True) as txn:
                for digest, record in layouts.items():
                    txn.put(digest, record, db=self._layouts)
                txn.cursor(db=self._blocks).putmulti(items)
        except lmdb.Error as exc:
            raise ArenaError(f"memory tier index commit failed: {exc}") from exc

    def delete(self, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(records.index_key(*key), db=self._blocks)
        except lmdb.Error as exc:
            raise ArenaError(f"memory tier index delete failed: {exc}") from exc

    def close(self) -> None:
        self._env.close()


# ---- in-memory state ----------------------------------------------------------------
@dataclass
class Extent:
    offset: int
    nbytes: int
    blocks: int
    live: set[BlockKey] = field(default_factory=set)
    pins: int = 0
    last_use: float = 0.0
    waiting: int = 0  # live blocks waiting for write-behind: the extent may not leave


@dataclass
class Reservation:
    id: int
    prefix: bytes  # the caller's tenant: only it may commit or abort
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


@dataclass
class Pin:
    id: int
    prefix: bytes
    namespace: bytes
    extents: list[int]
    expires: float


@dataclass
class ArenaCounters:
    reservations: int = 0
    commits: int = 0
    aborts: int = 0
    pins: int = 0
    leases_expired: int = 0
    promotions: int = 0
    promoted_blocks: int = 0
    memory_hit_blocks: int = 0
    persistent_hit_blocks: int = 0
    written_behind: int = 0
    write_behind_dropped: int = 0
    memory_evictions: int = 0


class MemoryTier:
    """The arena file, its index of committed blocks, and the in-memory state: residency,
    extents, leases and the write-behind queue. Not thread-safe: the store calls the
    state methods under its lock (the index and the file's bytes under its commit lock)."""

    def __init__(
        self, file: ArenaFile, index: ArenaIndex, lease_seconds: float, write_behind_bytes: int
    ) -> None:
        self.file = file
        self.index = index
        self.lease_seconds = lease_seconds
        self.write_behind_limit = write_behind_bytes
        self.allocator = Allocator(fmt.DATA_OFFSET, file.size)
        self.resident: dict[BlockKey, Placed] = {}
        self.resident_bytes = 0
        self.extents: dict[int, Extent] = {}
        self.reservations: dict[int, Reservation] = {}
        self.pins: dict[int, Pin] = {}
        self.dirty: OrderedDict[BlockKey, int] = OrderedDict()  # key -> bytes, commit order
        self.dirty_bytes = 0
        self.memory_only: set[BlockKey] = set()  # not written behind (queue full or tier full)
        self.counters = ArenaCounters()
        self._layout_rows: dict[tuple[int, int], tuple[tuple[LayerSpec, ...], Any, Any]] = {}

    def close(self, *, remove: bool = False) -> None:
        """Close the tier; `remove`: also delete the file and its index (a clean stop once
        everything is written behind: the memory goes back to the host). Otherwise they
        stay for the next start to recover."""
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
                extent = self.extents[placed.extent] = Extent(placed.extent, nbytes, placed.extent_blocks)
            elif extent.nbytes != nbytes or extent.blocks != placed.extent_blocks:
                log.warning(
                    "memory tier record of block %s disagrees with its extent: dropped",
                    placed.meta.block_hash.hex(),
                )
                continue
            kept.append(placed)
        return kept

    # ---- extents
    def allocate(self, nbytes: int) -> int | None:
        return self.allocator.allocate(nbytes)

    def evictable_extent(self, now: float) -> Extent | None:
        """The least recently used extent that may leave: unpinned, nothing in it waiting
        for write-behind (memory-only blocks may go: the persistent tier refused them)."""
        best: Extent | None = None
        for extent in self.extents.values():
            if extent.pins or extent.waiting:
                continue
            if best is None or extent.last_use < best.last_use:
                best = extent
        return best

    def place(self, blocks: Sequence[Placed], now: float, *, dirty: bool) -> None:
        if not blocks:
            return
        first = blocks[0]
        extent = self.extents.get(first.extent)
        if extent is None:
            extent = self.extents[first.extent] = Extent(
                first.extent, fmt.extent_bytes(first.meta.size, first.extent_blocks), first.extent_blocks
            )
        extent.last_use = now
        for placed in blocks:
            key = placed.meta.key
            extent.live.add(key)
            self.resident[key] = placed
            self.resident_bytes += placed.meta.size
            if dirty:
                if self.dirty_bytes + placed.meta.size > self.write_behind_limit:
                    self.memory_only.add(key)
                    self.counters.write_behind_dropped += 1
                else:
                    self.dirty[key] = placed.meta.size
                    self.dirty_bytes += placed.meta.size
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
        """Forget `keys` (evicted, taken, corrupt); free extents left empty. Returns the keys
        that were resident (their index records are the caller's to delete)."""
        gone = []
        for key in keys:
            placed = self.resident.get(key)
            if placed is None:
                continue
            gone.append(key)
            self.memory_only.discard(key)
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

    # ---- leases
    def new_id(self) -> int:
        while True:
            lease_id = secrets.randbits(63) or 1
            if lease_id not in self.reservations and lease_id not in self.pins:
                return lease_id

    def pin_extents(self, offsets: Sequence[int], now: float) -> None:
        for offset in offsets:
            extent = self.extents[offset]
            extent.pins += 1
            extent.last_use = now

    def unpin_extents(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            extent = self.extents.get(offset)
            if extent is not None:
                extent.pins -= 1
                self._maybe_free(extent)

    def release_pin(self, pin_id: int, prefix: bytes) -> Pin | None:
        pin = self.pins.get(pin_id)
        if pin is None or pin.prefix != prefix:
            return None
        del self.pins[pin_id]
        self.unpin_extents(pin.extents)
        return pin

    def take_reservation(self, reservation_id: int, prefix: bytes) -> Reservation | None:
        res = self.reservations.get(reservation_id)
        if res is None or res.prefix != prefix:
            return None
        del self.reservations[reservation_id]
        return res

    def expire(self, now: float) -> int:  # time.monotonic()
        """Reclaim reservations and pins whose lease ran out; how many."""
        expired = 0
        for res in [r for r in self.reservations.values() if r.expires <= now]:
            del self.reservations[res.id]
            self.allocator.free(res.extent, res.nbytes)
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
    def extent_rows(self, layers: tuple[LayerSpec, ...], extent: int, num_blocks: int) -> Any:
        """Where every block of an extent of `num_blocks` blocks lies, layer by layer: a numpy
        uint64 array [num_blocks, layers, 2] of (address, length) rows (iovecs), made in one
        step from each layout's offsets (computed once per layout and extent size)."""
        import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

        key = (id(layers), num_blocks)
        cached = self._layout_rows.get(key)
        if cached is None or cached[0] is not layers:
            if len(self._layout_rows) > 256:
                self._layout_rows.clear()
            sizes = np.array([spec.nbytes for spec in layers], dtype=np.uint64)
            starts = np.array(fmt.layer_starts([spec.nbytes for spec in layers]), dtype=np.uint64)
            cached = self._layout_rows[key] = (layers, starts * np.uint64(num_blocks), sizes)
        _, before, sizes = cached
        positions = np.arange(num_blocks, dtype=np.uint64)[:, None]
        rows = np.empty((num_blocks, len(sizes), 2), dtype=np.uint64)
        rows[:, :, 0] = before[None, :] + sizes[None, :] * positions + np.uint64(self.file.address + extent)
        rows[:, :, 1] = sizes[None, :]
        return rows

    def pieces(self, layers: tuple[LayerSpec, ...], extent: int, num_blocks: int, position: int) -> Pieces:
        """Where block `position` of an extent lies, layer by layer (tiers.base.Pieces)."""
        return Pieces(self.extent_rows(layers, extent, num_blocks)[position], self.file)

    def block_pieces(self, placed: Placed) -> Pieces:
        return self.pieces(placed.meta.layers, placed.extent, placed.extent_blocks, placed.position)

    def block(self, placed: Placed) -> StoredBlock:
        view = self.file.view
        offsets = placed.layer_offsets()
        layers = [view[at : at + spec.nbytes] for at, spec in zip(offsets, placed.meta.layers, strict=True)]
        return StoredBlock(placed.meta, layers)

    def stats(self) -> dict[str, int]:
        pinned = sum(e.nbytes for e in self.extents.values() if e.pins)
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
            **vars(self.counters),
        }


def discard_memory_tier(memory_dir: Path, data_dir: Path) -> None:
    """Remove the data directory's arena and its index, if any (after a reboot)."""
    path = fmt.arena_file(memory_dir, data_dir)
    index = fmt.index_path(path)
    if path.exists() or index.exists():
        log.warning("discarding the memory tier %s: it outlived a reboot and was never synced", path)
        path.unlink(missing_ok=True)
        shutil.rmtree(index, ignore_errors=True)


def sweep_memory_dir(memory_dir: Path, data_dir: Path, *, enabled: bool) -> list[arenas.ArenaInfo]:
    """Before the memory tier opens: withdraw `data_dir`'s claim when it runs without
    one (its old arena, if any, is then an orphan), and remove the orphaned arenas of
    `memory_dir` that no live daemon holds (see kvstore.arenas). Returns what went."""
    if not enabled:
        withdraw_arena_claim(data_dir)
    try:
        return arenas.remove_orphans(
            memory_dir, keep=fmt.arena_file(memory_dir, data_dir) if enabled else None
        )
    except OSError as exc:
        log.warning("could not look for orphaned arenas in %s: %s", memory_dir, exc)
        return []


def open_memory_tier(
    memory_dir: Path,
    data_dir: Path,
    size: int,
    store_id: str,
    *,
    lease_seconds: float,
    write_behind_bytes: int,
    group: int | None = None,
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
    return MemoryTier(file, index, lease_seconds, write_behind_bytes)

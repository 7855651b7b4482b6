"""The default persistent tier: LMDB as the index, the payloads in segment files.

    <root>/            the LMDB environment: BLOCKS_DB (a binary record per block:
                       where its payload is, its layers' layout digest, its checksums)
                       and LAYOUTS_DB (each layout once); kvstore.layouts, kvstore.records
    <root>/segments/   preallocated segment files (tiers.segments): a block's layers
                       back to back in one 4 KiB-aligned extent

A write puts the payloads in place first (many blocks at once, from the I/O pool,
gathered straight from the caller's buffers: the arena's extents when writing
behind), then commits all their records in one LMDB transaction: a block is
visible only once its bytes are written, and a crash before the commit leaves an
extent that no record names, which is free space at the next start. A deletion
commits first and frees the extent afterwards, once no read of this process that
may still see it is open (`_read_window`), so no record ever names an extent being rewritten.

Reads for the gRPC path map the segments (page cache, zero-copy, like LMDB's own
map was); loads into the memory tier read with `preadv` straight into the arena's
extents from the pool (`locate` + `read_into`), many blocks at once.

Durability: without `sync`, a returned write is in the page cache (or, written
direct, on the device) and its record committed: it survives a process crash. With
`sync`, the segments written are fdatasynced before the records commit, and the
commit is synced: it survives power loss.

The capacity bound: segment files (created as needed, preallocated) never exceed
`capacity - index_reserve`; the index (LMDB's map) is bounded by `index_reserve`
(1/32 of the capacity, at most 1 GiB, at least 16 MiB where the capacity allows),
its headroom file included. `payload_capacity` is what the store may fill.

A full filesystem: segments are allocated when created (fallocate), so writing
into one never fails for space; a segment that cannot be created is
StorageFullError. The index keeps a headroom file it gives up so that deletions
can commit on a full filesystem.

NOTE: writemap stays off. With MDB_WRITEMAP a full filesystem turns into a SIGBUS
inside the daemon instead of an error we can answer with.

NOTE: over 500 lines: the backend is the ordering between LMDB transactions and
segment extents (payload before record, delete committed before its extent is freed,
a freed extent held while reads that may see it are open, headroom given up so
deletions commit); split, the record side and the extent side would each need the
other's locks and sequence numbers.
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import lmdb

from kvstore import records
from kvstore.arena_format import layer_starts
from kvstore.blocks import Layout, per_layout
from kvstore.layouts import (
    BLOCKS_DB,
    FORMAT_KEY,
    LAYOUTS_DB,
    LMDB_FORMAT,
    LMDB_MAX_DBS,
    LMDB_MAX_READERS,
    SEGMENTS_DIR,
    LayoutReader,
    read_lmdb_record,
    split_layers,
)
from kvstore.layouts import lmdb_key as _key
from kvstore_server.tiers.base import (
    NO_SPACE,
    Backend,
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    Located,
    Pieces,
    StorageError,
    StorageFullError,
    StoredBlock,
)
from kvstore_server.tiers.iopool import IOPool
from kvstore_server.tiers.segments import Segments, aligned, segment_size_for

log = logging.getLogger(__name__)

_SEGMENT_BYTES_KEY = b"segment-bytes"  # in the main database
_HEADROOM_BYTES = 8 << 20
_DELETE_BATCH = 1024
_FULL_SLACK = 1 << 20
_MIN_INDEX_BYTES = 16 << 20
_MAX_INDEX_BYTES = 1 << 30
SMALL_CAPACITY = 256 << 20
_SMALL_MAP_BYTES = 1 << 30  # sparse: address space, not disk


def index_reserve(capacity: int) -> int:
    """Bytes of the capacity set aside for the index (its map and headroom): 1/32 of it,
    at least 16 MiB, at most 1 GiB. None below SMALL_CAPACITY: a store that small
    (tests, trials) bounds its payloads only."""
    if capacity < SMALL_CAPACITY:
        return 0
    return min(_MAX_INDEX_BYTES, max(_MIN_INDEX_BYTES, capacity // 32))


@contextmanager
def _reading() -> Iterator[None]:
    """LMDB errors of a read as StorageError (never around a caller's code)."""
    try:
        yield
    except lmdb.Error as exc:
        raise StorageError(f"LMDB read failed: {exc}") from exc


class LmdbBackend(Backend):
    name = "lmdb"

    def __init__(
        self,
        path: Path,
        *,
        capacity_bytes: int,
        sync: bool,
        direct: bool | None = None,
        io: IOPool | None = None,
        segment_bytes: int | None = None,
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._path = path
        reserve = index_reserve(capacity_bytes)
        self._discard_older_layout(path)
        try:
            self._env = lmdb.open(
                str(path),
                map_size=reserve - self._headroom_bytes(reserve) if reserve else _SMALL_MAP_BYTES,
                max_dbs=LMDB_MAX_DBS,
                sync=sync,
                metasync=sync,
                readahead=False,
                max_readers=LMDB_MAX_READERS,
            )
            self._clear_stale_readers()
            self._blocks = self._env.open_db(BLOCKS_DB)
            self._layouts = self._env.open_db(LAYOUTS_DB)
            with self._env.begin(write=True) as txn:
                txn.put(FORMAT_KEY, LMDB_FORMAT)
                stored = txn.get(_SEGMENT_BYTES_KEY)
                if stored is not None:  # the files' size stays what it was made with
                    segment_bytes = int(stored)
                else:
                    segment_bytes = segment_bytes or segment_size_for(capacity_bytes - reserve)
                    txn.put(_SEGMENT_BYTES_KEY, str(segment_bytes).encode())
        except lmdb.Error as exc:
            raise StorageError(f"cannot open {path}: {type(exc).__name__}: {exc}") from exc
        self.segments = Segments(
            path / SEGMENTS_DIR, max_bytes=capacity_bytes - reserve, segment_bytes=segment_bytes,
            direct=direct, sync=sync,
        )  # fmt: skip
        self.payload_capacity = self.segments.max_bytes
        self._own_io = io is None
        self.io = io if io is not None else IOPool()
        self.io_threads = self.io.threads
        self._known_layouts: set[bytes] = set()
        self._layer_starts: dict[int, tuple[tuple[LayerSpec, ...], list[int]]] = {}
        self._maps: dict[int, mmap.mmap] = {}  # segment -> a read-only mapping (read())
        self._retired: list[mmap.mmap] = []
        self._maps_lock = threading.Lock()
        collecting = gc.isenabled()
        gc.disable()  # a record per block becomes an object: no full collections meanwhile
        try:
            self._recovered: list[BlockMeta] | None = self._recover()
        finally:
            if collecting:
                gc.enable()
        self.segments.recovered()
        _allocate(path / "lock.mdb")
        self._headroom = Headroom(path / "headroom", self._headroom_bytes(reserve))
        self._headroom.fill()
        # Extents freed while reads that may still use them are open wait here: a read
        # registers the sequence number it started at; a free, the number it happened at.
        self._reads_lock = threading.Lock()
        self._seq = 0
        self._open_reads: dict[int, int] = {}  # token -> the sequence number it began at
        self._tokens = itertools.count()
        self._freed: list[tuple[int, int, int, int]] = []  # (seq, segment, offset, nbytes)

    @staticmethod
    def _headroom_bytes(reserve: int) -> int:
        return min(_HEADROOM_BYTES, reserve // 4) if reserve else _HEADROOM_BYTES

    @staticmethod
    def _discard_older_layout(path: Path) -> None:
        """An environment of the layout before segments (payloads inside LMDB) is removed:
        the store starts empty (a cache may forget), and its disk space comes back."""
        data = path / "data.mdb"
        if not data.exists() or (path / SEGMENTS_DIR).exists():
            return
        try:
            env = lmdb.open(str(path), readonly=True, max_dbs=LMDB_MAX_DBS, lock=False)
            with env.begin() as txn:
                current = txn.get(FORMAT_KEY) == LMDB_FORMAT
            env.close()
        except lmdb.Error as exc:
            log.warning("unreadable LMDB environment in %s (%s): starting it empty", path, exc)
            current = False
        if current:
            return
        size = data.stat().st_size
        log.warning(
            "the persistent tier in %s has the older layout (payloads inside LMDB, %d MB): "
            "removed; the store starts empty",
            path,
            size // 10**6,
        )
        for name in ("data.mdb", "lock.mdb", "headroom"):
            (path / name).unlink(missing_ok=True)

    def _clear_stale_readers(self) -> None:
        # A reader slot left by a killed process (the daemon's own, or a same-host
        # client's) would pin old pages, so the map fills although the data fits.
        stale = self._env.reader_check()
        if stale:
            log.info("cleared %d stale LMDB reader slots", stale)

    # ---- the index at start
    def _recover(self) -> list[BlockMeta]:
        """At open: every record, its extent taken from the free space; records whose
        extents are not valid (overlapping, outside the segments) are dropped."""
        bad: list[bytes] = []
        found: list[BlockMeta] = []
        claims: list[tuple[int, int, int, bytes, BlockMeta]] = []
        with self._env.begin(buffers=True) as txn:
            layouts: dict[bytes, tuple[LayerSpec, ...]] = {}
            for digest, raw in txn.cursor(db=self._layouts):
                try:
                    layouts[bytes(digest)] = Layout.parse(raw)
                    self._known_layouts.add(bytes(digest))
                except (ValueError, TypeError) as exc:
                    log.warning("skipping an unreadable layout record: %s", exc)
            for key, raw in txn.cursor(db=self._blocks):
                try:
                    record = records.parse(bytes(key), raw, layouts)
                except (*records.BAD_RECORD, StorageError) as exc:
                    log.warning("dropping an unreadable block record %s: %s", bytes(key).hex(), exc)
                    bad.append(bytes(key))
                    continue
                claims.append((record.where[1], record.where[0], record.where[2], bytes(key), record.meta))
        # NOTE: in extent order, not key order: claims in a random order split the free list
        # into many runs, each insert O(runs) (a million blocks took 21 s in key order, 1.5 s so)
        claims.sort(key=lambda c: (c[0], c[1]))
        for segment, offset, nbytes, record_key, meta in claims:
            if nbytes != meta.size or not self.segments.claim(segment, offset, nbytes):
                log.warning("block %s: its extent is not valid; dropped", meta.block_hash.hex())
                bad.append(record_key)
                continue
            found.append(meta)
        if bad:
            with self._env.begin(write=True) as txn:
                for bad_key in bad:
                    txn.delete(bad_key, db=self._blocks)
        return found

    def scan(self) -> Iterator[BlockMeta]:
        if self._recovered is not None:  # the daemon's scan at start: what open found
            found, self._recovered = self._recovered, None
            yield from found
            return
        with self._env.begin(buffers=True) as txn:
            reader = LayoutReader(txn, self._layouts)
            for key, raw in txn.cursor(db=self._blocks):
                try:
                    yield records.parse(bytes(key), raw, reader).meta
                except (*records.BAD_RECORD, StorageError) as exc:
                    log.warning("skipping an unreadable block record %s: %s", bytes(key).hex(), exc)

    # ---- writes
    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then store `puts`: payloads written in parallel, then every
        record in one transaction (all or none of the puts become visible)."""
        placed: list[_Placed] = []
        self._recovered = None  # what open found is stale now: a scan reads the index
        try:
            if deletes:
                self._delete(deletes)
            if not puts:
                return
            # each block's size once (BlockMeta.size looks its layout up: write-behind spent
            # a third of its Python asking it again at each step)
            sizes = [block.meta.size for block in puts]
            buffers = [_buffers(block) for block in puts]
            for block, size, bufs in zip(puts, sizes, buffers, strict=True):
                got = _nbytes(bufs)
                if got != size:
                    raise StorageError(
                        f"block {block.meta.block_hash.hex()}: {got} bytes for a record of {size}"
                    )
            writes: list[_Read] = []
            for start, stop in _batches(sizes):
                extents = self.segments.allocate_run(sizes[start:stop])
                batch = [
                    _Placed(puts[i], segment, offset, sizes[i])
                    for i, (segment, offset) in zip(range(start, stop), extents, strict=True)
                ]
                placed.extend(batch)
                # blocks placed back to back go as one request (see _batches)
                writes += _coalesced(
                    [
                        (p.segment, p.offset, p.size, buffers[i])
                        for i, p in zip(range(start, stop), batch, strict=True)
                    ]
                )
            issued = time.perf_counter()
            futures = self.io.submit_many(
                [(nbytes, functools.partial(self._write, segment, offset, bufs))
                 for segment, offset, nbytes, bufs in writes]
            )  # fmt: skip
            _wait(futures)
            wrote = time.perf_counter()
            if self.segments.sync:
                self.segments.flush()
            synced = time.perf_counter()
            replaced = self._commit(placed)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%d blocks: %d writes in %.1f ms, fdatasync %.1f ms, records %.1f ms",
                          len(puts), len(writes), (wrote - issued) * 1e3, (synced - wrote) * 1e3,
                          (time.perf_counter() - synced) * 1e3)  # fmt: skip
        except (StorageError, lmdb.Error, OSError) as exc:
            for done in placed:
                self.segments.free(done.segment, done.offset, done.size)
            if isinstance(exc, StorageError):
                raise
            if isinstance(exc, lmdb.MapFullError) or self._full(exc, puts):
                raise StorageFullError(f"the index of {self._path} is full ({exc})") from exc
            raise StorageError(f"LMDB write failed: {exc}") from exc
        self._free(replaced)

    def _commit(self, placed: Sequence[_Placed]) -> list[records.Record]:
        """Record `placed` in one transaction; returns the records it replaced (re-puts)."""
        replaced: list[records.Record] = []
        items = []
        layouts: dict[bytes, bytes] = {}
        for block, segment, offset, size in placed:
            raw, layout = records.pack((offset, segment, size), block.meta)
            if layout.digest not in self._known_layouts:
                layouts[layout.digest] = layout.record
            items.append((_key(*block.meta.key), raw))
        with self._env.begin(write=True, buffers=True) as txn:
            for digest, layout_record in layouts.items():
                txn.put(digest, layout_record, db=self._layouts)
            for key, _ in items:
                old = txn.get(key, db=self._blocks)
                if old is not None:
                    replaced.append(self._parse(txn, key, old))
            txn.cursor(db=self._blocks).putmulti(items)
        self._known_layouts.update(layouts)
        return replaced

    def _parse(self, txn: lmdb.Transaction, key: bytes, raw: bytes | memoryview) -> records.Record:
        return records.parse(key, raw, LayoutReader(txn, self._layouts))

    def _delete(self, keys: Sequence[BlockKey], *, bump: bool = False) -> None:
        """Commit deletions in batches, then free their extents. On a full filesystem the
        headroom is given up to let them commit, then refilled."""
        released = False
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            try:
                gone = self._delete_batch(batch)
            except lmdb.Error as exc:
                if released or not self._full(exc, ()) or not self._headroom.release():
                    raise
                released = True
                log.warning("the filesystem of %s is full: deletions commit in the headroom", self._path)
                gone = self._delete_batch(batch)
            self._free(gone)
        if released:
            self._headroom.fill()

    def _delete_batch(self, keys: Sequence[BlockKey]) -> list[records.Record]:
        gone = []
        with self._env.begin(write=True, buffers=True) as txn:
            for key in keys:
                raw_key = _key(*key)
                raw = txn.get(raw_key, db=self._blocks)
                if raw is None:
                    continue
                try:
                    gone.append(self._parse(txn, raw_key, raw))
                except (*records.BAD_RECORD, StorageError) as exc:
                    log.warning("deleting an unreadable record %s: %s", raw_key.hex(), exc)
                txn.delete(raw_key, db=self._blocks)
        return gone

    def _free(self, gone: Sequence[records.Record]) -> None:
        if not gone:
            return
        with self._reads_lock:
            for record in gone:
                offset, segment, nbytes = record.where
                self._freed.append((self._seq, segment, offset, nbytes))
            self._seq += 1
            self._release_freed()

    def room_returning(self) -> bool:
        """Extents freed while reads were open wait for those reads to end (_release_freed)."""
        with self._reads_lock:
            self._release_freed()
            return bool(self._freed)

    def _release_freed(self) -> None:
        """Hand to the segments the extents no open read can see (caller holds _reads_lock)."""
        oldest = min(self._open_reads.values(), default=self._seq + 1)
        keep = []
        for entry in self._freed:
            seq, segment, offset, nbytes = entry
            if seq < oldest:
                self.segments.free(segment, offset, nbytes)
            else:
                keep.append(entry)
        self._freed = keep

    def delete(self, keys: Sequence[BlockKey]) -> None:
        try:
            self._delete(keys)
        except lmdb.Error as exc:
            raise StorageError(f"LMDB delete failed: {exc}") from exc

    def _full(self, exc: BaseException, puts: Sequence[BlockWrite]) -> bool:
        """Whether a failed commit ran out of room (the map, or the filesystem)."""
        if isinstance(exc, lmdb.MapFullError):
            return True
        wanted = sum(aligned(block.meta.size) for block in puts) + _FULL_SLACK
        try:
            return _free_bytes(self._path) < wanted
        except OSError:
            return False

    def relocate(self) -> list[BlockKey]:
        """After a restart with a smaller capacity (the store has evicted down to it): move
        the blocks recorded beyond the segments' usable space into free space within it,
        then cut the files, so the capacity bounds the disk again. Blocks that find no
        room are dropped; returns their keys (the store forgets them). At start only."""
        if not self.segments.bytes_beyond:
            return []
        moves: list[tuple[bytes, records.Record]] = []
        with self._env.begin(buffers=True) as txn:
            reader = LayoutReader(txn, self._layouts)
            for raw_key, value in txn.cursor(db=self._blocks):
                try:
                    record = records.parse(bytes(raw_key), value, reader)
                except (*records.BAD_RECORD, StorageError):
                    continue
                offset, segment, nbytes = record.where
                if self.segments.beyond(segment, offset, nbytes):
                    moves.append((bytes(raw_key), record))
        dropped: list[BlockKey] = []
        moved = 0
        for key, record in moves:
            offset, segment, nbytes = record.where
            try:
                to_segment, to_offset = self.segments.allocate(nbytes)
            except StorageFullError:
                to_segment = -1
            with self._env.begin(write=True) as txn:
                if to_segment < 0:
                    txn.delete(key, db=self._blocks)
                    dropped.append(record.meta.key)
                else:
                    buf = memoryview(bytearray(nbytes))
                    self.segments.read(segment, offset, [buf])
                    self.segments.write(to_segment, to_offset, [buf])
                    packed, _ = records.pack((to_offset, to_segment, nbytes), record.meta, record.sums)
                    txn.put(key, packed, db=self._blocks)
                    moved += 1
            self.segments.free(segment, offset, nbytes)
        self.segments.trim()
        log.info(
            "the capacity shrank: moved %d blocks inside it, dropped %d that found no room",
            moved,
            len(dropped),
        )
        return dropped

    # ---- reads
    @contextmanager
    def _read_window(self) -> Iterator[None]:
        """While open, no extent freed after it began is reused."""
        with self._reads_lock:
            token = next(self._tokens)
            self._open_reads[token] = self._seq
        try:
            yield
        finally:
            with self._reads_lock:
                del self._open_reads[token]
                self._release_freed()

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        """Views of the blocks where they lie: the segment files mapped read-only (page
        cache; a Get of 65536 blocks copies none of them into the daemon's heap), valid
        inside the context, whose extents are not reused meanwhile. A block whose extent
        lies past its file's end (a file cut short: a failing or tampered disk) is None,
        logged, never touched: a mapped page past the end would be a SIGBUS."""
        with self.locate(keys) as found:
            sizes: dict[int, int] = {}
            blocks: list[StoredBlock | None] = []
            for record in found:
                if record is None:
                    blocks.append(None)
                    continue
                offset, segment, nbytes = record.where
                size = sizes.get(segment)
                if size is None:
                    size = sizes[segment] = self.segments.file_size(segment)
                data = self._mapped(segment, size, offset, nbytes) if offset + nbytes <= size else None
                views = split_layers(data, record.meta) if data is not None else None
                if views is None:
                    log.warning(
                        "block %s: its extent lies past its segment's end", record.meta.block_hash.hex()
                    )
                blocks.append(StoredBlock(record.meta, views) if views is not None else None)
            yield blocks

    def _mapped(self, segment: int, size: int, offset: int, nbytes: int) -> memoryview | None:
        """A read-only view of a segment's bytes, mapped once per segment (again when the file
        is longer than the mapping: a segment made or grown since)."""
        with self._maps_lock:
            m = self._maps.get(segment)
            if m is None or len(m) < offset + nbytes:
                try:
                    m = mmap.mmap(self.segments.fd(segment), size, mmap.MAP_SHARED, mmap.PROT_READ)
                except (OSError, ValueError) as exc:
                    log.warning("cannot map segment %d: %s", segment, exc)
                    return None
                old, self._maps[segment] = self._maps.get(segment), m
                if old is not None:
                    self._retired.append(old)  # views of it may still be in use: closed at close()
        return memoryview(m)[offset : offset + nbytes]

    @contextmanager
    def locate(self, keys: Sequence[BlockKey]) -> Iterator[list[records.Record | None]]:
        """The records of `keys` (None where absent); their extents are not reused while
        the context is open, so reads of them (`read_into`) may run inside it."""
        with self._read_window():
            with _reading(), self._env.begin(buffers=True) as txn:
                layouts = LayoutReader(txn, self._layouts)
                found = [read_lmdb_record(txn, self._blocks, self._layouts, key, layouts) for key in keys]
            yield found

    def read_into(
        self, handle: Located, target: Pieces | list[memoryview], layers: range | None = None
    ) -> Future[None]:
        """Read a block's payload into `target` (one buffer per layer, in order, wherever
        they lie), of `layers` only when given (a contiguous part of the payload; `target`
        then holds buffers for those layers alone), on the I/O pool. The future raises
        StorageError when the read fails."""
        return self.read_batches([[(handle, target)]], layers)[0]

    def read_batches(
        self,
        batches: Sequence[Sequence[tuple[Located, Pieces | list[memoryview]]]],
        layers: range | None = None,
    ) -> list[Future[None]]:
        """read_into for batches of blocks, every batch planned before the first is issued,
        each one task of the I/O pool: one preadv per run of blocks that lie back to back
        in a segment (and in memory: one range of a promotion)."""
        planned = [_coalesced([self._plan_read(handle, target, layers) for handle, target in reads])
                   for reads in batches]  # fmt: skip
        return self.io.submit_many([self._task(reads) for reads in planned])

    def _write(self, segment: int, offset: int, buffers: _Rows | list[memoryview]) -> None:
        """One write request (an I/O pool task): its iovec made here, off the caller's thread."""
        self.segments.write(segment, offset, _iovec(buffers) if isinstance(buffers, _Rows) else buffers)

    def _task(self, planned: list[_Read]) -> tuple[int, Callable[[], None]]:
        def run() -> None:
            for segment, offset, _, buffers in planned:
                iov = _iovec(buffers) if isinstance(buffers, _Rows) else buffers
                self.segments.read(segment, offset, iov)

        return sum(nbytes for _, _, nbytes, _ in planned), run

    def _plan_read(self, handle: Located, target: Pieces | list[memoryview], layers: range | None) -> _Read:
        """(segment, offset, bytes, buffers) of one block's read: the target's iovec rows as
        Python ints (_Rows; made a numpy iovec on the I/O thread), or its buffers. Raises
        ValueError (TypeError) when the buffers do not match the block (do not come from
        this backend)."""
        if not isinstance(handle, records.Record):
            raise TypeError(f"not a record of this backend: {type(handle).__name__}")
        offset, segment, nbytes = handle.where
        if layers is not None:
            starts = self._starts(handle.layers)  # one more entry: the block's end
            offset += starts[layers.start]
            nbytes = starts[layers.stop] - starts[layers.start]
        buffers: _Rows | list[memoryview]
        if isinstance(target, Pieces):
            # NOTE: plain ints, not numpy scalars: a promotion plans 512 of these before
            # its first read, and numpy's per-call cost was most of that time
            buffers = _Rows(target.iov.tolist())
            got = buffers[0][1] if len(buffers) == 1 else sum(length for _, length in buffers)
            if len(buffers) > 1 and buffers[-1][0] + buffers[-1][1] - buffers[0][0] == got:  # back to back
                buffers = _Rows([[buffers[0][0], got]])
        else:
            buffers = list(target)
            got = sum(v.nbytes for v in buffers)
        if got != nbytes:
            raise ValueError(f"{got} bytes of buffers for {nbytes} bytes of the block")
        return segment, offset, nbytes, buffers

    def _starts(self, layers: tuple[LayerSpec, ...]) -> list[int]:
        """Each layer's offset in a block's payload, and the payload's size last (per layout)."""
        return per_layout(self._layer_starts, layers, _payload_starts)

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        with _reading(), self._env.begin(db=self._blocks) as txn:
            for n, (namespace, block_hash) in enumerate(keys):
                if txn.get(_key(namespace, block_hash)) is None:
                    return n
        return len(keys)

    @property
    def bytes_on_disk(self) -> int:
        """Segment files and the index's files: what the capacity bounds."""
        index = sum(f.stat().st_size for f in self._path.iterdir() if f.is_file())
        return self.segments.bytes_on_disk + index

    def close(self) -> None:
        for m in [*self._maps.values(), *self._retired]:
            try:
                m.close()
            except BufferError:  # a view is still referenced: the mapping goes with it
                log.debug("a segment mapping is still in use at close")
        if self._own_io:
            self.io.close()
        self.segments.close()
        self._env.close()


_IOV_MAX = 1024
# the most bytes one write-behind request moves (a few MiB keep a disk busy; see _write_runs)
RUN_BYTES = 4 << 20


class _Rows(list[list[int]]):
    """A read's iovec rows, [address, length] each, as Python ints."""


_Read = tuple[int, int, int, "_Rows | list[memoryview]"]  # segment, offset, bytes, buffers


def _iovec(rows: _Rows) -> Any:
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


def _coalesced(planned: list[_Read]) -> list[_Read]:
    """Reads (or writes) of extents that follow each other in one segment, merged into one
    preadv (pwritev) each, up to _IOV_MAX buffers (one, where the blocks also lie back to
    back in memory, as a promotion places them): a request's fixed cost is large where
    syscalls are dear (2 MiB reads ran 14 GB/s on a sandboxed H200 host, 256 KiB ones 2-5),
    and blocks written behind together, or promoted together, lie mostly back to back. The
    first of merged entries' buffers are extended in place (each entry's are its own)."""
    out: list[_Read] = []
    for segment, offset, nbytes, buffers in planned:
        if out:
            last_segment, last_offset, last_bytes, last_buffers = out[-1]
            if (
                last_segment == segment
                and last_offset + last_bytes == offset
                and isinstance(last_buffers, _Rows) == isinstance(buffers, _Rows)
                and len(last_buffers) + len(buffers) <= _IOV_MAX
            ):
                if isinstance(last_buffers, _Rows) and isinstance(buffers, _Rows):
                    tail = last_buffers[-1]
                    if tail[0] + tail[1] == buffers[0][0]:  # into memory back to back too
                        tail[1] += buffers[0][1]
                        buffers = _Rows(buffers[1:])
                    last_buffers.extend(buffers)
                elif not isinstance(last_buffers, _Rows) and not isinstance(buffers, _Rows):
                    last_buffers.extend(buffers)
                out[-1] = (segment, last_offset, last_bytes + nbytes, last_buffers)
                continue
        out.append((segment, offset, nbytes, buffers))
    return out


def _payload_starts(layers: tuple[LayerSpec, ...]) -> list[int]:
    sizes = [spec.nbytes for spec in layers]
    return [*layer_starts(sizes), sum(sizes)]


class _Placed(NamedTuple):
    """A block being written: where its extent is, and its size (BlockMeta.size, once)."""

    block: BlockWrite
    segment: int
    offset: int
    size: int


def _batches(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """[start, stop) of consecutive blocks of `sizes` in batches of at most RUN_BYTES, each
    placed back to back where the segments have a run for it (Segments.allocate_run) and
    written as one request (_coalesced): a batch of 64 KiB blocks goes as a few MiB-sized
    requests, not one per block (each request costs the I/O pool's Python, under the GIL
    that the daemon's RPCs wait for: 30-block puts on the 2-core VM spent 2/3 of their time
    waiting behind write-behind's per-block requests)."""
    start, nbytes = 0, 0
    for i, size in enumerate(sizes):
        if i > start and nbytes + size > RUN_BYTES:
            yield start, i
            start, nbytes = i, 0
        nbytes += size
    if start < len(sizes):
        yield start, len(sizes)


def _buffers(block: BlockWrite) -> _Rows | list[memoryview]:
    """What the segments write: the block's rows where it lies in mapped memory (the
    arena), else its buffers."""
    if block.pieces is not None:
        return _Rows(block.pieces.iov.tolist())
    return [v if isinstance(v, memoryview) else memoryview(v) for v in block.layers]


def _nbytes(buffers: _Rows | list[memoryview]) -> int:
    if isinstance(buffers, _Rows):
        return sum(length for _, length in buffers)
    return sum(v.nbytes for v in buffers)


def _wait(futures: Sequence[Future[None]]) -> None:
    """Wait for every future; raise the first failure (after all have finished, so no
    write is still running into an extent that the caller then frees)."""
    error: BaseException | None = None
    for future in futures:
        exc = future.exception()
        if exc is not None and error is None:
            error = exc
    if error is not None:
        raise error


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _allocate(path: Path) -> None:
    """Give `path`'s holes real blocks (its bytes stay as they are)."""
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("could not allocate %s (%s): on a full tmpfs, readers may crash", path, exc)


class Headroom:
    """A file of reserved filesystem space, given up so that deletions can commit on a
    full filesystem. `fill` takes up to `size` bytes, less when less is free."""

    _MIN_BYTES = 64 << 10

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size

    def held(self) -> int:
        try:
            return os.stat(self.path).st_blocks * 512
        except FileNotFoundError:
            return 0

    def fill(self) -> None:
        want = self.size
        while want >= self._MIN_BYTES and self.held() < want:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    os.posix_fallocate(fd, 0, want)
                finally:
                    os.close(fd)
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    log.warning("cannot reserve headroom in %s: %s", self.path, exc)
                    return
                want //= 2
        if self.size >= self._MIN_BYTES and self.held() < self.size:
            log.warning(
                "only %d of %d bytes of headroom reserved in %s: the filesystem is nearly full",
                self.held(),
                self.size,
                self.path,
            )

    def release(self) -> bool:
        """Free the reserved space; False when there was none to free."""
        had = self.held()
        self.path.unlink(missing_ok=True)
        return had > 0

"""The default backend: one embedded LMDB environment holding metadata and data.

Two named databases share one environment so a block's metadata and bytes are
written in the same transaction: a block is either wholly visible or absent,
after any crash. Keys and database names: kvstore.layouts.

NOTE: writemap stays off. With MDB_WRITEMAP a full filesystem turns into a
SIGBUS inside the daemon instead of an error we can answer with.

A full filesystem: LMDB reports it as a failed commit (EIO after a short
write, or ENOSPC), which is told apart from a failing disk by the free space
left. Freed pages are reused, so deletions make room; but a deletion needs a
few new pages itself (copied B-tree pages, the free list), and a packed file on
a full filesystem has none. So the backend keeps a headroom file of reserved
space beside the environment and gives it up to let deletions commit, then
takes back what is left. The lock file, which readers write through a shared
mapping, is allocated up front: touching an unallocated page of it on a full
tmpfs would be a SIGBUS.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb

from kvstore.layouts import BAD_RECORD, DATA_DB, LMDB_MAX_DBS, LMDB_MAX_READERS, META_DB, read_lmdb_block
from kvstore.layouts import lmdb_key as _key
from kvstore.memory import drop_mapped_pages
from kvstore_server.tiers.base import (
    NO_SPACE,
    Backend,
    BlockKey,
    BlockMeta,
    BlockWrite,
    StorageError,
    StorageFullError,
    StoredBlock,
)

log = logging.getLogger(__name__)

# LMDB needs room beyond the payload: B-tree pages, per-value page rounding and
# free pages that a long reader keeps pinned. The map is sparse, so a generous
# size costs address space, not disk.
_MAP_OVERHEAD_FACTOR = 2
_MAP_MIN_BYTES = 1 << 30


# Never a block key: those hold a 32-byte hash after the namespace.
_BUMP_KEY = b"\x00\x00"
_MAX_READERS = LMDB_MAX_READERS
# Reserved space for deletions on a full filesystem: each deleted page costs 8 bytes of
# free list, so a batch of _DELETE_BATCH blocks of up to 8 MiB needs well under this.
_HEADROOM_BYTES = 8 << 20
_DELETE_BATCH = 256
# A failed commit with less free space than it wanted to write, plus this, is a full disk.
_FULL_SLACK = 1 << 20
# Payload per write transaction: bounds the memory LMDB holds for uncommitted pages.
_TXN_BYTES = 64 << 20
# Writes fault in pages of the map (see release_memory): unmap them every so many bytes.
_UNMAP_EVERY = 64 << 20


@contextmanager
def _reading() -> Iterator[None]:
    """LMDB errors of a read as StorageError (never around a caller's code)."""
    try:
        yield
    except lmdb.Error as exc:
        raise StorageError(f"LMDB read failed: {exc}") from exc


class LmdbBackend(Backend):
    name = "lmdb"

    def __init__(self, path: Path, *, capacity_bytes: int, sync: bool) -> None:
        path.mkdir(parents=True, exist_ok=True)
        map_size = max(_MAP_MIN_BYTES, capacity_bytes * _MAP_OVERHEAD_FACTOR)
        self._readonly = False
        try:
            self._env = lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=LMDB_MAX_DBS,
                sync=sync,
                metasync=sync,
                readahead=False,
                max_readers=_MAX_READERS,
            )
            self._clear_stale_readers()
            self._meta = self._env.open_db(META_DB)
            self._data = self._env.open_db(DATA_DB)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open {path}: {type(exc).__name__}: {exc}") from exc
        self._path = path
        self._unmapped_after = _UNMAP_EVERY
        _allocate(path / "lock.mdb")
        self._headroom = Headroom(path / "headroom", _HEADROOM_BYTES)
        self._headroom.fill()

    @classmethod
    def reader(cls, path: Path) -> LmdbBackend:
        """Open the environment a daemon is writing, read-only, from another process.

        LMDB is built for this: readers register in the shared lock file (so this
        process needs write access to lock.mdb) and see consistent snapshots while
        the daemon commits. Raises StorageError if the environment cannot be opened.
        """
        self = cls.__new__(cls)
        self._readonly = True
        try:
            self._env = lmdb.open(
                str(path),
                readonly=True,
                create=False,
                max_dbs=LMDB_MAX_DBS,
                readahead=False,
                max_readers=_MAX_READERS,
            )
            # Map as much as the daemon does (its size is in the file), so its growth
            # never needs a remap here while reads are running.
            self._env.set_mapsize(0)
            self._meta = self._env.open_db(META_DB, create=False)
            self._data = self._env.open_db(DATA_DB, create=False)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open {path} for reading: {type(exc).__name__}: {exc}") from exc
        return self

    def _clear_stale_readers(self) -> None:
        # A reader slot left by a killed process (the daemon's own, or a same-host
        # client's) would pin old pages, so the map fills although the data fits.
        stale = self._env.reader_check()
        if stale:
            log.info("cleared %d stale LMDB reader slots", stale)

    def scan(self) -> Iterator[BlockMeta]:
        with self._env.begin(db=self._meta, buffers=True) as txn:
            for key, raw in txn.cursor():
                try:
                    yield BlockMeta.from_json(raw)
                except BAD_RECORD as exc:
                    log.warning("skipping unreadable metadata record %s: %s", bytes(key).hex(), exc)

    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete, then store `puts`, in transactions of at most _TXN_BYTES of payload
        (LMDB keeps a transaction's new pages in memory until it commits). Each block is
        atomic; if a later transaction fails, the blocks of earlier ones are deleted again."""
        if self._readonly:
            raise StorageError("this LMDB environment was opened read-only")
        self._unmapped_after -= sum(block.meta.size for block in puts)
        if self._unmapped_after < 0:
            self._unmapped_after = _UNMAP_EVERY
            self.release_memory()
        try:
            if not puts:
                self._delete(deletes)
                return
            done: list[BlockWrite] = []
            try:
                for batch in _batches(puts, _TXN_BYTES):
                    self._write_batch(batch, () if done else deletes)
                    done.extend(batch)
            except lmdb.Error:
                if done:
                    self._undo(done)
                raise
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.MapFullError):
                raise StorageFullError(f"LMDB map is full: {exc}") from exc
            if self._full(exc, puts):
                raise StorageFullError(f"the filesystem of {self._path} is full ({exc})") from exc
            raise StorageError(f"LMDB write failed: {exc}") from exc

    def _write_batch(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey]) -> None:
        try:
            self._commit(puts, deletes)
            return
        except lmdb.Error as exc:
            if not self._full(exc, puts):
                raise
        self._clear_stale_readers()
        # LMDB reuses the pages a transaction frees only two commits later, and a
        # failed write commits nothing: a store whose puts keep failing would never
        # get its freed room back. Commit the deletions, then one more transaction,
        # and retry the puts once.
        self._delete(deletes, bump=True)
        self._commit(puts, ())

    def _undo(self, blocks: Sequence[BlockWrite]) -> None:
        try:
            self._delete([block.meta.key for block in blocks])
        except lmdb.Error as exc:
            log.error(
                "could not delete %d blocks of a failed put; they return at restart: %s", len(blocks), exc
            )

    def _full(self, exc: lmdb.Error, puts: Sequence[BlockWrite]) -> bool:
        """Whether a failed commit ran out of room (the map, or the filesystem)."""
        if isinstance(exc, lmdb.MapFullError):
            return True
        wanted = sum(block.meta.size for block in puts) + _FULL_SLACK
        try:
            return _free_bytes(self._path) < wanted
        except OSError:
            return False

    def _delete(self, keys: Sequence[BlockKey], *, bump: bool = False) -> None:
        """Commit deletions in batches (each bounds the free-list record it writes); with
        `bump`, one more commit after them, so a put can reuse what they freed. On a full
        filesystem the headroom is given up to let them commit, then refilled."""
        commits = [
            functools.partial(self._commit, (), keys[i : i + _DELETE_BATCH])
            for i in range(0, len(keys), _DELETE_BATCH)
        ]
        if bump:
            commits.append(functools.partial(self._commit, (), (), bump=True))
        released = False
        for commit in commits:
            try:
                commit()
            except lmdb.Error as exc:
                if released or not self._full(exc, ()) or not self._headroom.release():
                    raise
                released = True
                log.warning("the filesystem of %s is full: deletions commit in the headroom", self._path)
                commit()
        if released:
            self._headroom.fill()

    def _commit(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey], bump: bool = False) -> None:
        with self._env.begin(write=True) as txn:
            if bump:  # dirty a page without changing anything, so the commit advances the txn id
                txn.put(_BUMP_KEY, b"", db=self._meta)
                txn.delete(_BUMP_KEY, db=self._meta)
            for namespace, block_hash in deletes:
                key = _key(namespace, block_hash)
                txn.delete(key, db=self._meta)
                txn.delete(key, db=self._data)
            keys = [_key(block.meta.namespace, block.meta.block_hash) for block in puts]
            # NOTE: all metadata first, then all data. Interleaving the small records
            # with the large values made LMDB read ~20% of what it wrote back through
            # its map (measured: resident file pages grew by that much).
            for key, block in zip(keys, puts, strict=True):
                txn.put(key, block.meta.to_json(), db=self._meta)
            for key, block in zip(keys, puts, strict=True):
                data = block.joined if block.joined is not None else b"".join(block.layers)
                txn.put(key, data, db=self._data)

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        # One read transaction: a consistent snapshot, and the views below point
        # straight into the map until it ends.
        with _reading():  # e.g. MapResizedError in a reader after a daemon restart
            txn = self._env.begin(buffers=True)
        with txn:
            blocks: list[StoredBlock | None] = []
            for key in keys:
                with _reading():
                    blocks.append(read_lmdb_block(txn, self._meta, self._data, key))
            yield blocks

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        with _reading(), self._env.begin(db=self._meta) as txn:
            for n, (namespace, block_hash) in enumerate(keys):
                if txn.get(_key(namespace, block_hash)) is None:
                    return n
        return len(keys)

    def release_memory(self) -> None:
        """Unmap the data file's pages from this process: they stay in the page cache
        (LMDB maps the file read-only, so nothing is lost) and are mapped again when read.
        Writes fault pages of the map in (B-tree pages and their neighbours), so over a
        long load most of a large store would otherwise stay resident in the daemon."""
        data_file = str((self._path / "data.mdb").resolve())
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == data_file:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    drop_mapped_pages(start, end - start)

    def close(self) -> None:
        self._env.close()


def _batches(puts: Sequence[BlockWrite], limit: int) -> Iterator[Sequence[BlockWrite]]:
    """Consecutive runs of `puts` of at most `limit` payload bytes (at least one block each)."""
    start = size = 0
    for i, block in enumerate(puts):
        if i > start and size + block.meta.size > limit:
            yield puts[start:i]
            start, size = i, 0
        size += block.meta.size
    yield puts[start:]


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
        if self.held() < self.size:
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

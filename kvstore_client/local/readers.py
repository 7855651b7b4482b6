"""Read-only views of a running daemon's backend files, from another process.

    open_reader(kind, data_dir)   a Reader of the daemon's "lmdb" or "disk" backend
    Reader.read(keys)             context manager: blocks in key order (None: missing)
    Reader.stored_prefix(keys)    how many leading keys are stored, without their data
    Reader.close()                once, after the last read has ended

Built on the layouts of kvstore.layouts alone (never the daemon's code): the
daemon may change how it writes, not what it writes. Checksums are the caller's
(kvstore.blocks.StoredBlock.corrupt_layer or checksum per layer). Raises
kvstore.blocks.StorageError when the files cannot be opened or read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import lmdb

from kvstore.blocks import BlockKey, StorageError, StoredBlock
from kvstore.layouts import (
    BLOCKS_DB,
    LAYOUTS_DB,
    LMDB_MAX_DBS,
    LMDB_MAX_READERS,
    SegmentFiles,
    backend_dir,
    block_path,
    lmdb_key,
    read_block_file,
    read_lmdb_block,
)

log = logging.getLogger(__name__)


class Reader(Protocol):
    def read(self, keys: Sequence[BlockKey]) -> AbstractContextManager[list[StoredBlock | None]]: ...

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int: ...

    def close(self) -> None: ...


def open_reader(kind: str, data_dir: Path) -> Reader:
    """Open the backend `kind` of the daemon whose data directory is `data_dir`.
    Raises StorageError (files cannot be opened) or ValueError (an unknown kind)."""
    root = backend_dir(kind, data_dir)
    if kind == "lmdb":
        return LmdbReader(root)
    return DiskReader(root)


@contextmanager
def _lmdb_errors() -> Iterator[None]:
    """LMDB errors of a read as StorageError (never around a caller's code)."""
    try:
        yield
    except lmdb.Error as exc:
        raise StorageError(f"LMDB read failed: {exc}") from exc


class LmdbReader:
    """The daemon's LMDB index, opened read-only, and its segment files, mapped.

    LMDB is built for this: readers register in the shared lock file (so this
    process needs write access to lock.mdb, and must share the daemon's PID
    namespace) and see consistent snapshots of the index while the daemon commits.
    The payloads are not in the snapshot: the daemon may reuse an extent it freed
    while a read here still uses it, which the caller's checksums catch. LMDB forbids
    opening one environment twice in a process: open it once and share it.
    """

    def __init__(self, path: Path) -> None:
        try:
            self._env = lmdb.open(
                str(path),
                readonly=True,
                create=False,
                max_dbs=LMDB_MAX_DBS,
                readahead=False,
                max_readers=LMDB_MAX_READERS,
            )
        except lmdb.Error as exc:
            raise StorageError(f"cannot open {path} for reading: {type(exc).__name__}: {exc}") from exc
        try:
            # Map as much as the daemon does (its size is in the file), so its growth
            # never needs a remap here while reads are running.
            self._env.set_mapsize(0)
            self._blocks = self._env.open_db(BLOCKS_DB, create=False)
            self._layouts = self._env.open_db(LAYOUTS_DB, create=False)
        except lmdb.Error as exc:
            self._env.close()
            raise StorageError(f"cannot open {path} for reading: {type(exc).__name__}: {exc}") from exc
        self._files = SegmentFiles(path)

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        """One read transaction of the index; the payloads read from the segment files."""
        with _lmdb_errors():  # e.g. MapResizedError after a daemon restart
            txn = self._env.begin(buffers=True)
        with txn:
            blocks: list[StoredBlock | None] = []
            for key in keys:
                with _lmdb_errors():
                    blocks.append(read_lmdb_block(txn, self._blocks, self._layouts, self._files, key))
            yield blocks

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        with _lmdb_errors(), self._env.begin(db=self._blocks) as txn:
            for n, (namespace, block_hash) in enumerate(keys):
                if txn.get(lmdb_key(namespace, block_hash)) is None:
                    return n
        return len(keys)

    def close(self) -> None:
        self._files.close()
        self._env.close()


class DiskReader:
    """The daemon's directory of block files, each mapped read-only while it is read
    (a whole file or none: the daemon renames finished files into place)."""

    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise StorageError(f"{root} is not a directory")
        self._root = root

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        yield [read_block_file(self._root, key) for key in keys]

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        for n, (namespace, block_hash) in enumerate(keys):
            if not block_path(self._root, namespace, block_hash).is_file():
                return n
        return len(keys)

    def close(self) -> None:
        """Nothing to release: every file is closed after it is mapped."""

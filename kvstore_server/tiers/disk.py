"""One safetensors file per block: `<root>/<ns digest>/<hh>/<hash>.safetensors`.

Each file is a valid safetensors file (readable by the `safetensors` library
as-is): one tensor per layer, named by the layer, with the block's metadata
record under `__metadata__["kvstore"]`. Files are written to a temporary name,
optionally fsynced, and renamed into place, so a reader sees a whole block or
none; leftovers of a crash are removed by `scan`.

Paths are derived from hex digests only; the namespace itself lives in the
metadata record. The file layout is defined in kvstore.layouts (same-host clients
read it too).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvstore.layouts import BLOCK_SUFFIX as _SUFFIX
from kvstore.layouts import TMP_SUFFIX as _TMP_SUFFIX
from kvstore.layouts import block_file_header as _header
from kvstore.layouts import block_path, read_block_file
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

_IOV_MAX = 512


class DiskBackend(Backend):
    name = "disk"

    def __init__(self, root: Path, *, sync: bool, readonly: bool = False) -> None:
        self._root = root
        self._sync = sync
        self._readonly = readonly
        if not readonly:
            root.mkdir(parents=True, exist_ok=True)

    def _path(self, namespace: bytes, block_hash: bytes) -> Path:
        return block_path(self._root, namespace, block_hash)

    def scan(self) -> Iterator[BlockMeta]:
        for dirpath, _dirs, files in os.walk(self._root):
            for name in files:
                path = Path(dirpath) / name
                if name.endswith(_TMP_SUFFIX):
                    if not self._readonly:  # a reader may see the daemon's write in progress
                        log.info("removing partial write %s", path)
                        path.unlink(missing_ok=True)
                    continue
                if not name.endswith(_SUFFIX):
                    continue
                try:
                    with open(path, "rb") as f:
                        size = int.from_bytes(f.read(8), "little")
                        if size > os.fstat(f.fileno()).st_size - 8:  # a torn or foreign file
                            raise ValueError("header longer than the file")
                        header = json.loads(f.read(size))
                    yield BlockMeta.from_json(header["__metadata__"]["kvstore"])
                except (OSError, ValueError, KeyError, TypeError, StorageError) as exc:
                    log.warning("skipping unreadable block file %s: %s", path, exc)

    def write(self, puts: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete, then write each block to a temporary name and rename it into place.
        If one fails, the blocks this call already placed are removed again: a failed
        write leaves no file behind to hold space the index does not count."""
        if self._readonly:
            raise StorageError("this disk backend was opened read-only")
        for namespace, block_hash in deletes:
            self._path(namespace, block_hash).unlink(missing_ok=True)
        dirs: set[Path] = set()
        placed: list[Path] = []
        for block in puts:
            path = self._path(block.meta.namespace, block.meta.block_hash)
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, [_header(block.meta), *block.buffers()])
                os.replace(tmp, path)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                for done in placed:
                    done.unlink(missing_ok=True)
                if exc.errno in NO_SPACE:
                    raise StorageFullError(f"no space for {path}: {exc}") from exc
                raise StorageError(f"writing {path} failed: {exc}") from exc
            placed.append(path)
            dirs.add(path.parent)
        if self._sync:
            for directory in dirs:
                fd = os.open(directory, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _write_file(self, path: Path, parts: list[memoryview | bytes]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for start in range(0, len(parts), _IOV_MAX):
                batch = parts[start : start + _IOV_MAX]
                want = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in batch)
                done = os.writev(fd, batch)
                if done != want:  # short write: finish the batch the slow way
                    rest = memoryview(b"".join(batch))[done:]
                    while rest:
                        rest = rest[os.write(fd, rest) :]
            if self._sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        yield [read_block_file(self._root, key) for key in keys]

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        for n, key in enumerate(keys):
            if not self._path(*key).is_file():
                return n
        return len(keys)

    def close(self) -> None:
        """Nothing to release: every file is closed after each call."""

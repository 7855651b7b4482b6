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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    LayerSpec,
    Located,
    Pieces,
    StorageError,
    StorageFullError,
    StoredBlock,
)
from kvstore_server.tiers.iopool import IOPool, read_at

log = logging.getLogger(__name__)

_IOV_MAX = 512


@dataclass(frozen=True, slots=True)
class _BlockFile:
    """A located block (DiskBackend.locate): its record, its open file, and where each
    layer starts in it (one more entry: where the last ends)."""

    meta: BlockMeta
    fd: int
    starts: list[int]

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        return self.meta.layers


class DiskBackend(Backend):
    name = "disk"

    def __init__(self, root: Path, *, sync: bool) -> None:
        self._root = root
        self._sync = sync
        self._io = IOPool()  # loads into the memory tier (read_into)
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, namespace: bytes, block_hash: bytes) -> Path:
        return block_path(self._root, namespace, block_hash)

    def scan(self) -> Iterator[BlockMeta]:
        for dirpath, _dirs, files in os.walk(self._root):
            for name in files:
                path = Path(dirpath) / name
                if name.endswith(_TMP_SUFFIX):
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

    @contextmanager
    def locate(self, keys: Sequence[BlockKey]) -> Iterator[list[_BlockFile | None]]:
        """Each block file opened and its header read (None where missing or unreadable);
        the files stay open inside the context, so an eviction meanwhile (an unlink) does
        not take their bytes from a read_into."""
        found: list[_BlockFile | None] = []
        try:
            for key in keys:
                found.append(self._open_block(key))
            yield found
        finally:
            for handle in found:
                if handle is not None:
                    os.close(handle.fd)

    def _open_block(self, key: BlockKey) -> _BlockFile | None:
        path = self._path(*key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = int.from_bytes(os.pread(fd, 8, 0), "little")
            if size > os.fstat(fd).st_size - 8:  # a torn or foreign file
                raise ValueError("header longer than the file")
            header = json.loads(os.pread(fd, size, 8))
            meta = BlockMeta.from_json(header["__metadata__"]["kvstore"])
            if meta.key != key:
                raise ValueError("the file holds another block")
            if os.fstat(fd).st_size < 8 + size + meta.size:
                raise ValueError("the file is shorter than its layers")
        except (OSError, ValueError, KeyError, TypeError, StorageError) as exc:
            os.close(fd)
            log.warning("unreadable block file %s: %s", path, exc)
            return None
        starts = [8 + size]
        for layer in meta.layers:
            starts.append(starts[-1] + layer.nbytes)
        return _BlockFile(meta, fd, starts)

    def read_into(
        self, handle: Located, target: Pieces | list[memoryview], layers: range | None = None
    ) -> Future[None]:
        """A located block's layers (of `layers`, when given: `target` then holds buffers for
        those alone) read from its file with preadv on the I/O pool, as the LMDB backend's."""
        return self.read_batches([[(handle, target)]], layers)[0]

    def read_batches(
        self,
        batches: Sequence[Sequence[tuple[Located, Pieces | list[memoryview]]]],
        layers: range | None = None,
    ) -> list[Future[None]]:
        """Every batch planned, then each one task of the I/O pool (a preadv per block file)."""
        planned = [[self._plan_read(handle, target, layers) for handle, target in reads] for reads in batches]
        return self._io.submit_many([self._task(reads) for reads in planned])

    @staticmethod
    def _plan_read(
        handle: Located, target: Pieces | list[memoryview], layers: range | None
    ) -> tuple[int, int, int, Any]:
        """(fd, offset, bytes, buffers) of one block's read."""
        if not isinstance(handle, _BlockFile):
            raise TypeError(f"not a block file of this backend: {type(handle).__name__}")
        span = layers if layers is not None else range(len(handle.meta.layers))
        at, end = handle.starts[span.start], handle.starts[span.stop]
        buffers: Any = target.iov if isinstance(target, Pieces) else list(target)
        got = int(buffers[:, 1].sum()) if isinstance(target, Pieces) else sum(v.nbytes for v in buffers)
        if got != end - at:
            raise ValueError(f"{got} bytes of buffers for {end - at} bytes of the block")
        return handle.fd, at, end - at, buffers

    @staticmethod
    def _task(planned: list[tuple[int, int, int, Any]]) -> tuple[int, Callable[[], None]]:
        def run() -> None:
            for fd, at, _, buffers in planned:
                read_at(fd, buffers, at)

        return sum(nbytes for _, _, nbytes, _ in planned), run

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        for n, key in enumerate(keys):
            if not self._path(*key).is_file():
                return n
        return len(keys)

    def close(self) -> None:
        """Stop the I/O pool; every file is closed after each call."""
        self._io.close()

"""The arena file: created, sized and pre-faulted by the daemon (mode 0600 or a group),
its header (kvstore.arena_format) and the daemon's shared mapping; and the start-up
sweeps of a memory directory (an arena that outlived a reboot, orphans of dead daemons)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import shutil
import time
from pathlib import Path

from kvstore import arena_format as fmt
from kvstore import arenas
from kvstore.memory import MADV_POPULATE_WRITE
from kvstore_server.datadir import withdraw_arena_claim
from kvstore_server.tiers.base import NO_SPACE, StorageError

log = logging.getLogger(__name__)


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

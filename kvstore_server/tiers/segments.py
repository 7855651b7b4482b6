"""Segment files: where the persistent tier keeps block payloads.

    <dir>/seg-00000000, seg-00000001, ...   preallocated files of `segment_bytes`

A block's payload (its layers back to back) is one extent of one segment, aligned to
ALIGN bytes; which extent holds which block is recorded in the LMDB index (see
tiers.lmdb), never in the files, so a segment needs no header. Space is handed out
first-fit per segment (tiers.arena.Allocator), and segments are created as they are
needed up to `max_bytes` in all. A freed extent rests for a while before it is handed
out again, unless nothing else has room (a soft quarantine): a same-host client that
found its record a moment earlier may still be reading it. (Reads of this process are
protected for certain by tiers.lmdb, which frees an extent only once no read that may
see it is open.)

I/O runs on an I/O pool (tiers.iopool): each request's buffers are gathered from (or
scattered to) wherever the layers lie, e.g. the arena's layer-major extents: no join, no
heap copy. A batch of blocks is placed back to back where one free run holds it
(allocate_run), so its writes go as a few large requests, not one per block.

Direct I/O: writes use O_DIRECT where the filesystem takes it (probed at open;
tmpfs and some network filesystems do not) and the buffers allow it (every buffer's
address and length a multiple of ALIGN, as the arena's are for the usual KV layer
sizes); buffered otherwise. Direct writes do not fill the page cache with KV that
may never be read again, and their rate is the disk's, not the page cache's. Reads
are buffered: a block read twice comes from the page cache at memory speed.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore_server.tiers.arena import Allocator
from kvstore_server.tiers.base import NO_SPACE, StorageError, StorageFullError
from kvstore_server.tiers.iopool import read_at, write_at

log = logging.getLogger(__name__)

ALIGN = 4096
_REST_S = 10.0  # how long a freed extent rests while other space has room
_MIN_SEGMENT_BYTES = 1 << 20
SMALL_ALIGN = 64  # payloads that are not a multiple of a page: never written direct
MAX_SEGMENT_BYTES = 1 << 30
SMALL_SPACE = 64 << 20


def segment_size_for(space: int) -> int:
    """The segment size for `space` bytes of segments: one segment up to SMALL_SPACE, else
    an eighth of the space, at least SMALL_SPACE and at most MAX_SEGMENT_BYTES."""
    size = space if space <= SMALL_SPACE else min(MAX_SEGMENT_BYTES, max(SMALL_SPACE, space // 8))
    unit = ALIGN if size >= ALIGN else SMALL_ALIGN
    return max(SMALL_ALIGN, size - size % unit)


def alignment(nbytes: int) -> int:
    """A page for payloads of whole pages (direct I/O may move them), else SMALL_ALIGN."""
    return ALIGN if nbytes % ALIGN == 0 else SMALL_ALIGN


def aligned(nbytes: int) -> int:
    """The bytes an extent of `nbytes` takes."""
    unit = alignment(nbytes)
    return -(-nbytes // unit) * unit


def _address(view: memoryview) -> int | None:
    """The buffer's address, or None when it cannot be told (a read-only buffer)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _direct_ok(views: list[memoryview] | Any) -> bool:
    if not isinstance(views, list):  # an iovec array
        iov: Any = views
        return bool((iov % ALIGN == 0).all())
    for view in views:
        if view.nbytes % ALIGN:
            return False
        address = _address(view)
        if address is None or address % ALIGN:
            return False
    return True


class Segments:
    """The segment files of one directory and their free space. Thread-safe."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        segment_bytes: int,
        direct: bool | None = None,
        sync: bool = False,
    ) -> None:
        """`direct`: None probes O_DIRECT and uses it where it works; False never."""
        if segment_bytes % SMALL_ALIGN or segment_bytes <= 0:
            raise ValueError(f"segment size {segment_bytes} is not a positive multiple of {SMALL_ALIGN}")
        # NOTE: numpy is imported here, not at module import: the daemon has blocked its stop
        # signals by now, so the threads numpy's BLAS starts inherit the mask (a thread that
        # did not would take a SIGTERM and die with the process); and the first I/O does
        # not pay for the import.
        import numpy  # noqa: F401

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.sync = sync
        self._resting: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self._usable: list[int] = []  # per segment: extents are handed out below this
        self._beyond: list[int] = []  # per segment: recorded bytes at or above it
        self._lock = threading.Lock()
        self._fds: list[int] = []  # buffered, read-write
        self._direct_fds: list[int | None] = []
        self._free: list[Allocator] = []
        self._dirty: set[int] = set()
        for path in sorted(root.glob("seg-*")):
            index = int(path.name[4:], 16)
            if index != len(self._fds):
                raise StorageError(f"segment files of {root} are not numbered 0.. in order ({path.name})")
            self._open(index)
        want_direct = direct is None or direct
        self.direct = bool(want_direct) and self._probe_direct()
        if direct and not self.direct:
            log.warning("direct I/O is not available in %s: writes go through the page cache", root)
        log.info(
            "persistent tier: %d segments of up to %d MiB (%d MiB of at most %d) in %s, %s writes",
            len(self._fds),
            segment_bytes >> 20,
            sum(self._usable) >> 20,
            max_bytes >> 20,
            root,
            "direct" if self.direct else "buffered",
        )

    # ---- files
    def _path(self, index: int) -> Path:
        return self.root / f"seg-{index:08x}"

    def _open(self, index: int, need: int = 0) -> None:
        """Open segment `index` (creating it when it does not exist: as large as the budget
        and the filesystem allow, at most segment_bytes, at least `need`)."""
        path = self._path(index)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(fd).st_size
        try:
            if size == 0:
                size = self._preallocate(fd, need)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in NO_SPACE:
                raise StorageFullError(
                    f"the filesystem of {self.root} has no room for another segment"
                ) from exc
            raise StorageError(f"cannot create the segment {path}: {exc.strerror}") from exc
        self._fds.append(fd)
        self._direct_fds.append(None)
        self._free.append(Allocator(0, size))  # beyond the usable part: recovered()
        self._usable.append(max(0, min(size, self.segment_bytes, self._budget_left())))
        self._beyond.append(0)

    def _budget_left(self) -> int:
        return max(0, self.max_bytes - sum(self._usable))

    def _preallocate(self, fd: int, need: int) -> int:
        """Allocate a new segment's blocks now (writes into it then never fail for space):
        the budget's worth, halved while the filesystem has less room. Returns its size."""
        want = min(self.segment_bytes, self._budget_left())
        floor = max(need, min(want, _MIN_SEGMENT_BYTES))
        while True:
            try:
                os.posix_fallocate(fd, 0, want)
                return want
            except OSError as exc:
                smaller = (want // 2) - (want // 2) % SMALL_ALIGN
                if exc.errno not in NO_SPACE or smaller < floor or smaller <= 0:
                    raise
                log.debug(
                    "the filesystem of %s is short of room: trying a segment of %d bytes", self.root, smaller
                )
                os.ftruncate(fd, 0)
                want = smaller

    def _probe_direct(self) -> bool:
        """Whether O_DIRECT writes and reads work here: one aligned page written and read
        back in a file of its own."""
        probe = self.root / ".direct-probe"
        buf = mmap.mmap(-1, ALIGN)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except (OSError, AttributeError) as exc:
            log.debug("O_DIRECT refused in %s: %s", self.root, exc)
            return False
        view = memoryview(buf)
        try:
            buf[:8] = b"kvstore!"
            return os.pwritev(fd, [view], 0) == ALIGN and os.preadv(fd, [view], 0) == ALIGN
        except OSError as exc:
            log.debug("O_DIRECT I/O failed in %s: %s", self.root, exc)
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
            view.release()
            buf.close()

    def _direct_fd(self, index: int) -> int:
        fd = self._direct_fds[index]
        if fd is None:
            fd = self._direct_fds[index] = os.open(self._path(index), os.O_RDWR | os.O_DIRECT)
        return fd

    # ---- space
    def claim(self, segment: int, offset: int, nbytes: int) -> bool:
        """Mark a recorded extent used (at start); False if it overlaps another or lies
        outside the segments (the record is then dropped)."""
        with self._lock:
            if segment >= len(self._free) or not self._free[segment].claim(offset, aligned(nbytes)):
                return False
            if offset + aligned(nbytes) > self._usable[segment]:
                self._beyond[segment] += aligned(nbytes)
            return True

    def recovered(self) -> None:
        """After the claims at start: the space beyond each segment's usable part (the
        capacity shrank since the files were made) is never handed out again; a trailing
        segment with nothing recorded there is cut to its usable part (removed when none)."""
        with self._lock:
            for index, free in enumerate(self._free):
                end = free.total
                usable = self._usable[index]
                for start, length in list(free.runs()):
                    lo, hi = max(start, usable), min(start + length, end)
                    if lo < hi:
                        free.claim(lo, hi - lo)
        self.trim()

    def beyond(self, segment: int, offset: int, nbytes: int) -> bool:
        """Whether an extent lies (partly) beyond its segment's usable space."""
        return offset + aligned(nbytes) > self._usable[segment]

    @property
    def bytes_beyond(self) -> int:
        """Recorded bytes beyond the usable space (the capacity shrank; see relocate)."""
        with self._lock:
            return sum(self._beyond)

    def trim(self) -> None:
        """Cut trailing segments with nothing recorded beyond their usable space to that
        space (removing those with none). Only at start, before any reader maps them."""
        with self._lock:
            while self._fds and self._beyond[-1] == 0:
                index = len(self._fds) - 1
                if self._usable[index] == 0:
                    os.close(self._fds.pop())
                    dfd = self._direct_fds.pop()
                    if dfd is not None:
                        os.close(dfd)
                    self._free.pop()
                    self._usable.pop()
                    self._beyond.pop()
                    self._path(index).unlink(missing_ok=True)
                    log.info("removed segment %d: the capacity no longer covers it", index)
                    continue
                if os.fstat(self._fds[index]).st_size > self._usable[index]:
                    os.ftruncate(self._fds[index], self._usable[index])
                    log.info("cut segment %d to %d bytes: the capacity shrank", index, self._usable[index])
                break

    def allocate(self, nbytes: int, *, rested_only: bool = False) -> tuple[int, int]:
        """(segment, offset) of a free extent for `nbytes`, creating a segment when none has
        room. Raises StorageFullError when the segments are full to `max_bytes`.
        `rested_only`: not from extents still resting either (allocate_run's try at one run
        for a batch must not end their rest when its blocks fit elsewhere one by one)."""
        size = aligned(nbytes)
        if size > self.segment_bytes:
            raise StorageFullError(
                f"a block of {nbytes} bytes is larger than a segment ({self.segment_bytes})"
            )
        with self._lock:
            unit = alignment(nbytes)
            self._wake(time.monotonic())
            found = self._first_fit(size, unit)
            if found is not None:
                return found
            full: StorageFullError | None = None
            if self._budget_left() >= size:
                try:
                    self._open(len(self._fds), size)
                except StorageFullError as exc:  # the filesystem has no room for one
                    full = exc
                else:
                    offset = self._free[-1].allocate(size, unit)
                    if offset is None:  # cannot happen: a fresh segment holds any extent that fits
                        raise StorageError("a new segment has no room")
                    return len(self._fds) - 1, offset
            if self._resting and not rested_only:  # nothing else has room: the rest ends
                self._wake(float("inf"))
                found = self._first_fit(size, unit)
                if found is not None:
                    return found
            if full is not None:
                raise full
            raise StorageFullError(f"the persistent tier's {self.max_bytes} bytes of segments are full")

    def allocate_run(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """(segment, offset) of an extent for each of `sizes`: back to back in one segment
        where one free run holds them all and every size is whole pages (so each extent
        stays page-aligned for direct I/O); else each where it fits (allocate). Raises
        StorageFullError as allocate does, having given back what it took."""
        total = sum(sizes)
        if len(sizes) > 1 and total <= self.segment_bytes and all(n % ALIGN == 0 for n in sizes):
            try:
                segment, offset = self.allocate(total, rested_only=True)
            except StorageFullError:  # no free run holds them all: smaller holes may, one by one
                log.debug("no free run of %d bytes for %d blocks: placing them one by one", total, len(sizes))
            else:
                out = []
                for nbytes in sizes:
                    out.append((segment, offset))
                    offset += nbytes
                return out
        taken: list[tuple[int, int]] = []
        try:
            for nbytes in sizes:
                taken.append(self.allocate(nbytes))
        except StorageFullError:
            for (segment, offset), nbytes in zip(taken, sizes, strict=False):
                self.free(segment, offset, nbytes)
            raise
        return taken

    def free(self, segment: int, offset: int, nbytes: int) -> None:
        """Give an extent back (reusable at once, but for any part beyond the segment's
        usable space: that stays out of use)."""
        size = aligned(nbytes)
        with self._lock:
            usable = self._usable[segment]
            if offset + size > usable:
                self._beyond[segment] -= size
                size = max(0, usable - offset)
            if size:
                self._resting.append((time.monotonic() + _REST_S, segment, offset, size))

    @property
    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(os.fstat(fd).st_size for fd in self._fds)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            unmade = self._budget_left()
            resting = sum(entry[3] for entry in self._resting)
            return sum(f.free_bytes for f in self._free) + resting + unmade

    def _first_fit(self, size: int, unit: int) -> tuple[int, int] | None:
        for index, free in enumerate(self._free):
            offset = free.allocate(size, unit)
            if offset is not None:
                return index, offset
        return None

    def _wake(self, now: float) -> None:
        """Return the extents that have rested until `now` to the free space."""
        resting = self._resting
        while resting and resting[0][0] <= now:
            _, segment, offset, size = resting.popleft()
            self._free[segment].free(offset, size)

    # ---- I/O (on IOPool's threads)
    def write(self, segment: int, offset: int, views: list[memoryview] | Any) -> None:
        """Write `views` (buffers, or a numpy iovec array) back to back at the extent;
        direct where possible."""
        direct = self.direct and _direct_ok(views)
        fd = self._direct_fd(segment) if direct else self._fds[segment]
        try:
            write_at(fd, views, offset)
        except OSError as exc:
            if exc.errno in NO_SPACE:
                raise StorageFullError(f"the filesystem of {self.root} is full ({exc.strerror})") from exc
            if direct and exc.errno == errno.EINVAL:  # the filesystem took the probe but not this
                write_at(self._fds[segment], views, offset)
                return
            raise StorageError(f"write to segment {segment} failed: {exc.strerror}") from exc
        if self.sync:
            with self._lock:
                self._dirty.add(segment)

    def read(self, segment: int, offset: int, views: list[memoryview] | Any) -> None:
        """Fill `views` (buffers, or a numpy iovec array) from the extent (buffered: the
        page cache serves repeated reads)."""
        if segment >= len(self._fds):
            raise StorageError(f"segment {segment} does not exist")
        try:
            read_at(self._fds[segment], views, offset)
        except OSError as exc:
            raise StorageError(f"read from segment {segment} failed: {exc.strerror}") from exc

    def flush(self) -> None:
        """fdatasync the segments written since the last flush (with `sync`)."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for index in sorted(dirty):
            os.fdatasync(self._fds[index])

    def fd(self, segment: int) -> int:
        return self._fds[segment]

    def file_size(self, segment: int) -> int:
        """The segment file's size now (0 for a segment that does not exist)."""
        if segment >= len(self._fds):
            return 0
        return os.fstat(self._fds[segment]).st_size

    def close(self) -> None:
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            for dfd in self._direct_fds:
                if dfd is not None:
                    os.close(dfd)
            self._fds.clear()
            self._direct_fds.clear()

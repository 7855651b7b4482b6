"""glibc malloc settings for processes that move large buffers.

Every multi-MiB gRPC message and tensor slice is a fresh allocation. With
glibc's defaults, buffers above the mmap threshold come from fresh mappings and
freed heap tops go back to the kernel, so each transfer pays one page fault per
4 KiB touched: on a VM that is most of the CPU time of a put or a get
(measured: ~185k faults per GB). Keeping such buffers in the heap removes that
cost at the price of up to `trim_bytes` of freed memory staying resident.

A long-running daemon also bounds what that costs: few arenas (each thread that
allocates may otherwise get an arena of its own, whose freed memory no other
thread reuses), and the heap handed back to the kernel once it is idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a whole writable mapping in now


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, loaded once (None elsewhere); madvise typed for pointer-sized arguments."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    if hasattr(libc, "madvise"):
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def tune_malloc(mmap_threshold: int = 32 << 20, trim_bytes: int = 1 << 30) -> bool:
    """Serve allocations below `mmap_threshold` from the heap and keep up to `trim_bytes` free.

    Both are set together (setting one alone disables glibc's adaptive
    threshold and is worse than neither). Returns False where there is no glibc.
    """
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)  # musl and others have none
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
    if ok:
        log.debug("malloc tuned: mmap threshold %d, trim threshold %d", mmap_threshold, trim_bytes)
    return ok


def limit_arenas(count: int) -> bool:
    """At most `count` malloc arenas; call before threads start allocating."""
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and mallopt(_M_ARENA_MAX, count) == 1


def trim_heap() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim)."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    return malloc_trim is not None and malloc_trim(0) == 1


def drop_mapped_pages(address: int, length: int) -> bool:
    """Unmap the pages of a read-only file mapping from this process (MADV_DONTNEED):
    they stay in the page cache and are mapped again when touched."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None or not address or not length:
        return False
    return madvise(address, length, _MADV_DONTNEED) == 0


def populate_mapping(
    address: int, length: int, chunk: int = 64 << 20, stop: Callable[[], bool] | None = None
) -> bool:
    """Fault a shared writable mapping's pages into this process's page tables now
    (MADV_POPULATE_WRITE), `chunk` bytes per call; the GIL is released during each call
    (ctypes), so a thread can do it beside the process's work. False where the kernel
    or libc cannot (pages then fault in as they are first touched), or when `stop()`
    said so between two chunks."""
    madvise = getattr(_libc(), "madvise", None)
    if madvise is None or not address or not length:
        return False
    for offset in range(0, length, chunk):
        if stop is not None and stop():
            return False
        if madvise(address + offset, min(chunk, length - offset), MADV_POPULATE_WRITE) != 0:
            return False
    return True

"""glibc malloc settings for processes that move large buffers.

Every multi-MiB gRPC message and tensor slice is a fresh allocation. With
glibc's defaults, buffers above the mmap threshold come from fresh mappings and
freed heap tops go back to the kernel, so each transfer pays one page fault per
4 KiB touched: on a VM that is most of the CPU time of a put or a get
(measured: ~185k faults per GB). Keeping such buffers in the heap removes that
cost at the price of up to `trim_bytes` of freed memory staying resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc(mmap_threshold: int = 32 << 20, trim_bytes: int = 1 << 30) -> bool:
    """Serve allocations below `mmap_threshold` from the heap and keep up to `trim_bytes` free.

    Both are set together (setting one alone disables glibc's adaptive
    threshold and is worse than neither). Returns False where there is no glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
    if ok:
        log.debug("malloc tuned: mmap threshold %d, trim threshold %d", mmap_threshold, trim_bytes)
    return ok

"""The persistent tiers' I/O: worker threads issuing preadv / pwritev, which release the
GIL, with a budget of bytes in flight (not a count of requests: a few large requests
keep a disk busy, many small ones do not), and the vectored calls they make: libc's
preadv/pwritev of a numpy iovec array (no Python object per buffer), os.preadv/pwritev
of buffers otherwise. Used by the segments of the LMDB tier (tiers.segments) and by the
disk tier's loads into the memory tier (tiers.disk).
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore_server.tiers.base import StorageError

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
DEFAULT_THREADS = 16
DEFAULT_INFLIGHT_BYTES = 1 << 30

_LIBC = ctypes.CDLL(None, use_errno=True)
_VEC_IO = {}
for _name in ("preadv", "pwritev"):
    _fn = getattr(_LIBC, _name)
    _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    _fn.restype = ctypes.c_ssize_t
    _VEC_IO[_name] = _fn


def _vec_io(name: str, fd: int, iov: Any, at: int, total: int | None = None) -> None:
    """preadv/pwritev of a numpy iovec array (rows of address, length) until every byte is
    moved: libc's, through ctypes, which releases the GIL for the call (no Python object
    per buffer; one call where it moves everything, the usual case). A read that ends
    early raises StorageError."""
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    fn = _VEC_IO[name]
    if len(iov) <= _IOV_MAX and iov.flags.c_contiguous:
        if total is None:
            total = int(iov[:, 1].sum())
        done = fn(fd, iov.ctypes.data, len(iov), at)
        if done == total:
            return
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    iov = np.array(iov, dtype=np.uint64, copy=True)  # advanced in place on a short transfer
    i, k = 0, len(iov)
    while i < k:
        batch = iov[i : i + _IOV_MAX]
        done = fn(fd, batch.ctypes.data, len(batch), at)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if done == 0:
            raise StorageError(f"short {name[1:-1]} at offset {at}")
        at += done
        ends = np.cumsum(batch[:, 1])
        whole = int(np.searchsorted(ends, done, side="right"))
        if whole < len(batch):
            part = done - (int(ends[whole - 1]) if whole else 0)
            batch[whole, 0] += part
            batch[whole, 1] -= part
        i += whole


def read_at(fd: int, views: list[memoryview] | Any, at: int) -> None:
    """Fill `views` (buffers, or a numpy iovec array) from `fd` at `at`; a read that ends
    early raises StorageError."""
    _move("preadv", fd, views, at)


def write_at(fd: int, views: list[memoryview] | Any, at: int) -> None:
    """Write `views` (buffers, or a numpy iovec array) back to back to `fd` at `at`."""
    _move("pwritev", fd, views, at)


def _move(name: str, fd: int, views: list[memoryview] | Any, at: int) -> None:
    if not isinstance(views, list):  # an iovec array
        _vec_io(name, fd, views, at)
    else:
        _full_io(os.preadv if name == "preadv" else os.pwritev, fd, views, at)


class IOPool:
    """Threads issuing preadv/pwritev, at most `inflight_bytes` of requests at once (a
    request larger than the budget runs alone), in the order submitted. Submitting never
    blocks: a task waits for the budget in the queue, so a caller (a Pin answering before
    its reads land) goes on at once; `submit_many` queues a promotion's hundred reads
    under one lock (one submit each, through concurrent.futures, cost 40 us apiece on a
    busy host, while the first reads already ran)."""

    def __init__(self, threads: int = DEFAULT_THREADS, inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        self._budget = inflight_bytes
        self._inflight = 0
        self._queue: collections.deque[tuple[int, Callable[[], None], Future[None]]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self.threads = threads
        # every thread started now, not by a load's first reads
        self._threads = [
            threading.Thread(target=self._work, name=f"kvstore-io-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, nbytes: int, fn: Callable[[], None]) -> Future[None]:
        """Run `fn` (an I/O of `nbytes`) on a worker once the budget has room."""
        return self.submit_many([(nbytes, fn)])[0]

    def submit_many(self, tasks: Sequence[tuple[int, Callable[[], None]]]) -> list[Future[None]]:
        """submit for each of `tasks` (bytes, function), queued together, run in order."""
        futures: list[Future[None]] = [Future() for _ in tasks]
        with self._cond:
            if self._closing:
                raise RuntimeError("the I/O pool is closed")
            self._queue.extend((nbytes, fn, f) for (nbytes, fn), f in zip(tasks, futures, strict=True))
            self._cond.notify(len(tasks))
        return futures

    def _work(self) -> None:
        cond, queue = self._cond, self._queue
        while True:
            with cond:
                while True:
                    if queue:
                        nbytes = queue[0][0]
                        if not self._inflight or self._inflight + nbytes <= self._budget:
                            break
                    elif self._closing:
                        return
                    cond.wait()
                nbytes, fn, future = queue.popleft()
                self._inflight += nbytes
                if queue:  # another worker may start the next one
                    cond.notify()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        fn()
                    except BaseException as exc:  # the caller gets it from the future
                        future.set_exception(exc)
                    else:
                        future.set_result(None)
            finally:
                # NOTE: not kept while idle: a task's closure holds its buffers (a put's
                # heap copies), which an idle worker would keep alive
                del fn, future
                with cond:
                    self._inflight -= nbytes
                    if queue:
                        cond.notify()

    def close(self) -> None:
        """Run what is queued, then stop the threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()


def _full_io(
    op: Callable[[int, list[memoryview], int], int], fd: int, views: list[memoryview], at: int
) -> None:
    """preadv/pwritev until every byte of `views` is moved (calls of at most IOV_MAX
    buffers; a short transfer continues where it stopped). A read that ends early
    (the file is shorter than the record says) raises StorageError."""
    pending = [v for v in views if v.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        done = op(fd, batch, at)
        if done <= 0:
            raise StorageError(f"short {'read' if op is os.preadv else 'write'} at offset {at}")
        at += done
        rest = []
        for i, view in enumerate(batch):
            if done >= view.nbytes:
                done -= view.nbytes
                continue
            rest.append(view[done:])
            rest.extend(batch[i + 1 :])
            break
        pending = rest + pending[len(batch) :]

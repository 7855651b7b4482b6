"""Memory back to the kernel once bulk transfers stop.

Under load the daemon keeps freed transfer buffers in malloc's heap (reusing
them is much cheaper than fresh pages, see kvstore.memory) and LMDB's file
pages mapped. Neither is needed once no Put, Get or DropSelect has run for
`delay` seconds: then the heap's free pages are trimmed and the backend drops
what it holds only as a cache, so the daemon returns near its idle size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class IdleReclaim:
    """`with reclaim.busy():` around each bulk call; `reclaim` runs once per idle spell."""

    def __init__(self, reclaim: Callable[[], None], delay: float = 1.0) -> None:
        self.delay = delay
        self._reclaim = reclaim
        self._cond = threading.Condition()
        self._active = 0
        self._started = 0  # bulk calls started so far
        self._reclaimed = 0  # value of _started at the last reclaim
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-reclaim", daemon=True)
        self._thread.start()

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._cond:
            self._active += 1
            self._started += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                # wait for an idle spell that follows work not yet reclaimed
                self._cond.wait_for(
                    lambda: self._closed or (not self._active and self._started != self._reclaimed)
                )
                # ... that lasts `delay` seconds
                interrupted = self._cond.wait_for(self._interrupted(self._started), timeout=self.delay)
                if self._closed:
                    return
                if interrupted:
                    continue
                self._reclaimed = self._started
            try:
                self._reclaim()
            except Exception:  # noqa: BLE001 - a failed reclaim must not end the thread
                log.exception("giving idle memory back to the kernel failed")

    def _interrupted(self, started: int) -> Callable[[], bool]:
        return lambda: self._closed or self._active > 0 or self._started != started

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

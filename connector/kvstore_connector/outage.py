"""At most one warning per store outage, and one per kind of refused call."""

from __future__ import annotations

import logging
import threading
import time

from kvstore_client.errors import StoreInternalError, StoreTimeout, StoreUnavailable

# What says the store is down, stalled or broken: back off from it. Anything else
# (a refused request, a full store, a local error) is a failure of that call alone.
OUTAGES = (StoreUnavailable, StoreTimeout, StoreInternalError)


class StoreHealth:
    """Tracks whether the store answers; logs one WARNING when it stops and one INFO when it is back.

    After an outage (OUTAGES) `available()` is False for `retry_interval` seconds,
    doubling with each further one up to `MAX_RETRY_INTERVAL`: a store that is down
    or stalled costs the engine one deadline per interval, not one per request.
    A call that fails for a reason of its own (the store refused it, or this
    process failed) leaves the store in service and is logged once per kind.
    """

    MAX_RETRY_INTERVAL = 30.0

    def __init__(self, address: str, retry_interval: float, log: logging.Logger) -> None:
        self.address = address
        self.retry_interval = retry_interval
        self._log = log
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._interval = retry_interval
        self._refusals: set[tuple[str, str]] = set()

    def available(self) -> bool:
        return self._down_since is None or time.monotonic() >= self._retry_at

    def failed(self, what: str, exc: BaseException) -> None:
        if not isinstance(exc, OUTAGES):
            self._refused(what, exc)
            return
        with self._lock:
            now = time.monotonic()
            self._retry_at = now + self._interval
            self._interval = min(self._interval * 2, max(self.MAX_RETRY_INTERVAL, self.retry_interval))
            if self._down_since is None:
                self._down_since = now
                self._log.warning(
                    "kvstore at %s failed (%s: %s); affected requests recompute until it is back",
                    self.address,
                    what,
                    exc,
                )
            else:
                self._log.debug("kvstore still failing (%s: %s)", what, exc)

    def _refused(self, what: str, exc: BaseException) -> None:
        kind = (what, type(exc).__name__)
        with self._lock:
            first = kind not in self._refusals
            self._refusals.add(kind)
        if first:
            self._log.warning(
                "kvstore %s failed: %s: %s (the store stays in use; further %s failures of this kind "
                "are logged at DEBUG)",
                what,
                type(exc).__name__,
                exc,
                what,
            )
        else:
            self._log.debug("kvstore %s failed: %s: %s", what, type(exc).__name__, exc)

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                self._interval = self.retry_interval
                self._log.info(
                    "kvstore at %s is back after %.1fs", self.address, time.monotonic() - self._down_since
                )
                self._down_since = None

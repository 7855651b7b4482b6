"""Measured transfer rates: a moving average of bytes per second over recent transfers.

The store measures each tier's read rate (promotions from the persistent tier, blocks
fetched from the fleet) and the write-behind rate; Stats and Lookup report them, and
the connector weighs a load from a tier against recomputing the same tokens.
"""

from __future__ import annotations

import threading

# Weight of one transfer of WEIGHT_BYTES in the average; a smaller transfer weighs less
# (its time is more per-call cost than bandwidth), a larger one more, up to MAX_WEIGHT.
_WEIGHT = 0.25
_WEIGHT_BYTES = 64 << 20
_MAX_WEIGHT = 0.5


class Rate:
    """Bytes per second, averaged over transfers weighted by their size. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rate = 0.0
        self.bytes = 0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        weight = min(_MAX_WEIGHT, _WEIGHT * nbytes / _WEIGHT_BYTES)
        with self._lock:
            self._rate = sample if self._rate == 0.0 else self._rate + weight * (sample - self._rate)
            self.bytes += nbytes

    @property
    def value(self) -> float:
        """Bytes per second; 0.0 until a transfer was measured."""
        with self._lock:
            return self._rate

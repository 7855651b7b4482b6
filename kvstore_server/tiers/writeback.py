"""Write-behind: copies blocks committed to the memory tier into the persistent tier.

One thread per daemon. Commits wake it; it writes the oldest waiting blocks in
batches (each verified against its checksums first: a client that maps the
arena could have changed them) until none wait, and every second it also
reclaims expired reservations and pins. The queue is bounded by
`write_behind_bytes` (see MemoryTier.place): a commit beyond it is still
visible, but stays in memory only, counted as `write_behind_dropped`, and
leaves the store when the arena evicts it. A persistent tier that refuses a
batch (full, failing) does the same to that batch: saves are never delayed by
the tier behind.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore_server.tiers.chain import TierChain

log = logging.getLogger(__name__)

_BATCH_BYTES = 16 << 20  # per commit-lock hold: a save's commit waits at most one batch
_TICK_SECONDS = 1.0


class WriteBehind:
    def __init__(self, tiers: TierChain, batch_bytes: int = _BATCH_BYTES) -> None:
        self._tiers = tiers
        self._batch = batch_bytes
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstore-write-behind", daemon=True)
        self.wake = self._wake.set
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(_TICK_SECONDS)
            self._wake.clear()
            try:
                self._tiers.expire_leases()
                while not self._stop and self._tiers.write_behind_once(self._batch):
                    pass
            except Exception:
                # Never let the thread die silently: the next tick tries again.
                log.exception("write-behind failed; retrying")

    def flush(self) -> None:
        """Write everything waiting now (at shutdown, before the tiers close)."""
        while self._tiers.write_behind_once(self._batch):
            pass

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        self.flush()

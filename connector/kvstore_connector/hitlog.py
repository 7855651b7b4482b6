"""What the store gave each request, in the engine's own log.

    kvstore: request cmpl-1-0: 480 of 512 prompt tokens loaded from kvstore (15 blocks)
    kvstore: 37 more requests: 9120 of 9800 prompt tokens loaded from kvstore (285 blocks) in the last 10 s

vLLM's offline `LLM(...)` turns its stats logging off (disable_log_stats), so the
connector's stats ("KV Transfer metrics", kvstore_connector.stats) never show
there; this log does, on the scheduler side, in both paths.

NOTE: one INFO line per request that hit, at most `burst` of them in an interval
(10 s, vLLM's stats interval); beyond that each request's line is DEBUG and the
interval's INFO is one summary line. An offline run or a quiet server shows every
request; a busy server (hundreds of hits a second) gets a few lines per interval,
not one per request. The summary is written at the first scheduler step after its
interval ends, or when the connector shuts down.

A hit is counted when vLLM takes it (update_state_after_alloc): a load that then
fails is logged by the worker and its blocks recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

INTERVAL_S = 10.0
BURST = 8


@dataclass
class _Totals:
    requests: int = 0
    loaded: int = 0
    prompt: int = 0
    blocks: int = 0


class HitLog:
    def __init__(self, log: logging.Logger, *, interval_s: float = INTERVAL_S, burst: int = BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.log = log
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._window_start = clock()
        self._lines = 0  # per-request INFO lines in this interval
        self._more = _Totals()  # hits of this interval beyond the burst

    def hit(self, request_id: str, loaded_tokens: int, prompt_tokens: int, blocks: int,
            local_tokens: int = 0) -> None:  # fmt: skip
        """A request's `loaded_tokens` (`blocks` whole blocks) come from the store, after
        `local_tokens` vLLM had in its own prefix cache."""
        self.flush()
        local = f", after {local_tokens} in vLLM's prefix cache" if local_tokens else ""
        args = (request_id, loaded_tokens, prompt_tokens, blocks, local)
        line = "kvstore: request %s: %d of %d prompt tokens loaded from kvstore (%d blocks%s)"
        if self._lines < self.burst:
            self._lines += 1
            self.log.info(line, *args)
            return
        self.log.debug(line, *args)
        more = self._more
        more.requests += 1
        more.loaded += loaded_tokens
        more.prompt += prompt_tokens
        more.blocks += blocks

    def flush(self, *, force: bool = False) -> None:
        """At a step (and `force`: at shutdown): once the interval is over, write its summary
        line if requests went beyond the burst, and start the next interval."""
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed < self.interval_s and not force:
            return
        more = self._more
        if more.requests:
            self.log.info(
                "kvstore: %d more requests: %d of %d prompt tokens loaded from kvstore (%d blocks) "
                "in the last %.0f s",
                more.requests, more.loaded, more.prompt, more.blocks, elapsed,
            )  # fmt: skip
        self._more = _Totals()
        self._lines = 0
        self._window_start = now

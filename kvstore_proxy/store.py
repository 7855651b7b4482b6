"""What the proxy asks the store: how many of a prompt's tokens it holds.

The proxy hashes token ids as the connector does (kvstore_client.hashing, under the
connector's namespace) and asks the daemon's Lookup with `probe` set: the daemon
counts it apart and changes no recency (the decode's own lookup does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvstore.namespaces import ConnectorNamespace, parse_namespace
from kvstore_client import KVStoreClient
from kvstore_client.errors import KVStoreError, StoreTimeout
from kvstore_client.hashing import block_hashes

log = logging.getLogger("kvstore-proxy")


class StoreTarget:
    """The connector's namespace, as its log line prints it, e.g.
    kvc2|Qwen/Qwen2.5-7B-Instruct|bfloat16|bs16|kvh4|hd128|mha|cuda|pp0of1
    (a namespace without the |pp.. part stands for PP=1)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        parts = _parse(namespace)
        self.lookup_namespace = namespace if parts else namespace + "|pp0of1"
        """The first pipeline stage's namespace: every stage saves the same blocks."""
        parts = parts or _parse(self.lookup_namespace)
        if parts is None or not parts.block_size:
            raise ValueError(
                f"--kv-namespace {namespace!r} is not a connector namespace (kvc2|MODEL|DTYPE|bsN|...): "
                "copy it from the connector's log line 'kvstore connector: ... namespace ...'"
            )
        self.root = parts.root  # the chain root of the block hashes: less the rank part
        self.block_size = parts.block_size


def _parse(namespace: str) -> ConnectorNamespace | None:
    try:
        return parse_namespace(namespace)
    except ValueError:
        return None


class StoreView:
    """Lookups of token ids, off the event loop, within a deadline; a store that fails is
    left alone for `retry_s` (the proxy then prefills as if it had no store).

    A lookup that misses its deadline prefills that one request; only `slow_limit` misses in
    a row take the store out (a busy host answers late now and then, and one late answer
    should not cost the next `retry_s` of requests their skipped prefills)."""

    def __init__(self, client: KVStoreClient, target: StoreTarget, *, timeout_s: float = 0.2,
                 retry_s: float = 5.0, slow_limit: int = 3) -> None:  # fmt: skip
        self.client = client
        self.target = target
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.slow_limit = slow_limit
        self._down_until = 0.0
        self._failing = False
        self._slow_in_a_row = 0
        self.errors = 0
        self.timeouts = 0
        self.last_error: str | None = None

    def connect(self, timeout_s: float) -> bool:
        """Open the channel before the first request needs it (its set-up is not paid inside
        a lookup's deadline); False, logged, when the store does not answer yet."""
        try:
            self.client.health(timeout=timeout_s)
        except KVStoreError as exc:
            log.warning("the store does not answer yet (%s): lookups will try again", exc)
            return False
        return True

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def held_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        """Leading tokens the store holds KV for (whole blocks); None when it cannot say."""
        if not self.up:
            return None
        hashes = block_hashes(self.target.root, token_ids, self.target.block_size, cache_salt=cache_salt)
        try:
            n = self.client.lookup(self.target.lookup_namespace, hashes, timeout=self.timeout_s, probe=True)
        except StoreTimeout as exc:
            self.timeouts += 1
            self.last_error = str(exc)
            self._slow_in_a_row += 1
            if self._slow_in_a_row >= self.slow_limit:
                self._slow_in_a_row = 0
                self._down(exc)
            return None
        except KVStoreError as exc:
            self._down(exc)
            return None
        self._slow_in_a_row = 0
        if self._failing:
            log.info("store lookups answer again")
            self._failing = False
        return n * self.target.block_size

    def _down(self, exc: KVStoreError) -> None:
        self.errors += 1
        self.last_error = str(exc)
        if not self._failing:  # one warning per outage
            log.warning("store lookup failed (%s): prefilling every request until it answers", exc)
        self._failing = True
        self._down_until = time.monotonic() + self.retry_s

    async def held_tokens_async(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        return await asyncio.to_thread(self.held_tokens, token_ids, cache_salt)

    def close(self) -> None:
        self.client.close()

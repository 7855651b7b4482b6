"""What the proxy asks the store: how many of a prompt's tokens it holds.

The proxy hashes token ids as the connector does (kvstore_client.hashing, under the
connector's namespace) and asks the daemon's Lookup with `probe` set: the daemon
counts it apart and changes no recency (the decode's own lookup does).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence

from kvstore_client import KVStoreClient
from kvstore_client.errors import KVStoreError
from kvstore_client.hashing import block_hashes, connector_block_size, connector_hash_root

log = logging.getLogger("kvstore-proxy")


class StoreTarget:
    """The connector's namespace, as its log line prints it, e.g.
    kvc2|Qwen/Qwen2.5-7B-Instruct|bfloat16|bs16|kvh4|hd128|mha|cuda|pp0of1
    (a namespace without the |pp.. part stands for PP=1)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.lookup_namespace = namespace if re.search(r"\|pp\d+of\d+$", namespace) else namespace + "|pp0of1"
        """The first pipeline stage's namespace: every stage saves the same blocks."""
        root = connector_hash_root(self.lookup_namespace.encode())
        block_size = connector_block_size(self.lookup_namespace.encode())
        if root is None or not block_size:
            raise ValueError(
                f"--kv-namespace {namespace!r} is not a connector namespace (kvc2|MODEL|DTYPE|bsN|...): "
                "copy it from the connector's log line 'kvstore connector: ... namespace ...'"
            )
        self.root = root.decode()  # the chain root of the block hashes: less the rank part
        self.block_size = block_size


class StoreView:
    """Lookups of token ids, off the event loop, within a deadline; a store that fails is
    left alone for `retry_s` (the proxy then prefills as if it had no store)."""

    def __init__(self, client: KVStoreClient, target: StoreTarget, *, timeout_s: float = 0.2,
                 retry_s: float = 5.0) -> None:  # fmt: skip
        self.client = client
        self.target = target
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._down_until = 0.0
        self._failing = False
        self.errors = 0
        self.last_error: str | None = None

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
        except KVStoreError as exc:
            self.errors += 1
            self.last_error = str(exc)
            if not self._failing:  # one warning per outage
                log.warning("store lookup failed (%s): prefilling every request until it answers", exc)
            self._failing = True
            self._down_until = time.monotonic() + self.retry_s
            return None
        if self._failing:
            log.info("store lookups answer again")
            self._failing = False
        return n * self.target.block_size

    async def held_tokens_async(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int | None:
        return await asyncio.to_thread(self.held_tokens, token_ids, cache_salt)

    def close(self) -> None:
        self.client.close()

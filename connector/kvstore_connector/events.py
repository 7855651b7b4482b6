"""KV events for vLLM's publisher (KVConnectorBase_V1.take_events): which of this engine's
blocks the store holds, under vLLM's own block hashes and medium names: "CPU" when the
daemon has a memory tier (loads are served from its arena), "STORAGE" when it has only
the persistent tier (kvstore.kv_events_media: the mapping, and why one medium here).

An engine started with --kv-events-config then publishes, beside its GPU blocks, a
`BlockStored` once a block it saved is committed in the store (seen on the daemon's
Watch stream, so a save that failed is never reported), or once a lookup found a block
it will load; and a `BlockRemoved` once the store evicts a block it reported. A router
(vLLM's subscribers, llm-d, Dynamo) then knows what a replica can load from the store,
with no change on its side. A daemon that restarted holds nothing it reported: those
blocks are reported removed (under the medium they were reported with). Which tiers
the daemon has is asked (Stats) each time the Watch starts, on the Watch's thread.

Bounded: at most `max_tracked` blocks are remembered (the oldest are forgotten: a
forgotten block's removal is not reported).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.kv_events_media import front_medium
from kvstore_client import EVENT_REMOVED, EVENT_STORED, KVStoreClient
from kvstore_client.errors import KVStoreError

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm." + __name__)


@dataclass(frozen=True, slots=True)
class _Block:
    vllm_hash: Any  # vLLM's ExternalBlockHash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent: Any
    tokens: list[int]
    lora_id: int | None
    lora_name: str | None


def _external(block_hash: bytes) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(block_hash)  # type: ignore[arg-type]


class StoreEvents:
    def __init__(self, client: KVStoreClient, namespace: bytes, block_size: int, *, retry_s: float = 2.0,
                 max_tracked: int = 65536) -> None:  # fmt: skip
        self.client = client
        self.namespace = namespace
        self.block_size = block_size
        self.retry_s = retry_s
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._planned: OrderedDict[bytes, _Block] = OrderedDict()  # saved, not seen committed yet
        self._reported: OrderedDict[bytes, Any] = OrderedDict()  # the store's hash -> vLLM's
        self._out: list[Any] = []
        self._store_id: str | None = None
        # until the daemon says otherwise: its default has a memory tier
        self.medium = front_medium(has_memory_tier=True)
        self._stop = threading.Event()
        self._stream: Any = None
        self._thread = threading.Thread(target=self._watch, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    # ---- the scheduler's side
    def _blocks(self, request: Request, hashes: Sequence[bytes], first: int) -> list[tuple[bytes, _Block]]:
        vllm_hashes = request.block_hashes
        lora = request.lora_request
        out = []
        for i, h in enumerate(hashes, start=first):
            if i >= len(vllm_hashes):  # vLLM hashes full blocks as they fill: it always has these
                break
            parent = _external(vllm_hashes[i - 1]) if i else None
            tokens = list(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = _Block(_external(vllm_hashes[i]), parent, tokens, lora.adapter_id if lora else None,
                           lora.name if lora else None)  # fmt: skip
            out.append((h, block))
        return out

    def saving(self, request: Request, hashes: Sequence[bytes], first: int) -> None:
        """Blocks `first`.. of `request` are being saved as `hashes`: report them once committed."""
        with self._lock:
            for h, block in self._blocks(request, hashes, first):
                if h not in self._reported:
                    self._planned[h] = block
            _trim(self._planned, self.max_tracked)

    def held(self, request: Request, hashes: Sequence[bytes], first: int) -> None:
        """Blocks `first`.. of `request` are in the store (a lookup found them)."""
        with self._lock:
            fresh = [(h, b) for h, b in self._blocks(request, hashes, first) if h not in self._reported]
            self._report(fresh)

    def take(self) -> list[Any]:
        with self._lock:
            out, self._out = self._out, []
        return out

    def close(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)

    # ---- under the lock
    def _report(self, blocks: list[tuple[bytes, _Block]]) -> None:
        from vllm.distributed.kv_events import BlockStored

        # one event per run of consecutive blocks of a chain (vLLM's own shape)
        runs: list[list[_Block]] = []
        for h, block in blocks:
            if not runs or block.parent != runs[-1][-1].vllm_hash:
                runs.append([])
            runs[-1].append(block)
            self._reported[h] = block.vllm_hash
        for run in runs:
            first = run[0]
            self._out.append(BlockStored(
                block_hashes=[b.vllm_hash for b in run], parent_block_hash=first.parent,
                token_ids=[t for b in run for t in b.tokens], block_size=self.block_size,
                lora_id=first.lora_id, medium=self.medium, lora_name=first.lora_name,
            ))  # fmt: skip
        _trim(self._reported, self.max_tracked)

    def _removed(self, hashes: Sequence[bytes]) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        gone = [self._reported.pop(h) for h in hashes if h in self._reported]
        if gone:
            self._out.append(BlockRemoved(block_hashes=gone, medium=self.medium))

    # ---- the daemon's Watch, on a thread
    def _watch(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                with self.client.watch(0, self.namespace) as stream:
                    self._stream = stream
                    memory = self.client.stats(timeout=self.retry_s)["memory_capacity_bytes"] > 0
                    self._started(stream.store_id, front_medium(memory))
                    if failing:
                        log.info("kvstore: KV events follow the store again")
                        failing = False
                    for event in stream:
                        self._on(event)
            except KVStoreError as exc:
                if not failing:
                    log.warning("kvstore: the store's Watch failed (%s): KV events wait for it", exc)
                    failing = True
            finally:
                self._stream = None
            self._stop.wait(self.retry_s)

    def _started(self, store_id: str, medium: str) -> None:
        with self._lock:
            if self._store_id is not None and store_id != self._store_id:  # a restarted daemon
                self._removed(list(self._reported))
                self._planned.clear()
            elif medium != self.medium and self._reported:  # not yet known when they were reported
                self._removed(list(self._reported))
            self._store_id = store_id
            self.medium = medium

    def _on(self, event: Any) -> None:
        with self._lock:
            if event.kind == EVENT_STORED:
                self._report([(h, self._planned.pop(h)) for h in event.block_hashes if h in self._planned])
            elif event.kind == EVENT_REMOVED:
                self._removed(event.block_hashes)


def _trim(tracked: OrderedDict[bytes, Any], limit: int) -> None:
    while len(tracked) > limit:
        tracked.popitem(last=False)

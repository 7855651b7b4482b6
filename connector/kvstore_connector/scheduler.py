"""Scheduler side of the connector: hashing, Lookup, and what each step loads and saves.

One instance per engine, in the engine-core process. It never touches tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore import wire
from kvstore_client import KVStoreClient, Lease
from kvstore_client.errors import KVStoreError, NotOffered
from kvstore_client.hashing import MultiModalInput, block_hashes
from kvstore_connector.config import ConnectorConfig, NamespaceInfo
from kvstore_connector.costs import DEFAULT_RECOMPUTE_TOKENS_PER_S, worth_loading
from kvstore_connector.events import StoreEvents
from kvstore_connector.hitlog import HitLog
from kvstore_connector.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_connector.outage import StoreHealth
from kvstore_connector.stats import KVStoreConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# NOTE: under "vllm." so records go through vLLM's own logging setup, beside its lines.
log = logging.getLogger("vllm." + __name__)


def request_hashes(request: Request, root: str, block_size: int, tokens: Sequence[int] | None = None,
                   *, parent: bytes | None = None, start_block: int = 0) -> list[bytes]:  # fmt: skip
    """Chained hashes of the prompt's full blocks (or of `tokens`: the prompt and what was
    generated, from block `start_block` on, after `parent`), multimodal inputs, salt and
    LoRA included."""
    if request.prompt_token_ids is None:  # prompt embeddings: nothing to key on
        return []
    if tokens is None:
        tokens = request.prompt_token_ids
    mm = [
        MultiModalInput(f.identifier, f.mm_position.offset, f.mm_position.length)
        for f in (request.mm_features or ())
    ]
    lora = request.lora_request.lora_name if request.lora_request is not None else None
    return block_hashes(root, tokens, block_size, mm_inputs=mm, cache_salt=request.cache_salt, lora_name=lora,
                        parent=parent, start_block=start_block)  # fmt: skip


@dataclass
class _Tracked:
    hashes: list[bytes]
    request: Request  # vLLM's, alive while the request is: its generated tokens (save_decode)
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # leading blocks known to be in the store (hit or saved)
    pending_local: int = 0  # local prefix-cache tokens of the last lookup
    pending_hit: int = 0  # store blocks of the last lookup
    lease: Lease | None = None  # the last lookup's lease of blocks [local, hit), until handed on


class SchedulerSide:
    def __init__(self, info: NamespaceInfo, config: ConnectorConfig, *, load: bool, save: bool,
                 save_decode: bool = False, kv_events: bool = False) -> None:  # fmt: skip
        self.info = info
        self.config = config
        self.load = load
        self.save = save
        self.save_decode = save and save_decode
        self.block_size = info.block_size
        self.namespaces = info.all_namespaces()
        # hits that never lose to recompute (kvstore_connector.costs)
        rate = config.recompute_tokens_per_s
        self._recompute_rate = DEFAULT_RECOMPUTE_TOKENS_PER_S.get(info.device, 0.0) if rate is None else rate
        self._block_bytes = info.block_bytes()
        self.client = KVStoreClient(config.address, timeout=config.lookup_timeout, **config.client_options())
        self.health = StoreHealth(config.address, config.retry_interval, log)
        self.stats = KVStoreConnectorStats()
        self.hits = HitLog(log)  # "N of M prompt tokens loaded from kvstore", in the engine's log
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        # lookups lease the blocks they find in memory for the load that follows (its
        # workers then need no Pin): where loads go through the arena, seen from here
        self._leasing: bool | None = None if load and config.arena and not config.consume else False
        # the persistent tier's read rate the last lookup reported (0: not measured yet):
        # whether its blocks are worth reading ahead at the lookup (prefetch)
        self._persistent_rate = 0.0
        # vLLM's KV events for the blocks the store holds for this engine (--kv-events-config)
        self.events = StoreEvents(self.client, info.namespace(0), self.block_size) if kv_events else None

    def _tracked(self, request: Request) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            hashes = request_hashes(request, self.info.hash_root, self.block_size)
            tracked = self._requests[request.request_id] = _Tracked(hashes, request)
        return tracked

    def _leases(self) -> bool:
        """Whether lookups take leases: the daemon offers its arena and this process sees
        the file (the workers, on this host, then load through it). Asked until answered."""
        if self._leasing is None:
            try:
                self._leasing = os.path.exists(
                    self.client.arena_access(timeout=self.config.lookup_timeout).path
                )
            except NotOffered as exc:  # no arena: for good
                self._leasing = False
                log.debug("kvstore: lookups take no leases: %s", exc)
            except KVStoreError as exc:  # asked again at the next lookup
                log.debug("kvstore: could not ask where the arena is: %s", exc)
                return False
        return self._leasing

    def _lookup(self, hashes: list[bytes], local: int) -> tuple[int, Lease | None]:
        """The stored prefix worth loading: where a load of its blocks is estimated slower
        than recomputing them (kvstore_connector.costs), those are left to recompute. And
        the lease of blocks [local, hit) where the lookup could take one for all of them
        (every tensor-parallel rank of each namespace holds a share)."""
        if not hashes or not self.health.available():
            return 0, None
        lease_from = local if local < len(hashes) and self._leases() else None
        lease = None
        try:
            if lease_from is not None or (self._recompute_rate > 0 and self._block_bytes > 0):
                # the workers load a step later through the arena: what only the persistent
                # tier holds is read into memory meanwhile, where loading it pays
                ahead = lease_from is not None and self._worth_reading_ahead()
                where = self.client.where(
                    self.namespaces, hashes, timeout=self.config.lookup_timeout, lease_from=lease_from,
                    lease_holders=self.info.tp_size, prefetch=ahead,
                )  # fmt: skip
                lease = where.lease
                hit = where.num_blocks
                self._persistent_rate = where.persistent_read_rate
                if where.prefetching:
                    self.stats.add(blocks_prefetched=where.prefetching)
            if self._recompute_rate > 0 and self._block_bytes > 0:
                # weighed from `local` on: vLLM holds the blocks before it, they load from nowhere
                start = min(local, where.num_blocks)
                hit = start + worth_loading(
                    where.tiers[start:], self.block_size, self._block_bytes, where.persistent_read_rate,
                    where.fleet_read_rate, self._recompute_rate,
                )  # fmt: skip
                if hit < where.num_blocks:
                    self.stats.add(blocks_declined=where.num_blocks - hit)
                    log.debug(
                        "kvstore: %d of %d stored blocks left to recompute: loading them is slower "
                        "(tiers %s, persistent tier %.2f GB/s, recompute %.0f tokens/s)",
                        where.num_blocks - hit, where.num_blocks, where.tiers[hit:hit + 8].hex(),
                        where.persistent_read_rate / 1e9, self._recompute_rate,
                    )  # fmt: skip
            elif lease_from is None:
                hit = self.client.lookup(self.namespaces, hashes, timeout=self.config.lookup_timeout)
        except KVStoreError as exc:
            self.stats.add(lookup_errors=1)
            self.health.failed("lookup", exc)
            return 0, None
        self.health.ok()
        self.stats.add(lookups=1)
        if lease is not None and lease.num_blocks != hit - local:  # covers other blocks: of no use
            self.client.release_lease(lease)
            lease = None
        return hit, lease

    def _worth_reading_ahead(self) -> bool:
        """Whether a block only the persistent tier holds loads faster than it recomputes, at
        the rate the last lookup reported (kvstore_connector.costs: a rate not measured yet
        counts as fast): then a lookup asks the daemon to read such blocks ahead."""
        tier = bytes([wire.TIER_PERSISTENT])
        return (
            worth_loading(
                tier, self.block_size, self._block_bytes, self._persistent_rate, 0.0, self._recompute_rate
            )
            == 1
        )

    def _give_back(self, tracked: _Tracked) -> None:
        """A lease this side took and will not hand on (looked up again, allocated no
        blocks, finished): every holder's share goes back."""
        if tracked.lease is not None:
            self.client.release_lease(tracked.lease)
            tracked.lease = None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Store hits beyond vLLM's own prefix cache, whole blocks, always leaving one token to compute.

        May run several times for a request that waits for admission (and again
        after a preemption): each call asks the store afresh, which is harmless.
        """
        tracked = self._tracked(request)
        self._give_back(tracked)  # an earlier call's: this one leases afresh
        usable = min(len(tracked.hashes), (request.num_tokens - 1) // self.block_size)
        hit, lease = self._lookup(tracked.hashes[:usable], num_computed_tokens // self.block_size)
        tracked.stored = max(tracked.stored, hit)
        tracked.pending_local = num_computed_tokens
        tracked.pending_hit = hit
        tracked.lease = lease
        if not self.load or hit * self.block_size <= num_computed_tokens:
            self._give_back(tracked)
            return 0, False
        return hit * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked(request)
        lease, tracked.lease = tracked.lease, None
        if num_external_tokens <= 0:
            if lease is not None:
                self.client.release_lease(lease)
            return
        self.stats.add(hit_tokens=num_external_tokens)
        block_ids = blocks.get_block_ids()[0]
        first = tracked.pending_local // self.block_size
        last = (tracked.pending_local + num_external_tokens) // self.block_size
        # the request's tokens now: its prompt, and after a preemption what it generated too
        self.hits.hit(request.request_id, num_external_tokens, request.num_tokens, last - first,
                      tracked.pending_local)  # fmt: skip
        if lease is not None and lease.num_blocks != last - first:
            self.client.release_lease(lease)
            lease = None
        self._loads.append(
            LoadSpec(request.request_id, tracked.hashes[first:last], list(block_ids[first:last]), lease)
        )
        if self.events is not None:
            self.events.held(request, tracked.hashes[first:last], first)

    def build_connector_meta(self, out: SchedulerOutput) -> KVStoreConnectorMetadata:
        self.hits.flush()
        meta = KVStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self.save:
            return meta
        for new in out.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._plan_save(
                    meta, new.req_id, tracked, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
                )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(
                meta, req_id, tracked, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]
            )
        return meta

    def _plan_save(
        self, meta: KVStoreConnectorMetadata, req_id: str, tracked: _Tracked, computed: int
    ) -> None:
        """Save blocks that are full and computed by the end of this step, once each: the
        prompt's, and with save_decode the generated tokens' too."""
        if self.save_decode:
            self._hash_generated(tracked, computed)
        full = min(len(tracked.hashes), computed // self.block_size, len(tracked.block_ids))
        if full <= tracked.stored:
            return
        start = tracked.stored
        tokens = tracked.request.all_token_ids  # the prompt's, then what was generated
        meta.saves.append(
            SaveSpec(
                req_id,
                tracked.hashes[start:full],
                tracked.block_ids[start:full],
                tracked.hashes[start - 1] if start else b"",
                list(tokens[start * self.block_size : full * self.block_size]),
            )
        )
        if self.events is not None:
            self.events.saving(tracked.request, tracked.hashes[start:full], start)
        tracked.stored = full

    def _hash_generated(self, tracked: _Tracked, computed: int) -> None:
        """Extend the chain over generated tokens whose KV this step computes."""
        request = tracked.request
        tokens = request.all_token_ids
        full = min(computed, len(tokens)) // self.block_size
        have = len(tracked.hashes)
        if full <= have:
            return
        start = have * self.block_size
        tracked.hashes.extend(
            request_hashes(
                request,
                self.info.hash_root,
                self.block_size,
                tokens[start : full * self.block_size],
                parent=tracked.hashes[-1] if have else None,
                start_block=have,
            )  # fmt: skip
        )

    def request_finished(self, request: Request) -> None:
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None:
            self._give_back(tracked)

    def take_stats(self) -> KVStoreConnectorStats | None:
        return self.stats.take()

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def close(self) -> None:
        for tracked in self._requests.values():
            self._give_back(tracked)
        self.hits.flush(force=True)
        if self.events is not None:
            self.events.close()
        self.client.close()

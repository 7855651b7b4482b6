"""KVStoreConnector: vLLM v1 KV connector backed by the kvstore daemon.

Enable it with
    --kv-transfer-config '{"kv_connector":"KVStoreConnector",
        "kv_connector_module_path":"kvstore_connector", "kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"kvstore_address":"127.0.0.1:50051"}}'

Hooks, by caller (vLLM calls them; see vllm/.../kv_connector/v1/base.py):

  Configuration (classmethods, while vLLM builds its config):
    requires_piecewise_for_cudagraph  True: our layer hooks must run, not be replayed in a graph
    supports_sleep_mode         True (vLLM 0.34): nothing of ours follows the KV cache's pages
    supports_lookahead_block_hashes   False (vLLM 0.34): our hashes cover a block's own tokens

  Scheduler side (engine core, one instance):
    requires_kv_delivery        False: no hand-off reads the paged blocks after the step
    may_load_async              False (vLLM 0.34): loads run inside the step that needs them
    get_num_new_matched_tokens  hash the prompt once, one Lookup; whole-block hits, >= 1 token left
    update_state_after_alloc    remember which paged blocks receive which stored blocks; log the hit
    build_connector_meta        once per step: loads, and newly full prompt blocks to save
    request_finished            forget the request (blocks are never held: saves copy first)
    take_events                 blocks the store holds for this engine, as vLLM KV events
    get_kv_connector_stats      lookups and hits since the last call

  Worker side (one per rank):
    register_kv_caches          learn each layer's paged buffer and its block dimension
    start_load_kv               start streaming this step's loads, layer by layer, in background;
                                start reserving its saves (one ReserveMany)
    wait_for_layer_load         wait only for the layer about to run
    save_kv_layer               one indexed copy per layer off the paged buffer -> background sender
    wait_for_save               commit this step's saves (sync mode: wait for the store's ack)
    get_block_ids_with_load_errors  blocks whose load failed: vLLM recomputes them
    get_kv_connector_stats      blocks/bytes/seconds loaded and saved since the last call
    unregister_kv_caches        before sleep (vLLM 0.34): let this worker's saves finish
    restore_kv_caches           after wake-up (vLLM 0.34): nothing to redo

Every other hook of KVConnectorBase_V1 is inherited, each by a decision written in
INHERITED_HOOKS below; `python scripts/check_vllm_api.py VLLM_TREE` (kvstore_connector.api_check)
lists a vLLM's hooks and fails on one that is neither implemented here nor decided there.
Hooks a vLLM does not have are never called by it: this class works on 0.32 and 0.34.

Roles: kv_producer saves, kv_consumer loads (consume=true: DropSelect, freeing the
hand-off), kv_both loads what the store has and saves what it lacks.
Failures never reach the engine: every store call has a deadline and a failure
is a miss (lookup), a recompute (load) or a dropped save, logged once per outage.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.memory import tune_malloc
from kvstore_connector.config import ConnectorConfig, NamespaceInfo, role_summary
from kvstore_connector.metadata import KVStoreConnectorMetadata
from kvstore_connector.scheduler import SchedulerSide
from kvstore_connector.stats import KVStoreConnectorStats
from kvstore_connector.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# NOTE: under "vllm." so records go through vLLM's own logging setup, beside its lines.
log = logging.getLogger("vllm." + __name__)

INHERITED_HOOKS: dict[str, str] = {
    # the base's plumbing, as it is
    "role": "the base's: which side this instance is",
    "bind_connector_metadata": "the base's: the step's metadata, read back by _meta()",
    "clear_connector_metadata": "the base's",
    "has_connector_metadata": "the base's",
    "bind_kv_cache_manager": "the base's: we never look into vLLM's block pool",
    "bind_gpu_block_pool": "no-op: blocks are never held or ref-counted by us",
    # configuration
    "get_required_kvcache_layout": "None: find_block_dim takes each layer in any layout",
    "kv_cache_access": (
        "IN_PROCESS (vLLM 0.34): the worker reads and writes the KV cache with torch ops in its own "
        "process; it registers nothing of it with RDMA/UCX and exports no handle (the arena's CUDA "
        "host registration is of the daemon's shared memory, not of the KV cache)"
    ),
    "get_mem_pool_context": "None: the KV cache comes from vLLM's own pool",
    "supports_divergent_local_hybrid_hits": "False: no hybrid (HMA) models, whose state we do not store",
    "get_finished_count": "None: no send/receive completions to count",
    "build_prom_metrics": "None: the daemon exports Prometheus metrics; the engine logs our stats",
    # scheduler side
    "on_new_request": "no-op: hashing and the Lookup happen in get_num_new_matched_tokens",
    "get_loaded_kv_cache_group_ids": "the prefix-cacheable groups: a store addressed by hashes",
    "get_external_cache_hit_sources": (
        "all EXTERNAL_UNSPECIFIED: a Lookup says how many blocks the store has, not which tier"
    ),
    "update_connector_output": "no-op: no asynchronous transfers to follow",
    "register_finished_partial_tail": "False: a block is saved only when full",
    "has_pending_block_frees": "False: blocks are never held after a request finishes",
    "has_pending_push_work": "False: nothing is pushed to another engine",
    "reset_cache": (
        "None (not supported): the store is shared by every engine of the model; one engine's "
        "prefix-cache reset must not empty it (kvstore-cli evict does, deliberately)"
    ),
    # worker side
    "set_host_xfer_buffer_ops": "no-op: the transports do their own copies (kvstore_connector.transfer)",
    "handle_preemptions": "no-op: saves copy off the paged buffer within their step",
    "finish_forward": (
        "no-op (vLLM 0.34): a save's copies are queued on the compute stream during the forward and "
        "loads end before their layer runs; nothing of ours reads the step's KV after it"
    ),
    "reset_capture_state": "no-op (vLLM 0.34): no hook of ours runs inside a captured CUDA graph",
    "get_finished": "(None, None): nothing outlives its step (request_finished returns False)",
    "get_transfer_results": "the base's, from get_finished: nothing asynchronous",
    "get_kv_connector_kv_cache_events": "None: our KV events come from the scheduler side (take_events)",
    "get_handshake_metadata": "None: no handshake between engines, the store is between them",
    "set_xfer_handshake_metadata": "no-op: no handshake",
    "set_xfer_handshake_metadata_pp_aware": "the base's: no handshake",
    "build_connector_worker_meta": "None: workers report through stats and load errors only",
}
"""KVConnectorBase_V1 hooks this class does not implement, each with why the base's default is
right. kvstore_connector.api_check reads this table (without importing vLLM) and fails on a
base hook that is neither here nor implemented below."""


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        try:
            self.config = ConnectorConfig.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        except ValueError as exc:
            # NOTE: vLLM reports the exception three or four times, in tracebacks (the worker,
            # the engine core, its process); this line says it first, whole, once per process
            log.error("KVStoreConnector cannot start: %s", exc)
            raise
        info = NamespaceInfo.from_vllm(vllm_config, self.config.namespace, self.config.compression)
        if info.compression != self.config.compression:
            log.info(
                "kvstore connector: the KV cache is %s already: stored as it is, not compressed",
                info.kv_dtype,
            )
        self._load = transfer.kv_role in ("kv_consumer", "kv_both")
        self._save = transfer.kv_role in ("kv_producer", "kv_both")
        save_sync = self.config.saves_sync(transfer.kv_role)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            save_decode = self._save and (
                self.config.save_decode
                if self.config.save_decode is not None
                else transfer.kv_role == "kv_both"
            )
            events = vllm_config.kv_events_config
            self._scheduler = SchedulerSide(
                info, self.config, load=self._load, save=self._save, save_decode=save_decode,
                kv_events=bool(events is not None and events.enable_kv_cache_events),
            )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            if self.config.tune_malloc:
                tune_malloc()

            self._worker = WorkerSide(
                info.namespace(get_pp_group().rank_in_group),
                kv_cache_config.num_blocks,
                self.config,
                load=self._load,
                save=self._save,
                save_sync=save_sync,
                num_kv_heads=info.num_kv_heads,
                tp_size=info.tp_size,
                tp_rank=get_tensor_model_parallel_rank(),
                mla=info.mla,
                compression=info.compression,
            )
        log.info(
            "KVStoreConnector (%s, %s) -> %s, role %s: %s",
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            info.hash_root,
            self.config.address,
            transfer.kv_role,
            role_summary(transfer.kv_role, self.config),
        )

    # ---- configuration (classmethods: vLLM asks before any instance exists)
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True, in every role: wait_for_layer_load and save_kv_layer run from the attention
        layers and must run at every step; a full CUDA graph would replay the layers without
        them (a load read before it lands, a save never copied). vLLM then captures piecewise
        graphs, which run our hooks between the pieces."""
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """True (vLLM 0.34; never asked by 0.32): sleep mode unmaps the KV cache's pages and
        maps new ones at the same addresses on wake-up; nothing of ours is tied to the pages
        (see unregister_kv_caches)."""
        return True

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False (vLLM 0.34): our keys hash a block's own tokens, not the lookahead tokens an
        EAGLE drafter's KV also depends on; vLLM then turns lookahead hashing off, so its own
        block hashes (those of our KV events) stay without lookahead too."""
        return False

    # ---- scheduler side
    @property
    def requires_kv_delivery(self) -> bool:
        """False, in every role. True makes vLLM drop (and recompute) a preempted request's
        output still in flight, because a hand-off that reads the request's paged blocks after
        its last step would find them freed by the preemption. Ours never does: a save gathers
        its blocks on the compute stream inside the step that computed them (and a sync save,
        kv_producer's default, is in the store before that step's output returns), and
        request_finished holds no blocks. So the hand-off of a kv_producer or to a consume=true
        kv_consumer arrives just as well without dropping output, and for kv_both, a
        best-effort cache, a lost save is only a later miss. (vLLM's default: True for
        kv_producer and kv_both.)"""
        return False

    def may_load_async(self, request: Request) -> bool:
        """False (vLLM 0.34): get_num_new_matched_tokens never answers load_kv_async=True; loads
        run inside the step that needs them, layer by layer. vLLM's default (the P/D
        do_remote_prefill flag) would hold a request that a P/D proxy flagged back under
        --max-num-inflight-kv-loads, waiting for an asynchronous load that never comes."""
        return False

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side hook called on a worker connector")
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched().request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """BlockStored/BlockRemoved for the blocks the store holds for this engine, under vLLM's
        hashes and medium names (kvstore.kv_events_media); published with vLLM's own when
        --kv-events-config is on."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # ---- worker side
    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side hook called on the scheduler connector")
        return self._worker

    def _meta(self) -> KVStoreConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None:
            return
        if self._save:  # the step's saves reserved while the loads start and the first layers run
            self._work().open_saves_ahead(meta)
        if self._load:
            self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load:
            self._work().wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # kv_layer is not read: the worker saves from the paged views it registered (a
        # rank's KV heads of the layer, found once in register_kv_caches)
        meta = self._meta()
        if meta is not None and self._save:
            self._work().save_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        if self._save:
            self._work().finish_step_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().block_ids_with_load_errors() if self._load else set()

    def unregister_kv_caches(self) -> None:
        """Before sleep or a weight update borrowing the KV cache's memory (vLLM 0.34; transfers
        are drained, the device synchronised). Nothing of ours is registered with the KV cache:
        no RDMA/UCX registration, no exported handle; the arena's CUDA host registration is of
        the daemon's shared memory, which sleep leaves alone, so it stays. Our per-layer views
        stay too: sleep keeps the KV cache's virtual addresses. What is left: saves whose
        commit is still on its way to the store (host memory only); this waits for them, so
        none is in flight across the sleep. Idempotent."""
        if self._worker is not None:
            self._worker.wait_for_commits()

    def restore_kv_caches(self) -> None:
        """After wake-up (vLLM 0.34): nothing to redo, unregister_kv_caches dropped nothing. What
        the KV cache held may be gone (vLLM resets its prefix cache for that); the store's
        blocks are untouched and load as before."""

    # ---- both sides
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler or self._worker
        return side.take_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

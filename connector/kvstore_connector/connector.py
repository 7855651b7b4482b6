"""KVStoreConnector: vLLM v1 KV connector backed by the kvstore daemon.

Enable it with
    --kv-transfer-config '{"kv_connector":"KVStoreConnector",
        "kv_connector_module_path":"kvstore_connector", "kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"kvstore_address":"127.0.0.1:50051"}}'

Hooks, by caller (vLLM calls them; see vllm/.../kv_connector/v1/base.py):

  Scheduler side (engine core, one instance):
    get_num_new_matched_tokens  hash the prompt once, one Lookup; whole-block hits, >= 1 token left
    update_state_after_alloc    remember which paged blocks receive which stored blocks
    build_connector_meta        once per step: loads, and newly full prompt blocks to save
    request_finished            forget the request (blocks are never held: saves copy first)
    get_kv_connector_stats      lookups and hits since the last call

  Worker side (one per rank):
    register_kv_caches          learn each layer's paged buffer and its block dimension
    start_load_kv               start streaming this step's loads, layer by layer, in background
    wait_for_layer_load         wait only for the layer about to run
    save_kv_layer               one indexed copy per layer off the paged buffer -> background sender
    wait_for_save               commit this step's saves (sync mode: wait for the store's ack)
    get_block_ids_with_load_errors  blocks whose load failed: vLLM recomputes them
    get_kv_connector_stats      blocks/bytes/seconds loaded and saved since the last call

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
from kvstore_connector.config import ConnectorConfig, NamespaceInfo
from kvstore_connector.metadata import KVStoreConnectorMetadata
from kvstore_connector.scheduler import SchedulerSide
from kvstore_connector.stats import KVStoreConnectorStats
from kvstore_connector.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
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


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        info = NamespaceInfo.from_vllm(vllm_config, self.config.namespace, self.config.compression)
        if info.compression != self.config.compression:
            log.info(
                "kvstore connector: the KV cache is %s already: stored as it is, not compressed",
                info.kv_dtype,
            )
        self._load = transfer.kv_role in ("kv_consumer", "kv_both")
        self._save = transfer.kv_role in ("kv_producer", "kv_both")
        save_sync = (
            self.config.save_mode or ("sync" if transfer.kv_role == "kv_producer" else "async")
        ) == "sync"
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
            "KVStoreConnector (%s, %s) -> %s, role %s, saves %s",
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            info.hash_root,
            self.config.address,
            transfer.kv_role,
            "sync" if save_sync else "async",
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a preempted request may simply recompute.
        return False

    # ---- scheduler side
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
        """BlockStored/BlockRemoved (medium KVSTORE) for the blocks the store holds for this
        engine, under vLLM's hashes; published with vLLM's own when --kv-events-config is on."""
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
        if meta is not None and self._load:
            self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._load:
            self._work().wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        meta = self._meta()
        if meta is not None and self._save:
            self._work().save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self._save:
            self._work().finish_step_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().block_ids_with_load_errors() if self._load else set()

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

"""Worker side of the connector: layer-by-layer loads and background saves.

One instance per worker (TP/PP rank). All store I/O runs on background
threads; the forward pass only issues one indexed copy per layer and, for
loads, waits for the layer it is about to use.

How KV moves is the transport's business (kvstore_connector.transport), picked once
in register_kv_caches: ArenaTransport (the daemon's shared-memory arena, same host,
with gRPC as its fallback) or GrpcTransport (the daemon's byte streams, or its files
for same-host loads). The worker keeps the step: layer gates, load errors, the save
backlog, commits, stats, health.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kvstore_client import KVStoreClient, LayerSpec, LayerStream
from kvstore_client.errors import KVStoreError
from kvstore_connector.arena_transport import ArenaTransport
from kvstore_connector.compression import make_codec, stored_kv_dtype_is_fp8
from kvstore_connector.config import ConnectorConfig
from kvstore_connector.grpc_transport import GrpcTransport, SaveBacklog
from kvstore_connector.host_memory import prepare_arena
from kvstore_connector.layout import StoreLayout
from kvstore_connector.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_connector.outage import StoreHealth
from kvstore_connector.stats import KVStoreConnectorStats
from kvstore_connector.transfer import BlockMover, find_block_dim
from kvstore_connector.transport import Save, Transport

# NOTE: under "vllm." so records go through vLLM's own logging setup, beside its lines.
log = logging.getLogger("vllm." + __name__)


# A step's loads of at most this many bytes in all are pinned together (one PinMany): their
# per-request round trips cost more than streaming would save; larger ones stream.
_PIN_TOGETHER_BYTES = 64 << 20


class _LayerGates:
    """Per layer: set once every load of this step has written that layer (or given up)."""

    def __init__(self, layers: list[str], jobs: int) -> None:
        self._left = dict.fromkeys(layers, jobs)
        self._events = {name: threading.Event() for name in layers}
        self.cuda_events: dict[str, list[Any]] = {name: [] for name in layers}
        self._lock = threading.Lock()
        if jobs == 0:
            for event in self._events.values():
                event.set()

    def done(self, layer: str, cuda_event: Any = None) -> None:
        with self._lock:
            if cuda_event is not None:
                self.cuda_events[layer].append(cuda_event)
            self._left[layer] -= 1
            if self._left[layer] == 0:
                self._events[layer].set()

    def wait(self, layer: str, timeout: float) -> bool:
        event = self._events.get(layer)
        return event is None or event.wait(timeout)


class WorkerSide:
    def __init__(
        self,
        namespace: bytes,
        num_blocks: int,
        config: ConnectorConfig,
        *,
        load: bool,
        save: bool,
        save_sync: bool,
        num_kv_heads: int,
        tp_size: int = 1,
        tp_rank: int = 0,
        mla: bool = False,
        compression: str = "none",
    ) -> None:
        """`num_kv_heads` (the model's), `tp_size`, `tp_rank`, `mla`: which KV heads this rank
        holds and saves (kvstore_connector.layout); `compression`: the codec its blocks are
        stored with (kvstore_connector.compression; the namespace must name it)."""
        self.namespace = namespace
        self.num_kv_heads = num_kv_heads
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.mla = mla
        self.codec = make_codec(compression)
        self.num_blocks = num_blocks
        self.config = config
        self.load = load
        self.save = save
        self.save_sync = save_sync
        self.client = KVStoreClient(config.address, timeout=config.load_timeout, **config.client_options())
        self.health = StoreHealth(config.address, config.retry_interval, log)
        self.stats = KVStoreConnectorStats()
        self._stats_lock = threading.Lock()
        self._caches: dict[str, torch.Tensor] = {}  # by store layer: its paged view, block-major
        self._load_inline = False  # CPU caches: loads run on the forward thread
        self._specs: list[LayerSpec] = []  # this rank's store layers
        self._block_bytes = 0  # one block's bytes of them (what this rank moves per block)
        self.layout: StoreLayout | None = None
        self._mover: BlockMover | None = None
        self._loader = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvstore-load")
        # one sender thread: a request's layers reach its stream in order
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-save")
        self._gates = _LayerGates([], 0)
        self._load_jobs: list[tuple[LoadSpec, Future[None], Any]] = []  # (spec, job, its pin_all answer)
        self._abandoned = False  # this step's loads were given up: layers stop waiting
        self._load_errors: set[int] = set()
        self._streams: list[LayerStream] = []  # this step's Get/DropSelect calls
        self._errors_lock = threading.Lock()
        self._saves: list[Save] = []  # this step's
        self._saves_opened = False  # this step's saves were opened (or skipped)
        # this step's saves being reserved ahead (open_saves_ahead), on their own thread
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-open")
        self._opening: tuple[list[SaveSpec], Future[Any]] | None = None
        self.backlog = SaveBacklog(int(config.save_backlog_mib * 2**20))
        self._commits: list[Future[None]] = []
        self._transport: Transport | None = None  # chosen once, in register_kv_caches

    # ---- setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = {name: find_block_dim(tensor, self.num_blocks) for name, tensor in kv_caches.items()}
        first = next(iter(views.values()))
        if self.codec is not None and stored_kv_dtype_is_fp8(first.dtype):
            raise ValueError(f"the KV cache is {first.dtype} already: it is stored as it is, not compressed")
        layout = self.layout = StoreLayout.build(
            views, num_kv_heads=self.num_kv_heads, tp_size=self.tp_size, tp_rank=self.tp_rank, mla=self.mla,
            codec=self.codec,
        )  # fmt: skip
        if not layout.saves:  # another rank holds the same heads (replicas, MLA) and saves them
            self.save = False
        self._caches = layout.views
        self._specs = layout.subset_specs
        self._block_bytes = layout.subset_bytes
        self._mover = BlockMover(first.device, self.codec)
        self._load_inline = first.device.type == "cpu"
        grpc = GrpcTransport(
            self.client,
            self.namespace,
            self._specs,
            self._caches,
            self._mover,
            self._sender,
            consume=self.config.consume,
            save_timeout=self.config.save_timeout,
            on_stream=self._track_stream,
            stored=layout.specs,
            subset=layout.subset,
            backlog=None if self.save_sync else self.backlog,  # sync saves hold no backlog
        )
        self._transport = grpc
        # the daemon's arena when this process can map it, with gRPC as its fallback (a
        # save the arena has no room for; consuming loads); else gRPC (with the same-host
        # file reads where offered)
        if prepare_arena(self.client, cuda=self._mover.cuda):
            self._transport = ArenaTransport(
                self.client, self.namespace, self._specs, self._caches, self._mover,
                stored=layout.specs, subset=layout.subset, heads=layout.head_targets, fallback=grpc,
                consume=self.config.consume,
                # a control-plane call on the forward thread: the short deadline of a Lookup
                reserve_timeout=self.config.lookup_timeout,
            )  # fmt: skip
        log.info(
            "kvstore connector: %d layers as %d store layers, block %s %s%s; this rank (tp %d) %s %d of "
            "them (%d of %d bytes/block); namespace %s",
            len(views),
            len(layout.specs),
            self._specs[0].dtype,
            list(self._specs[0].shape),
            f" ({self.codec.name} of {first.dtype})" if self.codec is not None else "",
            self.tp_rank,
            "saves and loads" if layout.saves else "loads",
            len(self._specs),
            layout.subset_bytes,
            sum(s.nbytes for s in layout.specs),
            self.namespace.decode(errors="replace"),
        )
        log.info("kvstore connector: KV moves %s", self._transport.describe())

    def _add_stats(self, **values: float) -> None:
        with self._stats_lock:
            self.stats.add(**values)

    def take_stats(self) -> KVStoreConnectorStats | None:
        with self._stats_lock:
            return self.stats.take()

    # ---- loads
    def start_load(self, meta: KVStoreConnectorMetadata) -> None:
        loads = [spec for spec in meta.loads if spec.block_ids]
        self._gates = _LayerGates([s.name for s in self._specs], len(loads))
        self._abandoned = False
        # several loads: pinned together, one round trip (PinMany), before they start
        pins = self._pin_all(loads)
        if self._load_inline:
            # CPU: the copies and the forward pass share the same cores, so loading
            # beside the forward only slows it (and the two threads fight over the
            # GIL); loading first, in this thread, gave the lowest time to first token.
            for spec, pinned in zip(loads, pins, strict=True):
                self._load_one(spec, self._gates, pinned)
            self._load_jobs = []
            return
        self._load_jobs = [
            (spec, self._loader.submit(self._load_one, spec, self._gates, pinned), pinned)
            for spec, pinned in zip(loads, pins, strict=True)
        ]

    def _pin_all(self, loads: list[LoadSpec]) -> list[Any]:
        """What each of a step's loads starts from: the pin the scheduler side's lookup
        leased for it (no round trip here); for the rest, where they are small, pins made
        together (one PinMany). None: that load pins its own, streamed (PinStream: a cold
        load's copies overlap its reads, where PinMany waits for them), as large loads do."""
        transport = self._transport
        if transport is None:
            return [None] * len(loads)
        pins = [transport.leased(spec) for spec in loads]
        rest = [i for i, pinned in enumerate(pins) if pinned is None]
        if pins.count(None) < len(pins):
            self._add_stats(leased_loads=len(pins) - len(rest))
        blocks = sum(len(loads[i].block_ids) for i in rest)
        if len(rest) < 2 or blocks * self._block_bytes > _PIN_TOGETHER_BYTES or not self.health.available():
            return pins
        together = transport.pin_all([loads[i] for i in rest], self.config.load_timeout)
        for i, pinned in zip(rest, together or (), strict=False):
            pins[i] = pinned
        return pins

    def _load_one(self, spec: LoadSpec, gates: _LayerGates, pinned: Any = None) -> None:
        pending = [s.name for s in self._specs]
        started = time.perf_counter()
        loaded_blocks = 0
        try:
            transport = self._transport
            if transport is None:
                raise RuntimeError("load before register_kv_caches")
            loaded_blocks = transport.load(spec, pending, gates.done, self.config.load_timeout, pinned)
            self.health.ok()
        except (KVStoreError, RuntimeError, ValueError) as exc:
            self.health.failed("load", exc)
        finally:
            for name in pending:
                gates.done(name)
            if loaded_blocks < len(spec.block_ids):
                with self._errors_lock:
                    # a partly written request is recomputed from its first block
                    bad = spec.block_ids if pending else spec.block_ids[loaded_blocks:]
                    self._load_errors.update(bad)
                self._add_stats(load_errors=len(spec.block_ids) - loaded_blocks)
            if loaded_blocks:
                nbytes = loaded_blocks * self._block_bytes  # this rank's heads
                self._add_stats(
                    loads=1,
                    blocks_loaded=loaded_blocks,
                    bytes_loaded=nbytes,
                    load_seconds=time.perf_counter() - started,
                    **{f"bytes_loaded_tp{self.tp_rank}": nbytes},
                )

    def _track_stream(self, stream: LayerStream) -> None:
        """A load's Get/DropSelect call: cancelled if this step gives up its loads."""
        with self._errors_lock:
            self._streams.append(stream)

    def wait_for_layer(self, layer: str) -> None:
        if self._abandoned:
            return
        if not self._gates.wait(layer, self.config.load_timeout):
            log.warning("kvstore load of layer %s timed out; its requests will be recomputed", layer)
            self._give_up_loads()
            return
        if self._mover is not None:
            for event in self._gates.cuda_events.get(layer, ()):
                self._mover.wait_on_compute_stream(event)

    def _give_up_loads(self) -> None:
        # Cancelling the calls ends the loader threads promptly (their blocks are
        # then reported as load errors) so nothing writes into the paged buffer
        # once vLLM starts recomputing those blocks.
        with self._errors_lock:
            self._abandoned = True
            for spec, job, pinned in self._load_jobs:
                if job.cancel():  # never started: nothing of it reached the paged buffer
                    self._load_errors.update(spec.block_ids)
                    if pinned is not None and not isinstance(pinned, Exception):
                        pinned.release()  # pinned ahead (pin_all): not held until its lease ends
            for stream in self._streams:
                stream.cancel()

    def block_ids_with_load_errors(self) -> set[int]:
        deadline = time.monotonic() + self.config.load_timeout
        for _spec, job, _pinned in self._load_jobs:
            if job.cancelled():
                continue
            try:
                job.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                log.warning("kvstore loads still running at the end of the step; recomputing them")
                self._give_up_loads()
                break
        self._load_jobs = []
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
            self._streams = []
        return errors

    # ---- saves
    def save_layer(self, meta: KVStoreConnectorMetadata, layer: str) -> None:
        if not meta.saves or not self.save or self.layout is None or layer not in self.layout.by_layer:
            return
        if not self._saves_opened:  # the step's first layer: open its saves once
            self._saves_opened = True
            self._open_saves(meta.saves)
        if self._saves and self._transport is not None:
            # this rank's KV heads of the layer; their paged view: one indexed copy for all
            self._transport.save_layer(self._saves, self.layout.by_layer[layer], self.layout.heads.get(layer))

    def open_saves_ahead(self, meta: KVStoreConnectorMetadata) -> None:
        """Start reserving this step's saves (one ReserveMany through the arena) before the
        forward pass (start_load_kv), on the opener thread: its first saved layer then
        finds the round trip done instead of waiting for it."""
        if not meta.saves or not self.save or self.layout is None or self._opening is not None:
            return
        transport = self._transport
        if transport is None or not self.health.available():
            return
        specs = list(meta.saves)
        self._opening = (specs, self._opener.submit(transport.reserve_all, specs))

    def _open_saves(self, specs: list[SaveSpec]) -> None:
        transport = self._transport
        if transport is None:
            raise RuntimeError("save before register_kv_caches")
        ahead = self._opening
        if ahead is not None and ahead[0] != specs:  # not this step's (never expected)
            self._drop_opening()
            ahead = None
        self._opening = None
        if ahead is not None:
            opened = transport.open_reserved(specs, ahead[1].result())
        elif self.health.available():
            opened = transport.open_reserved(specs, transport.reserve_all(specs))  # one round trip
        else:
            return
        for save in opened:
            if isinstance(save, KVStoreError):  # e.g. the store is down or stalled: skip saves for a while
                self._add_stats(save_errors=1)
                self.health.failed("save", save)
                continue
            if save is None:  # the backlog is full
                self._add_stats(saves_dropped=1)
                continue
            self._saves.append(save)

    def _drop_opening(self) -> None:
        """Saves reserved ahead that no layer of their step saved (never expected of vLLM):
        their reservations go back."""
        ahead, self._opening = self._opening, None
        if ahead is None or self._transport is None:
            return
        log.warning("kvstore: a step's saves were reserved but no layer was saved; giving them back")
        self._transport.unreserve(ahead[1].result())

    def finish_step_saves(self) -> None:
        """Commit this step's saves; in sync mode, wait until the store has them."""
        self._drop_opening()
        saves, self._saves = self._saves, []
        self._saves_opened = False
        self._commits = [f for f in self._commits if not f.done()]
        if saves:  # one task, one round trip where the transport can (CommitMany)
            self._commits.append(self._sender.submit(self._commit_all, saves))
        if self.save_sync:
            self.wait_for_commits()

    def _commit_all(self, saves: list[Save]) -> None:
        if self._transport is None:
            raise RuntimeError("a save without a transport")
        for save, result in zip(saves, self._transport.commit_all(saves), strict=True):
            if isinstance(result, Exception):
                self._add_stats(save_errors=1)
                self.health.failed("save", result)
                continue
            self.health.ok()
            if result is not None:
                self._saved(result.blocks_written, result.blocks_sent, save.started)

    def _saved(self, blocks_written: int, blocks_sent: int, started: float) -> None:
        """Stats of a committed save: the blocks it made visible (with tensor parallelism, the
        last rank's part of a block does), the bytes this rank moved (its KV heads)."""
        nbytes = blocks_sent * self._block_bytes
        self._add_stats(
            saves=1,
            blocks_saved=blocks_written,
            bytes_saved=nbytes,
            save_seconds=time.perf_counter() - started,
            **{f"bytes_saved_tp{self.tp_rank}": nbytes},
        )

    def wait_for_commits(self) -> None:
        """Wait until this worker's saves are committed or failed. Each is bounded by the
        store's progress (see PutStream), never by how long the engine computed."""
        commits, self._commits = self._commits, []
        for future in commits:
            future.result()

    def close(self) -> None:
        self._drop_opening()
        self._opener.shutdown(wait=True)
        self.wait_for_commits()
        self._sender.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        self.client.close()

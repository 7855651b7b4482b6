"""The worker's gRPC transport: KV moves as the daemon's byte streams (Put, Get,
DropSelect), or, for loads on the same host, from the daemon's files.

Saves (per step): one PutStream per request, opened at the step's first saved
layer. `save_layer` gathers each store layer's blocks of every gRPC save of the
step with one indexed copy and hands each request its slice on the sender thread
(one thread: a request's layers reach its stream in order); the commit runs on
that thread after the request's layers. Async saves hold their KV in host memory
until the store has it: the worker's SaveBacklog bounds that, and a save it has no
room for is dropped.

Loads: two choices, each made once at construction and never mixed per load:
- the source: consume → DropSelect (`take_stream`, the blocks are freed), else
  Get (`get_stream`, which reads the daemon's files when the client may);
- the placement: contiguous CPU caches → each received block is copied straight
  into its page (PagePlacement, one copy); else each layer lands in a host buffer
  (pinned on CUDA) and is scattered into the pages (ScatterPlacement, BlockMover).
Each layer is reported done (`done(layer_name, event)`) as it is placed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore_client import KVStoreClient, LayerSpec, LayerStream, PutStream
from kvstore_client.errors import KVStoreError
from kvstore_client.tensors import torch_dtype, writable_view
from kvstore_connector.metadata import LoadSpec, SaveSpec
from kvstore_connector.transfer import BlockMover, PendingCopy
from kvstore_connector.transport import Committed, Done, Opened, Reserved, Save, commit_each, open_each

log = logging.getLogger("vllm." + __name__)


class SaveBacklog:
    """Bytes of KV that async saves hold in host memory until the store has them.

    A slow store (alive, but taking saves slower than the engine makes KV) would
    otherwise grow the sender's queue without end, in pinned memory on GPUs, until
    the host runs out. `admit` is called on the forward thread when a save opens,
    `release` on the sender thread when it ends (committed or failed). One WARNING
    when saves start being dropped, one INFO when one is taken again.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._lock = threading.Lock()
        self._pending = 0
        self._dropped = 0  # saves dropped since the backlog last had room

    @property
    def pending(self) -> int:
        return self._pending

    def admit(self, nbytes: int) -> bool:
        """Reserve `nbytes` for a save, or refuse it: False means drop the save."""
        with self._lock:
            if self._pending and self._pending + nbytes > self.limit:
                if not self._dropped:
                    log.warning(
                        "kvstore saves are behind: %.0f MiB of KV waiting for the store (save_backlog_mib "
                        "%.0f); new saves are dropped until it drains",
                        self._pending / 2**20,
                        self.limit / 2**20,
                    )
                self._dropped += 1
                return False
            if self._dropped:
                log.info("kvstore saves caught up; %d saves were dropped meanwhile", self._dropped)
                self._dropped = 0
            self._pending += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes


@dataclass
class _Gather:
    """A step's gRPC saves' paged block ids, in order: each store layer is gathered once
    for all of them (made at the step's first saved layer, shared by its saves)."""

    ids: torch.Tensor


@dataclass
class GrpcSave:
    spec: SaveSpec
    stream: PutStream
    started: float
    reserved: int = 0  # bytes held in the worker's save backlog (async saves)
    nbytes: int = 0
    layers: list[Future[None]] = field(default_factory=list)
    gather: _Gather | None = None


class PagePlacement:
    """Contiguous CPU caches: copy each received block straight into its paged block."""

    def __init__(self, caches: dict[str, torch.Tensor]) -> None:
        # the caches' bytes (a view's blocks may lie apart: a KV head's slice of each block)
        # and each one's block stride: loads copy received blocks straight into these
        self._raw = {name: _pages(view) for name, view in caches.items()}

    def place(self, stream: LayerStream, block_ids: list[int], pending: list[str], done: Done) -> None:
        raw = self._raw
        for spec, (_, first_block, data), last in stream.layer_chunks():
            size, (dest, stride) = spec.nbytes, raw[spec.name]
            for i in range(len(data) // size):
                at = block_ids[first_block + i] * stride
                dest[at : at + size] = data[i * size : (i + 1) * size]
            if last:
                pending.remove(spec.name)
                done(spec.name)


def pages_addressable(caches: dict[str, torch.Tensor]) -> bool:
    """Whether every (block-major) view is on the CPU with each block's slice contiguous: a
    load can then copy received blocks straight into their pages (PagePlacement)."""
    return all(v.device.type == "cpu" and v[0].is_contiguous() for v in caches.values())


def _pages(view: torch.Tensor) -> tuple[memoryview, int]:
    """The bytes under a block-major CPU view whose block slices are contiguous, from its
    first block's start, and the stride between blocks in bytes."""
    stride = view.stride(0)
    span = (view.shape[0] - 1) * stride + view[0].numel()
    flat = view.as_strided((span,), (1,), view.storage_offset())
    return memoryview(writable_view(flat).data), stride * view.element_size()


class ScatterPlacement:
    """Any other caches (GPU, non-contiguous views): each layer into a host buffer, then
    one indexed scatter into its pages (on CUDA on side streams: the layer's event)."""

    def __init__(self, caches: dict[str, torch.Tensor], mover: BlockMover) -> None:
        self._caches = caches
        self._mover = mover

    def place(self, stream: LayerStream, block_ids: list[int], pending: list[str], done: Done) -> None:
        ids = self._mover.index(block_ids)
        for name, host in stream:
            event = self._mover.scatter(self._caches[name], ids, host)
            pending.remove(name)
            done(name, event)


class GrpcTransport:
    def __init__(
        self,
        client: KVStoreClient,
        namespace: bytes,
        specs: list[LayerSpec],
        caches: dict[str, torch.Tensor],
        mover: BlockMover,
        sender: ThreadPoolExecutor,
        *,
        consume: bool,
        save_timeout: float,
        on_stream: Callable[[LayerStream], None],
        stored: Sequence[LayerSpec] | None = None,
        subset: Sequence[int] = (),
        backlog: SaveBacklog | None = None,
    ) -> None:
        """`sender`: the worker's one save thread; `on_stream`: told of each load's stream
        as it opens (the worker cancels this step's streams when it gives up its loads).
        `stored`, `subset`: as for ArenaTransport (this rank's layers of a block's layout).
        `backlog`: async saves (their KV waits in host memory) are admitted by it; None:
        saves are synchronous (the step waits for them) and never dropped."""
        self.client = client
        self.backlog = backlog
        self._block_bytes = sum(spec.nbytes for spec in specs)
        self.namespace = namespace
        self.specs = specs
        self.stored = list(specs if stored is None else stored)
        self.subset = tuple(subset)
        self.caches = caches
        self.mover = mover
        self._sender = sender
        self._save_timeout = save_timeout
        self._on_stream = on_stream
        self._open_stream = self._take_stream if consume else self._get_stream
        self._placement: PagePlacement | ScatterPlacement = (
            PagePlacement(caches)
            if pages_addressable(caches) and mover.codec is None  # packed rows are decoded first
            else ScatterPlacement(caches, mover)
        )
        self._local = False  # the last load read the daemon's files directly

    def describe(self) -> str:
        return "over gRPC"

    # ---- saves
    def open(self, spec: SaveSpec) -> GrpcSave | None:
        reserved = 0
        if self.backlog is not None:
            reserved = len(spec.block_ids) * self._block_bytes
            if not self.backlog.admit(reserved):
                return None
        try:
            stream = self.client.put_stream(
                self.namespace,
                spec.hashes,
                self.stored,
                parent_hash=spec.parent_hash,
                timeout=self._save_timeout,
                arena=False,  # this is the gRPC transport: the arena's saves are ArenaTransport's
                token_ids=spec.token_ids,
                subset=self.subset,
            )
        except BaseException:
            self._release(reserved)
            raise
        return GrpcSave(spec, stream, time.perf_counter(), reserved)

    def reserve_all(self, specs: Sequence[SaveSpec]) -> Reserved:
        return None  # nothing to do ahead: a stream opens without a round trip

    def open_reserved(self, specs: Sequence[SaveSpec], reserved: Reserved) -> Opened:
        return open_each(self, specs)  # a stream per save: nothing to batch

    def unreserve(self, reserved: Reserved) -> None:
        return None

    def commit_all(self, saves: Sequence[Save]) -> list[Committed | None | Exception]:
        return commit_each(self, saves)

    def save_layer(self, saves: Sequence[Save], names: Sequence[str], heads: torch.Tensor | None) -> None:
        """Each of `names` gathered once for all `saves` (`heads` is not used: a request's
        stream takes its layers one by one)."""
        mine = [save for save in saves if isinstance(save, GrpcSave)]
        if not mine:
            return
        gather = mine[0].gather
        if gather is None:  # the step's first saved layer
            gather = _Gather(self.mover.index([b for s in mine for b in s.spec.block_ids]))
            for save in mine:
                save.gather = gather
        for name in names:
            copy = self.mover.gather(self.caches[name], gather.ids)  # one indexed copy for every request
            offset = 0
            for save in mine:
                n = len(save.spec.block_ids)
                save.layers.append(self._sender.submit(self._send_layer, save, name, copy, offset, n))
                offset += n

    def _send_layer(self, save: GrpcSave, layer: str, copy: PendingCopy, offset: int, n: int) -> None:
        host = copy.wait()
        part = host[offset : offset + n].contiguous()
        save.stream.write_layer(layer, part)
        save.nbytes += part.numel() * part.element_size()

    def commit(self, save: Save) -> Committed:
        """Wait for the save's layers, then commit it (the sender thread)."""
        if not isinstance(save, GrpcSave):
            raise TypeError(f"not a gRPC save: {type(save).__name__}")
        try:
            for layer in save.layers:
                layer.result()
            result = save.stream.commit()
        except Exception:
            save.stream.abort()
            raise
        finally:
            save.gather = None
            self._release(save.reserved)
        return Committed(result.blocks_written, len(save.spec.block_ids))

    def _release(self, reserved: int) -> None:
        if self.backlog is not None and reserved:
            self.backlog.release(reserved)

    # ---- loads
    def leased(self, spec: LoadSpec) -> Any | None:
        if spec.lease is not None:  # streams read no pin: this rank's share goes back
            self.client.release_lease(spec.lease, namespace=self.namespace, all_holders=False)
        return None

    def pin_all(self, specs: Sequence[LoadSpec], timeout: float) -> list[Any] | None:
        return None  # streams: nothing is pinned

    def load(self, spec: LoadSpec, pending: list[str], done: Done, timeout: float, pinned: Any = None) -> int:
        """Load the stored prefix of spec.hashes into its paged blocks; the blocks loaded.
        `done(layer_name, event)` is called as each layer is placed."""
        stream = self._open_stream(spec.hashes, timeout)
        self._on_stream(stream)
        if stream.local != self._local:
            self._local = stream.local
            log.info(
                "kvstore connector: loads read %s",
                f"the daemon's files in {self.client.local_data_dir} (same host)"
                if stream.local
                else "over gRPC",
            )
        n = stream.num_blocks
        if n and [(s.name, s.dtype, s.shape) for s in stream.layers] != [
            (s.name, s.dtype, s.shape) for s in self.specs
        ]:
            stream.cancel()
            raise KVStoreError("stored layers do not match this engine's KV cache layout")
        self._placement.place(stream, spec.block_ids[:n], pending, done)
        return n

    def _take_stream(self, hashes: list[bytes], timeout: float) -> LayerStream:
        return self.client.take_stream(
            self.namespace, hashes, wait=1.0, transfer_timeout=timeout, allocate=self._host_buffer,
            subset=self.subset,
        )  # fmt: skip

    def _get_stream(self, hashes: list[bytes], timeout: float) -> LayerStream:
        return self.client.get_stream(
            self.namespace, hashes, timeout=timeout, allocate=self._host_buffer, subset=self.subset
        )

    def _host_buffer(self, spec: LayerSpec, num_blocks: int) -> torch.Tensor:
        return self.mover.host_buffer((num_blocks, *spec.shape), torch_dtype(spec.dtype))

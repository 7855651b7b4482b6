"""The client's streams: loads (LayerStream over a LayerSource), saves (PutStream), Watch.

    LayerSource   protocol: where a load's bytes come from (gRPC, the daemon's files, ...)
    ChunkOrder    the one definition of the order a load's chunks come in, checked
    CallSource    a Get or DropSelect call as a LayerSource
    LayerStream   a load in progress: (name, tensor) per layer, or the raw chunks
    PutStream     a Put in progress: write each layer, then commit
    WatchStream   a Watch in progress: Events until cancelled

No grpc here: calls arrive wrapped by kvstore_client._rpc, errors already mapped.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvstore import wire
from kvstore.blocks import STOP_UNKNOWN
from kvstore.service import WATCH_START_SEQUENCE_KEY, WATCH_STORE_ID_KEY
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client._rpc import PutCall, ServerStream
from kvstore_client.tensors import byte_view, dtype_name, torch_dtype, writable_view
from kvstore_client.types import EVENT_REMOVED, EVENT_STORED, Event, LayerSpec, PutResult

if TYPE_CHECKING:
    import torch


class LayerSource(Protocol):
    """Where a LayerStream's blocks come from.

    Implemented by CallSource (a Get or DropSelect over gRPC) and by the same-host
    reader's source (kvstore_client.local, the daemon's files). A source is made by
    the client call that starts the load, with its header known:

        num_blocks  blocks in the load (the stored prefix; 0 on a miss), fixed
        layers      the blocks' layer specs, in stream order, fixed
        chunks()    called at most once: the load's bytes as wire.Chunk(layer_index,
                    first_block, data) in ChunkOrder (layer 0's blocks from block 0 up,
                    then layer 1's, ...), each holding whole blocks of one layer; a
                    chunk's `data` is valid until the next chunk is asked for. Verified
                    bytes only (a source checks checksums it has not had checked).
                    Raises KVStoreError; releases what the source holds when it ends,
                    fails or is closed
        cancel()    from any thread, while another iterates: the iteration ends with a
                    KVStoreError at its next chunk, never under a copy in progress.
                    Safe to call twice, and after the end
        stop_reason optional: why num_blocks is short of the blocks asked for, one of
                    kvstore.blocks' STOP_* reasons (a source without it: "unknown")
    """

    @property
    def num_blocks(self) -> int: ...

    @property
    def layers(self) -> Sequence[LayerSpec]: ...

    def chunks(self) -> Iterator[wire.Chunk]: ...

    def cancel(self) -> None: ...


class ChunkOrder:
    """Checks that a load's chunks come in stream order, and tells where each completes.

    Stream order: layer 0's blocks from block 0 up, then layer 1's, and so on; a chunk
    holds whole blocks of one layer (zero or more). One per load; `place` once per chunk.
    """

    __slots__ = ("_layers", "_num_blocks", "_layer", "_next_block")

    def __init__(self, layers: Sequence[LayerSpec], num_blocks: int) -> None:
        self._layers = layers
        self._num_blocks = num_blocks
        self._layer = 0 if num_blocks else len(layers)
        self._next_block = 0

    @property
    def done(self) -> bool:
        """Whether every layer's blocks have come."""
        return self._layer >= len(self._layers)

    def place(self, chunk: wire.Chunk) -> bool:
        """Check that `chunk` comes next; True when it completes its layer.
        Raises StoreInternalError for a chunk out of order or past the end."""
        if self._layer >= len(self._layers):
            raise errors.StoreInternalError("unexpected data after the last layer")
        spec = self._layers[self._layer]
        count, rest = divmod(len(chunk.data), spec.nbytes)
        if (
            chunk.layer_index != self._layer
            or chunk.first_block != self._next_block
            or rest
            or self._next_block + count > self._num_blocks
        ):
            raise errors.StoreInternalError(f"out-of-order data in Get stream at layer {spec.name!r}")
        self._next_block += count
        if self._next_block < self._num_blocks:
            return False
        self._layer += 1
        self._next_block = 0
        return True

    def finish(self) -> None:
        """The source ended: raises StoreInternalError if blocks are missing."""
        if not self.done:
            raise errors.StoreInternalError("Get stream ended early")


class CallSource:
    """A Get or DropSelect call as a LayerSource: the header is read on creation."""

    def __init__(self, stream: ServerStream) -> None:
        self._stream = stream
        try:
            first = next(stream)
        except StopIteration:
            raise errors.StoreInternalError("empty Get stream") from None
        if not isinstance(first, pb.GetResponse) or first.WhichOneof("msg") != "header":
            stream.cancel()
            raise errors.StoreInternalError("Get stream did not start with a header")
        self.num_blocks: int = first.header.num_blocks
        self.stop_reason = wire.stop_reason_name(first.header.stop_reason)
        try:
            self.layers = [LayerSpec(s.name, s.dtype, tuple(s.shape)) for s in first.header.layers]
        except ValueError as exc:
            stream.cancel()
            raise errors.StoreInternalError(f"bad Get stream header: {exc}") from exc

    def chunks(self) -> Iterator[wire.Chunk]:
        # Read the call to its end: the server finishes its side (and counts the read)
        # when the stream closes, not at its last chunk.
        for msg in self._stream:
            if not isinstance(msg, wire.Chunk):
                raise errors.StoreInternalError(f"unexpected {type(msg).__name__} in Get stream")
            yield msg

    def cancel(self) -> None:
        self._stream.cancel()


class LayerStream:
    """A Get in progress: `num_blocks`, `layers`, then iterate (name, tensor) per layer.

    Layer i is yielded as soon as its bytes arrived, while later layers are
    still in flight. `allocate(spec, num_blocks)` may supply each destination
    tensor (e.g. pinned memory); by default a new CPU tensor is made. `via`
    says where the bytes come from: "arena" (the daemon's memory tier, mapped
    here: kvstore_client.arena), "files" (the daemon's backend files, read here:
    kvstore_client.local) or "grpc"; `local` is true for the first two.
    `stop_reason` says why `num_blocks` is short of the blocks asked for (one of
    kvstore.blocks' STOP_* reasons: "none" when it is not).
    Iterate it once, in one of its three ways.
    """

    def __init__(
        self,
        source: LayerSource,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
        *,
        via: str = "grpc",
    ) -> None:
        self._source = source
        self._allocate = allocate
        self.via = via
        self.local = via != "grpc"
        self.num_blocks: int = source.num_blocks
        self.layers: list[LayerSpec] = list(source.layers)
        self.stop_reason: str = getattr(source, "stop_reason", STOP_UNKNOWN)

    def layer_chunks(self) -> Iterator[tuple[LayerSpec, wire.Chunk, bool]]:
        """Each chunk with its layer's spec and whether it completes that layer.

        For callers that place blocks themselves (the connector scatters them
        straight into a paged KV cache); the views are valid until the next chunk.
        The order is checked (ChunkOrder): StoreInternalError for a broken stream.
        """
        order = ChunkOrder(self.layers, self.num_blocks)
        layers = self.layers
        for chunk in self._source.chunks():
            last = order.place(chunk)
            yield layers[chunk.layer_index], chunk, last
        order.finish()

    def chunks(self) -> Iterator[wire.Chunk]:
        """The raw stream: each chunk's layer index, first block and bytes, in order
        (see layer_chunks); a layer is complete when a chunk reaches its last block."""
        for _spec, chunk, _last in self.layer_chunks():
            yield chunk

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import numpy as np
        import torch

        tensor: torch.Tensor | None = None
        dest: Any = None
        for spec, (_, first_block, data), last in self.layer_chunks():
            if first_block == 0:
                shape = (self.num_blocks, *spec.shape)
                if self._allocate is not None:
                    tensor = self._allocate(spec, self.num_blocks)
                    if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != spec.dtype:
                        raise ValueError(f"allocate gave {tensor.dtype} {list(tensor.shape)} for {spec}")
                else:
                    tensor = torch.empty(shape, dtype=torch_dtype(spec.dtype))
                dest = writable_view(tensor)
            start = first_block * spec.nbytes
            dest[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            if last and tensor is not None:
                yield spec.name, tensor

    def cancel(self) -> None:
        """Stop the transfer; safe from another thread while this one iterates."""
        self._source.cancel()

    def read_all(self) -> dict[str, torch.Tensor]:
        return dict(self)


_END = object()


class LayerWrites:
    """The bookkeeping of a put's layers: each written once, as a [num_blocks, *shape]
    tensor of its spec; the commit needs them all. Shared by PutStream (gRPC) and
    kvstore_client.arena.ArenaPutStream."""

    def __init__(self, layers: Sequence[LayerSpec], num_blocks: int) -> None:
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self._index = {spec.name: i for i, spec in enumerate(self.layers)}
        self._written: set[int] = set()

    def take(self, layer: str | int, tensor: torch.Tensor) -> tuple[int, LayerSpec]:
        """Check one layer's tensor and mark the layer written; its index and spec."""
        index = self._index[layer] if isinstance(layer, str) else layer
        spec = self.layers[index]
        if index in self._written:
            raise ValueError(f"layer {spec.name!r} was already written")
        if tuple(tensor.shape) != (self.num_blocks, *spec.shape) or dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"layer {spec.name!r}: expected {spec.dtype} {[self.num_blocks, *spec.shape]}, "
                f"got {dtype_name(tensor.dtype)} {list(tensor.shape)}"
            )
        self._written.add(index)
        return index, spec

    def missing(self) -> list[str]:
        return [s.name for i, s in enumerate(self.layers) if i not in self._written]


class PutStream:
    """An open Put: write each layer once (any order), then `commit()`.

    Nothing is visible on the store until commit returns. `abort()` (or leaving
    a `with` block by an exception) cancels it and leaves nothing behind; a
    stream must end in one of the two. write_layer never waits for the network:
    the layer queues for gRPC's sender, which reads the tensor's memory when it
    sends it, so a written tensor must stay unmodified until commit() returns.

    `timeout` bounds the store, never the writer: the stream fails with
    StoreTimeout once the store has had data to take, or the commit to answer,
    and made no progress for `timeout` seconds. A writer may take as long as it
    likes between layers (a long forward pass) without the stream expiring.
    """

    def __init__(
        self,
        start: Callable[[Iterator[Any]], PutCall],
        header: pb.PutHeader,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        timeout: float,
        chunk_bytes: int,
    ) -> None:
        """`start(requests)` opens the Put call that sends what `requests` yields."""
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.timeout = timeout
        self._writes = LayerWrites(self.layers, num_blocks)
        self._chunk_bytes = chunk_bytes
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue.put(pb.PutRequest(header=header))
        # When gRPC's sender last took a message: it takes the next one only once the
        # transport accepted the previous, so an old stamp with messages waiting (or
        # with the commit sent and no answer) is a store that stopped taking data.
        self._progress = time.monotonic()
        self._sent_all = False
        self._call = start(self._requests())
        self._done = False

    def _requests(self) -> Iterator[Any]:
        # Runs on gRPC's sender: a chunk is encoded (its one copy) only when the
        # transport wants it, so a put's bytes are never all duplicated at once.
        while (item := self._queue.get()) is not _END:
            self._progress = time.monotonic()
            if isinstance(item, tuple):
                index, first, view = item
                yield wire.encode_chunk(index, first, [view])
            else:
                yield item
        self._progress = time.monotonic()
        self._sent_all = True

    def _stalled_for(self) -> float:
        """Seconds the store has had work and taken none of it; 0 while it is the writer's turn."""
        if not self._sent_all and self._queue.empty():
            return 0.0
        return time.monotonic() - self._progress

    def _store_turn(self) -> None:
        """Work is about to be queued: if it was the writer's turn, the store's starts now.
        Else the stamp from before the writer's pause would count against the store until
        gRPC's sender woke up for the new work (a spurious timeout on a busy host)."""
        if self._queue.empty():
            self._progress = time.monotonic()

    def _check_progress(self) -> None:
        stalled = self._stalled_for()
        if stalled > self.timeout:
            self.abort()
            raise errors.StoreTimeout(
                f"the store took no data of this put for {stalled:.1f}s (timeout {self.timeout:g}s)",
                "DEADLINE_EXCEEDED",
            )

    def write_layer(self, layer: str | int, tensor: torch.Tensor) -> None:
        """Send one layer's [num_blocks, *shape] CPU tensor. Returns at once.

        Raises StoreTimeout (and aborts) when the store has stalled on this stream."""
        self._check_progress()
        index, spec = self._writes.take(layer, tensor)
        view = byte_view(tensor)
        per_block = spec.nbytes
        per_chunk = max(1, self._chunk_bytes // per_block)
        self._store_turn()
        for first in range(0, self.num_blocks, per_chunk):
            end = min(self.num_blocks, first + per_chunk)
            self._queue.put((index, first, view[first * per_block : end * per_block]))

    def commit(self) -> PutResult:
        """Commit and wait for the store's answer. Raises KVStoreError on failure."""
        missing = self._writes.missing()
        if missing:
            self.abort()
            raise ValueError(f"commit without layers {missing[:4]}")
        self._store_turn()
        self._queue.put(pb.PutRequest(commit=pb.PutCommit()))
        self._queue.put(_END)
        while True:
            try:
                resp = self._call.result(timeout=max(0.0, self.timeout - self._stalled_for()) + 0.01)
            except errors.KVStoreError:
                self._done = True
                raise
            if resp is not None:
                break
            self._check_progress()  # raises once the store is really stuck
        self._done = True
        return PutResult(resp.blocks_written, resp.blocks_skipped, resp.bytes_written, resp.blocks_evicted)

    def abort(self) -> None:
        """Cancel the put; the store keeps nothing of it. Safe to call twice."""
        if not self._done:
            self._done = True
            self._call.cancel()
            self._queue.put(_END)

    def __enter__(self) -> PutStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or not self._done:
            self.abort()


_KINDS = {pb.Event.STORED: EVENT_STORED, pb.Event.REMOVED: EVENT_REMOVED}


class WatchStream:
    """An open Watch: iterate it for Events, in order, until `cancel()` or an error.

    The subscription is in place when KVStoreClient.watch returns: every change
    committed after that is delivered. Iterating blocks while nothing happens;
    `cancel()` (from any thread, or leaving a `with` block) ends the iteration
    quietly. The daemon shutting down raises StoreUnavailable; falling behind
    its event window raises EventsOutOfRange.
    """

    def __init__(self, stream: ServerStream) -> None:
        self._stream = stream
        metadata = stream.initial_metadata(WATCH_STORE_ID_KEY, "Watch")  # waits until subscribed
        self.store_id: str = metadata[WATCH_STORE_ID_KEY]
        """The daemon's id for this run."""
        self.start_sequence: int = int(metadata.get(WATCH_START_SEQUENCE_KEY, 0))
        """The first sequence this stream can deliver (events of other namespaces are skipped)."""

    def __iter__(self) -> Iterator[Event]:
        for msg in self._stream:
            yield Event(
                sequence=msg.sequence,
                kind=_KINDS.get(msg.kind, "unknown"),
                namespace=msg.namespace,
                block_hashes=tuple(msg.block_hashes),
                parent_hashes=tuple(msg.parent_hashes),
                timestamp=msg.timestamp,
                store_id=msg.store_id,
            )

    def cancel(self) -> None:
        """End the stream; a blocked iteration returns. Safe to call twice, from any thread."""
        self._stream.cancel()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

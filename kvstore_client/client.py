"""KVStoreClient: the Python client, and the only code that speaks gRPC to the store.

    with KVStoreClient("127.0.0.1:50051") as kv:
        kv.insert("ns", hashes, {"layer.0": t0, "layer.1": t1})   # non-blocking -> Future
        n = kv.lookup("ns", hashes)                                # blocks stored as a prefix
        layers = kv.select("ns", hashes)                           # {} on a miss
        layers = kv.drop_select("ns", hashes, timeout=5.0)         # waits, then consumes
        with kv.watch(from_sequence=0) as events:                  # stored/removed Events
            for event in events: ...                               # until events.cancel()

Tensors: one per layer, dim 0 indexes blocks, every layer with the same
number of blocks; contiguous CPU tensors (copy device tensors to pinned host
memory first). Streaming forms, one layer at a time: `put_stream` (write each
layer when it is ready, then commit) and `get_stream` (iterate layers as they
arrive).

Thread-safe: one client may be shared by threads. Every call has a deadline
(`timeout`, default from the constructor). Errors are kvstore_client.errors.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvstore import wire
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.local import LocalReads
from kvstore_client.tensors import byte_view, dtype_name, torch_dtype, writable_view

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_MAX_TOUCHES = 1024

_SERVICE = "/kvstore.v1.KVStore/"
# Initial metadata of a Watch stream (see WatchRequest in the proto).
_WATCH_STORE_ID = "kvstore-store-id"
_WATCH_START_SEQUENCE = "kvstore-start-sequence"
EVENT_STORED = "stored"
EVENT_REMOVED = "removed"


def _pem(value: str | Path | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call (works without TLS too)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), self._header],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _ns(namespace: str | bytes) -> bytes:
    return namespace.encode() if isinstance(namespace, str) else bytes(namespace)


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer's per-block slice: a layer tensor of N blocks is [N, *shape]."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def block_bytes(self) -> int:
        return wire.layer_block_bytes(self.dtype, self.shape)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> LayerSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape[1:]))


@dataclass(frozen=True, slots=True)
class PutResult:
    blocks_written: int
    blocks_skipped: int
    bytes_written: int
    blocks_evicted: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    blocks_evicted: int
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class Event:
    """One change of the store as Watch reports it: blocks of one namespace stored or removed."""

    sequence: int
    """1, 2, 3, ... in commit order; restarts with every daemon start (see store_id)."""
    kind: str
    """EVENT_STORED ("stored") or EVENT_REMOVED ("removed")."""
    namespace: bytes
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes, ...]
    """Stored: each block's parent (b"" where a chain starts). Removed: ()."""
    timestamp: float
    """Unix seconds of the commit."""
    store_id: str
    """Random per daemon start: a new value means the store's picture must be rebuilt."""


_KINDS = {pb.Event.STORED: EVENT_STORED, pb.Event.REMOVED: EVENT_REMOVED}


class WatchStream:
    """An open Watch: iterate it for Events, in order, until `cancel()` or an error.

    The subscription is in place when KVStoreClient.watch returns: every change
    committed after that is delivered. Iterating blocks while nothing happens;
    `cancel()` (from any thread, or leaving a `with` block) ends the iteration
    quietly. The daemon shutting down raises StoreUnavailable; falling behind
    its event window raises EventsOutOfRange.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False
        metadata = dict(call.initial_metadata() or ())  # waits until subscribed, or the call failed
        if _WATCH_STORE_ID not in metadata:
            if call.code() is grpc.StatusCode.OK:
                raise errors.StoreInternalError("Watch stream ended before it started")
            raise errors.from_rpc_error(call)
        self.store_id: str = metadata[_WATCH_STORE_ID]
        """The daemon's id for this run."""
        self.start_sequence: int = int(metadata.get(_WATCH_START_SEQUENCE, 0))
        """The first sequence this stream can deliver (events of other namespaces are skipped)."""

    def __iter__(self) -> Iterator[Event]:
        try:
            for msg in self._call:
                yield Event(
                    sequence=msg.sequence,
                    kind=_KINDS.get(msg.kind, "unknown"),
                    namespace=msg.namespace,
                    block_hashes=tuple(msg.block_hashes),
                    parent_hashes=tuple(msg.parent_hashes),
                    timestamp=msg.timestamp,
                    store_id=msg.store_id,
                )
        except grpc.RpcError as exc:
            if self._cancelled and exc.code() is grpc.StatusCode.CANCELLED:
                return
            raise errors.from_rpc_error(exc) from exc

    def cancel(self) -> None:
        """End the stream; a blocked iteration returns. Safe to call twice, from any thread."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


_END = object()


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
        client: KVStoreClient,
        header: pb.PutHeader,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        timeout: float,
    ) -> None:
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.timeout = timeout
        self._index = {spec.name: i for i, spec in enumerate(self.layers)}
        self._written: set[int] = set()
        self._chunk_bytes = client.chunk_bytes
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue.put(pb.PutRequest(header=header))
        # When gRPC's sender last took a message: it takes the next one only once the
        # transport accepted the previous, so an old stamp with messages waiting (or
        # with the commit sent and no answer) is a store that stopped taking data.
        self._progress = time.monotonic()
        self._sent_all = False
        # NOTE: no gRPC deadline: it would run through the writer's own time too.
        self._future = client._put.future(self._requests())
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
        index = self._index[layer] if isinstance(layer, str) else layer
        spec = self.layers[index]
        if index in self._written:
            raise ValueError(f"layer {spec.name!r} was already written")
        if tuple(tensor.shape) != (self.num_blocks, *spec.shape) or dtype_name(tensor.dtype) != spec.dtype:
            raise ValueError(
                f"layer {spec.name!r}: expected {spec.dtype} {[self.num_blocks, *spec.shape]}, "
                f"got {dtype_name(tensor.dtype)} {list(tensor.shape)}"
            )
        self._check_progress()
        view = byte_view(tensor)
        per_block = spec.block_bytes
        per_chunk = max(1, self._chunk_bytes // per_block)
        for first in range(0, self.num_blocks, per_chunk):
            end = min(self.num_blocks, first + per_chunk)
            self._queue.put((index, first, view[first * per_block : end * per_block]))
        self._written.add(index)

    def commit(self) -> PutResult:
        """Commit and wait for the store's answer. Raises KVStoreError on failure."""
        missing = [s.name for i, s in enumerate(self.layers) if i not in self._written]
        if missing:
            self.abort()
            raise ValueError(f"commit without layers {missing[:4]}")
        self._queue.put(pb.PutRequest(commit=pb.PutCommit()))
        self._queue.put(_END)
        while True:
            try:
                resp = self._future.result(timeout=max(0.0, self.timeout - self._stalled_for()) + 0.01)
                break
            except grpc.FutureTimeoutError:
                self._check_progress()  # raises once the store is really stuck
            except grpc.FutureCancelledError as exc:
                raise errors.PutAborted("the put was aborted before its commit was answered") from exc
            except grpc.RpcError as exc:
                self._done = True
                raise errors.from_rpc_error(exc) from exc
        self._done = True
        return PutResult(resp.blocks_written, resp.blocks_skipped, resp.bytes_written, resp.blocks_evicted)

    def abort(self) -> None:
        """Cancel the put; the store keeps nothing of it. Safe to call twice."""
        if not self._done:
            self._done = True
            self._future.cancel()
            self._queue.put(_END)

    def __enter__(self) -> PutStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or not self._done:
            self.abort()


class _CallSource:
    """A Get or DropSelect call as a LayerStream's source: header first, then chunks."""

    def __init__(self, call: Any) -> None:
        self._call = call
        try:
            first = next(call)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc
        except StopIteration:
            raise errors.StoreInternalError("empty Get stream") from None
        if not isinstance(first, pb.GetResponse) or first.WhichOneof("msg") != "header":
            raise errors.StoreInternalError("Get stream did not start with a header")
        self.num_blocks: int = first.header.num_blocks
        self.layers = [LayerSpec(s.name, s.dtype, tuple(s.shape)) for s in first.header.layers]

    def chunks(self) -> Iterator[wire.Chunk]:
        """The stream's chunks, checked to arrive in order, layer by layer."""
        try:
            for index, spec in enumerate(self.layers if self.num_blocks else ()):
                block_bytes = spec.block_bytes
                total = block_bytes * self.num_blocks
                filled = 0
                while filled < total:
                    chunk = next(self._call)
                    if (
                        not isinstance(chunk, wire.Chunk)
                        or chunk.layer_index != index
                        or chunk.first_block * block_bytes != filled
                        or filled + len(chunk.data) > total
                        or len(chunk.data) % block_bytes
                    ):
                        raise errors.StoreInternalError(
                            f"out-of-order data in Get stream at layer {spec.name!r}"
                        )
                    filled += len(chunk.data)
                    yield chunk
            # Read the call's end too: the server finishes its side (and counts
            # the read) when the stream closes, not at its last chunk.
            for extra in self._call:
                raise errors.StoreInternalError(
                    f"unexpected message after the last layer: {type(extra).__name__}"
                )
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc
        except StopIteration:
            raise errors.StoreInternalError("Get stream ended early") from None

    def cancel(self) -> None:
        self._call.cancel()


class LayerStream:
    """A Get in progress: `num_blocks`, `layers`, then iterate (name, tensor) per layer.

    Layer i is yielded as soon as its bytes arrived, while later layers are
    still in flight. `allocate(spec, num_blocks)` may supply each destination
    tensor (e.g. pinned memory); by default a new CPU tensor is made. `local`
    tells whether the blocks come straight from the daemon's files (the
    same-host fast path, see kvstore_client.local) instead of over gRPC.
    """

    def __init__(
        self,
        source: Any,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
        *,
        local: bool = False,
    ) -> None:
        self._source = source
        self._allocate = allocate
        self.local = local
        self.num_blocks: int = source.num_blocks
        self.layers: list[LayerSpec] = source.layers

    def chunks(self) -> Iterator[wire.Chunk]:
        """The raw stream: each chunk's layer index, first block and bytes, in order.

        For callers that place blocks themselves (the connector scatters them
        straight into a paged KV cache); the views are valid until the next chunk.
        Layers come in order, each one's blocks in order; a layer is complete
        when a chunk reaches its last block.
        """
        return self._source.chunks()  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.num_blocks == 0:
            self._drain()
            return
        import numpy as np
        import torch

        tensor = dest = None
        spec, block_bytes, total = self.layers[0], 0, 0
        for layer_index, first_block, data in self.chunks():
            if first_block == 0:
                spec = self.layers[layer_index]
                block_bytes = spec.block_bytes
                total = block_bytes * self.num_blocks
                shape = (self.num_blocks, *spec.shape)
                if self._allocate is not None:
                    tensor = self._allocate(spec, self.num_blocks)
                    if tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != spec.dtype:
                        raise ValueError(f"allocate gave {tensor.dtype} {list(tensor.shape)} for {spec}")
                else:
                    tensor = torch.empty(shape, dtype=torch_dtype(spec.dtype))
                dest = writable_view(tensor)
            start = first_block * block_bytes
            dest[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)  # type: ignore[index]
            if start + len(data) == total:
                yield spec.name, tensor  # type: ignore[misc]

    def _drain(self) -> None:
        for _ in self.chunks():
            pass

    def cancel(self) -> None:
        """Stop the transfer; safe from another thread while this one iterates."""
        self._source.cancel()

    def read_all(self) -> dict[str, torch.Tensor]:
        return dict(self)


class KVStoreClient:
    """Client for one kvstore daemon. Use as a context manager or call close()."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        timeout: float = 10.0,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        insert_workers: int = 2,
        channel_options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        tls: bool = False,
        tls_ca: str | Path | bytes | None = None,
        tls_cert: str | Path | bytes | None = None,
        tls_key: str | Path | bytes | None = None,
        local_reads: bool = False,
        local_data_dir: str | Path | None = None,
    ) -> None:
        """`token`: bearer token sent with every call (daemons run with --token-file).
        TLS when `tls` is true or a CA is given: `tls_ca` (PEM path or bytes; default: the
        system roots), `tls_cert` + `tls_key` for a client certificate (mutual TLS).
        `local_reads`: on the daemon's host, get_stream/select read blocks straight from its
        files when the daemon offers it (see kvstore_client.local); `local_data_dir` is where
        this process sees the daemon's data directory, if not at the daemon's own path."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not 0 < chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{wire.MAX_CHUNK_BYTES}")
        self.address = address
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        options = [
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            *wire.CLIENT_KEEPALIVE,
            *channel_options,
        ]
        if tls or tls_ca is not None or tls_cert is not None:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key go together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert)
            )
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        self._channel = grpc.intercept_channel(channel, _Bearer(token)) if token else channel
        self._raw_channel = channel
        unary = self._channel.unary_unary
        self._lookup = unary(
            _SERVICE + "Lookup", pb.LookupRequest.SerializeToString, pb.LookupResponse.FromString
        )
        self._put = self._channel.stream_unary(
            _SERVICE + "Put", wire.encode_put_request, pb.PutResponse.FromString
        )
        self._get = self._channel.unary_stream(
            _SERVICE + "Get", pb.GetRequest.SerializeToString, wire.decode_get_response
        )
        self._drop_select = self._channel.unary_stream(
            _SERVICE + "DropSelect", pb.DropSelectRequest.SerializeToString, wire.decode_get_response
        )
        self._evict = unary(
            _SERVICE + "Evict", pb.EvictRequest.SerializeToString, pb.EvictResponse.FromString
        )
        self._stats = unary(
            _SERVICE + "Stats", pb.StatsRequest.SerializeToString, pb.StatsResponse.FromString
        )
        self._list = unary(_SERVICE + "List", pb.ListRequest.SerializeToString, pb.ListResponse.FromString)
        self._describe = unary(
            _SERVICE + "Describe", pb.DescribeRequest.SerializeToString, pb.DescribeResponse.FromString
        )
        self._watch = self._channel.unary_stream(
            _SERVICE + "Watch", pb.WatchRequest.SerializeToString, pb.Event.FromString
        )
        self._local_access = unary(
            _SERVICE + "LocalAccess",
            pb.LocalAccessRequest.SerializeToString,
            pb.LocalAccessResponse.FromString,
        )
        self._local = (
            LocalReads(
                lambda: self.local_access(timeout=min(self.timeout, 2.0)),
                self._report_corrupt,
                local_data_dir,
            )
            if local_reads
            else None
        )
        # Lookups answered from the files, on their way to the daemon (one thread sends
        # them; best effort: beyond _MAX_TOUCHES waiting, e.g. while the daemon stalls,
        # new ones are dropped, and close() flushes for at most `timeout` seconds)
        self._touches: queue.Queue[tuple[pb.LookupRequest, float] | None] = queue.Queue(_MAX_TOUCHES)
        self._touch_deadline = float("inf")
        self._toucher: threading.Thread | None = None
        if local_reads:
            self._toucher = threading.Thread(target=self._send_touches, name="kvstore-touch", daemon=True)
            self._toucher.start()
        self._inserts = ThreadPoolExecutor(max_workers=insert_workers, thread_name_prefix="kvstore-insert")
        self._closed = threading.Event()

    # ---- lifecycle
    def close(self) -> None:
        """Wait for pending inserts, then close the channel. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._inserts.shutdown(wait=True)
        if self._local is not None:
            self._local.close()
        if self._toucher is not None:  # send what is queued, for `timeout` seconds at most
            self._touch_deadline = time.monotonic() + self.timeout
            self._touches.put(None)
            self._toucher.join()
        self._raw_channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc

    # ---- serving path
    def lookup(
        self,
        namespace: str | bytes | Sequence[str | bytes],
        block_hashes: Sequence[bytes],
        *,
        timeout: float | None = None,
    ) -> int:
        """How many leading blocks of `block_hashes` are stored. One round trip.

        With a list of namespaces: the prefix stored in all of them (e.g. every TP rank).
        With local reads: answered from the daemon's files, no round trip; the same
        Lookup still goes to the daemon in the background (recency, hit counters).
        """
        if isinstance(namespace, (str, bytes)):
            spaces = [_ns(namespace)]
            req = pb.LookupRequest(namespace=spaces[0], block_hashes=block_hashes)
        else:
            spaces = [_ns(ns) for ns in namespace]
            req = pb.LookupRequest(namespaces=spaces, block_hashes=block_hashes)
        if self._local is not None and not self._closed.is_set():
            n = self._local.lookup(spaces, block_hashes)
            if n is not None:
                self._touch(req, timeout or self.timeout)
                return n
        return int(self._unary(self._lookup, req, timeout).num_blocks)

    def _touch(self, req: pb.LookupRequest, timeout: float) -> None:
        try:
            self._touches.put_nowait((req, timeout))
        except queue.Full:
            log.debug("background Lookups are backed up; dropping one")

    def _send_touches(self) -> None:
        while (item := self._touches.get()) is not None:
            req, timeout = item
            left = self._touch_deadline - time.monotonic()
            if left <= 0:
                continue  # closing, out of time: drop the rest
            try:
                self._lookup(req, timeout=min(timeout, left))
            except grpc.RpcError as exc:
                # the answer came from the files; the daemon only missed a recency update
                log.debug("background Lookup failed: %s", exc.code())

    def put_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
    ) -> PutStream:
        """Open a Put for `block_hashes`; write each layer with write_layer, then commit.

        `timeout` (default: the client's, at least 60 s) is how long the store may go
        without taking this put's data or answering its commit; see PutStream."""
        if not layers:
            raise ValueError("a put needs at least one layer")
        header = pb.PutHeader(
            namespace=_ns(namespace),
            block_hashes=block_hashes,
            parent_hash=parent_hash,
            layers=[pb.LayerSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in layers],
        )
        return PutStream(self, header, layers, len(block_hashes), timeout or max(self.timeout, 60.0))

    def put(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Mapping[str, torch.Tensor],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
    ) -> PutResult:
        """Store blocks and wait for the commit."""
        if not layers:
            raise ValueError("a put needs at least one layer")
        specs = [LayerSpec.of(name, t) for name, t in layers.items()]
        with self.put_stream(
            namespace, block_hashes, specs, parent_hash=parent_hash, timeout=timeout
        ) as stream:
            for name, tensor in layers.items():
                stream.write_layer(name, tensor.contiguous())
            return stream.commit()

    def insert(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Mapping[str, torch.Tensor],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
    ) -> Future[PutResult]:
        """LookupBuffer insert: store in the background and return at once.

        The tensors are read by a background thread: do not modify them until
        the returned future is done. Blocks already stored are skipped.
        """
        if self._closed.is_set():
            raise errors.StoreUnavailable("client is closed")
        return self._inserts.submit(
            self.put, namespace, block_hashes, layers, parent_hash=parent_hash, timeout=timeout
        )

    def get_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        *,
        timeout: float | None = None,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
    ) -> LayerStream:
        """Start reading the stored prefix of `block_hashes`, one layer at a time.

        With local reads the stream may end in errors.LocalDataCorrupt (the daemon
        was told and drops the bad block; read again for the good prefix)."""
        if self._local is not None:
            source = self._local.stream_source(_ns(namespace), block_hashes)
            if source is not None:
                return LayerStream(source, allocate, local=True)
        return self._get_call(namespace, block_hashes, timeout, allocate)

    def _get_call(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        timeout: float | None,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
    ) -> LayerStream:
        req = pb.GetRequest(
            namespace=_ns(namespace), block_hashes=block_hashes, max_chunk_bytes=self.chunk_bytes
        )
        return LayerStream(_CallSource(self._get(req, timeout=timeout or max(self.timeout, 60.0))), allocate)

    def _report_corrupt(self, namespace: bytes, block_hash: bytes) -> None:
        # The daemon verifies a block before it answers a Get: reading the header is
        # enough for it to count the failure and remove the block.
        try:
            self._get_call(namespace, [block_hash], self.timeout).cancel()
        except errors.KVStoreError as exc:
            log.warning("could not report a corrupt block to the daemon: %s", exc)

    def select(
        self, namespace: str | bytes, block_hashes: Sequence[bytes], *, timeout: float | None = None
    ) -> dict[str, torch.Tensor]:
        """The stored prefix of `block_hashes` as {layer: [n, ...]}; {} on a miss. Non-destructive."""
        try:
            return self.get_stream(namespace, block_hashes, timeout=timeout).read_all()
        except errors.LocalDataCorrupt:
            return self._get_call(namespace, block_hashes, timeout).read_all()

    def take_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        wait: float,
        *,
        transfer_timeout: float | None = None,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
    ) -> LayerStream:
        """Streaming drop_select: wait up to `wait` s for all blocks, then take them layer by layer."""
        if not wait >= 0:
            raise ValueError("wait must be a non-negative number of seconds")
        req = pb.DropSelectRequest(
            namespace=_ns(namespace),
            block_hashes=block_hashes,
            wait_seconds=wait,
            max_chunk_bytes=self.chunk_bytes,
        )
        call = self._drop_select(req, timeout=wait + (transfer_timeout or max(self.timeout, 60.0)))
        return LayerStream(_CallSource(call), allocate)

    def drop_select(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        timeout: float,
        *,
        transfer_timeout: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """LookupBuffer drop_select: wait up to `timeout` s for all blocks, take them, remove them.

        Raises StoreTimeout if they are not all stored in time (nothing is removed then).
        """
        return self.take_stream(
            namespace, block_hashes, timeout, transfer_timeout=transfer_timeout
        ).read_all()

    # ---- operators
    def evict(
        self,
        *,
        all: bool = False,
        namespace: str | bytes | None = None,
        block_hash: bytes | None = None,
        older_than: float | None = None,
        target_bytes: int | None = None,
        timeout: float | None = None,
    ) -> EvictResult:
        """Evict by exactly one selector: all=True; namespace; namespace + block_hash (with
        descendants); older_than seconds since last use; down to target_bytes."""
        given = [all, namespace is not None and block_hash is None, block_hash is not None,
                 older_than is not None, target_bytes is not None]  # fmt: skip
        if sum(bool(g) for g in given) != 1:
            raise ValueError(
                "evict needs exactly one of: all, namespace, block_hash, older_than, target_bytes"
            )
        if block_hash is not None:
            if namespace is None:
                raise ValueError("block_hash needs its namespace")
            req = pb.EvictRequest(block=pb.BlockRef(namespace=_ns(namespace), block_hash=block_hash))
        elif namespace is not None:
            req = pb.EvictRequest(namespace=_ns(namespace))
        elif older_than is not None:
            req = pb.EvictRequest(older_than_seconds=older_than)
        elif target_bytes is not None:
            req = pb.EvictRequest(target_bytes=target_bytes)
        else:
            req = pb.EvictRequest(all=True)
        resp = self._unary(self._evict, req, timeout)
        return EvictResult(resp.blocks_evicted, resp.bytes_freed)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Store totals and counters (see StatsResponse in the proto)."""
        from google.protobuf.json_format import MessageToDict

        resp = self._unary(self._stats, pb.StatsRequest(), timeout)
        out = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for field in resp.DESCRIPTOR.fields:
            if field.type in (field.TYPE_UINT64, field.TYPE_UINT32):
                out[field.name] = int(out[field.name])
        return out

    def list_blocks(
        self, namespace: str | bytes | None = None, *, limit: int = 1000, page_token: bytes = b"",
        timeout: float | None = None,
    ) -> tuple[list[pb.BlockInfo], bytes]:  # fmt: skip
        """One page of stored blocks and the token for the next page (b"" at the end)."""
        req = pb.ListRequest(
            namespace=_ns(namespace) if namespace else b"", limit=limit, page_token=page_token
        )
        resp = self._unary(self._list, req, timeout)
        return list(resp.blocks), resp.next_page_token

    def iter_blocks(
        self, namespace: str | bytes | None = None, *, page_size: int = 1000
    ) -> Iterator[pb.BlockInfo]:
        token = b""
        while True:
            blocks, token = self.list_blocks(namespace, limit=page_size, page_token=token)
            yield from blocks
            if not token:
                return

    def describe(
        self, namespace: str | bytes, block_hash: bytes, *, timeout: float | None = None
    ) -> pb.DescribeResponse:
        req = pb.DescribeRequest(namespace=_ns(namespace), block_hash=block_hash)
        return self._unary(self._describe, req, timeout)

    def watch(
        self, from_sequence: int = 0, namespace: str | bytes | None = None, *, timeout: float | None = None
    ) -> WatchStream:
        """Subscribe to stored/removed events; returns once subscribed.

        from_sequence 0: events from now on; N: replay from sequence N if the
        daemon still holds it (else EventsOutOfRange: resync with List and
        watch from 0). `timeout` bounds the whole stream; None: no deadline.
        Compare each event's store_id with the last one seen: a new id means
        the daemon restarted and sequences began again at 1.
        """
        if from_sequence < 0:
            raise ValueError("from_sequence must not be negative")
        req = pb.WatchRequest(from_sequence=from_sequence, namespace=_ns(namespace) if namespace else b"")
        return WatchStream(self._watch(req, timeout=timeout))

    def local_access(self, *, timeout: float | None = None) -> pb.LocalAccessResponse:
        """Where a client on the daemon's host may read blocks itself (see kvstore_client.local).
        Raises errors.NotOffered when the daemon does not offer it."""
        return self._unary(self._local_access, pb.LocalAccessRequest(), timeout)

    @property
    def local_data_dir(self) -> Path | None:
        """The daemon data directory this client reads from directly now, or None."""
        return self._local.data_dir if self._local is not None else None

    def health(self, *, timeout: float | None = None) -> str:
        """The standard gRPC health status of the KVStore service: 'SERVING', 'NOT_SERVING', ..."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"),
                              timeout=timeout or self.timeout)  # fmt: skip
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

"""KVStoreClient: the Python client's facade (the calls; the machinery is elsewhere).

    with KVStoreClient("127.0.0.1:50051") as kv:
        kv.insert("ns", hashes, {"layer.0": t0, "layer.1": t1})   # non-blocking -> Future
        n = kv.lookup("ns", hashes)                                # blocks stored as a prefix
        layers = kv.select("ns", hashes)                           # {} on a miss; .stop_reason
        layers = kv.drop_select("ns", hashes, timeout=5.0)         # waits, then consumes
        with kv.watch(from_sequence=0) as events:                  # stored/removed Events
            for event in events: ...                               # until events.cancel()

Tensors: one per layer, dim 0 indexes blocks, every layer with the same
number of blocks; contiguous CPU tensors (copy device tensors to pinned host
memory first). Streaming forms, one layer at a time: `put_stream` (write each
layer when it is ready, then commit) and `get_stream` (iterate layers as they
arrive).

Stored blocks are immutable: a put of a hash that is stored already skips that block
(the first writer wins; its bytes are never compared or replaced: evict it first to
change it). `lookup` counts the stored prefix by hash alone; `select` returns the part
of it that reads back in one layer set, and says why it stopped (Selection.stop_reason).

Thread-safe: one client may be shared by threads. Every call has a deadline
(`timeout`, default from the constructor). Errors are kvstore_client.errors.

Behind it: _rpc (the channel, stubs and gRPC error mapping), streams (Put, Get
and Watch streams), types (result types), local (the same-host fast path).

NOTE: over 500 lines: this is the public API, one class, and most of its length is
the docstrings of its calls; each call checks its arguments, picks a path (arena, the
daemon's files, or gRPC) and shapes the answer, and the machinery is in the modules
above (here only the sender of calls nobody waits for). Split, one class's methods
would lie in several files.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from kvstore import wire
from kvstore.blocks import STOP_NONE, subset_indices
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client._rpc import Channel
from kvstore_client.address import with_default_port
from kvstore_client.arena import Arena, ArenaPutStream, ArenaSource, Pinned, Reservation
from kvstore_client.arena import Mapping as ArenaMapping
from kvstore_client.local import LocalReads
from kvstore_client.streams import CallSource, LayerStream, PutStream, WatchStream
from kvstore_client.types import Chain, EvictResult, LayerSpec, Lease, PutResult, Selection, Where

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_MAX_BACKGROUND = 1024


def _ns(namespace: str | bytes) -> bytes:
    return namespace.encode() if isinstance(namespace, str) else bytes(namespace)


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
        arena: bool = True,
        control_socket: bool = True,
    ) -> None:
        """`address`: HOST:PORT, or HOST alone for the daemon's default port (50051), or a
        gRPC target URI (unix:PATH); ValueError for a port that is not a number.
        `token`: bearer token sent with every call (daemons run with --token-file).
        TLS when `tls` is true or a CA is given: `tls_ca` (PEM path or bytes; default: the
        system roots), `tls_cert` + `tls_key` for a client certificate (mutual TLS).
        `local_reads`: on the daemon's host, get_stream/select read blocks straight from its
        files when the daemon offers it (see kvstore_client.local); `local_data_dir` is where
        this process sees the daemon's data directory, if not at the daemon's own path.
        `arena`: on the daemon's host, put_stream/put/insert and get_stream/select move the
        bytes through the daemon's shared-memory arena when it offers one and this process
        can map it (see kvstore_client.arena); else, and for drop_select, over gRPC.
        `control_socket`: with the arena, the calls the daemon answers on its control
        socket (lookups, reservations, commits, pins) go there instead of over gRPC, for
        a fraction of a gRPC call's cost, when it offers one this process can open."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if not 0 < chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{wire.MAX_CHUNK_BYTES}")
        address = with_default_port(address)
        self.address = address
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._rpc = Channel(
            address,
            channel_options=channel_options,
            token=token,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
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
        # Calls whose answer nobody waits for, on their way to the daemon: Lookups answered
        # from the files (the daemon's recency), Releases of pins that certainly held. One
        # thread sends them; best effort: beyond _MAX_BACKGROUND waiting, e.g. while the
        # daemon stalls, new ones are dropped (a dropped Release: the pin's lease ends it),
        # and close() flushes for at most `timeout` seconds.
        self._background: queue.Queue[tuple[Any, Any, float] | None] = queue.Queue(_MAX_BACKGROUND)
        self._flush_deadline = float("inf")
        self._sender: threading.Thread | None = None
        self._sender_lock = threading.Lock()
        self._inserts = ThreadPoolExecutor(max_workers=insert_workers, thread_name_prefix="kvstore-insert")
        self._closed = threading.Event()
        self._arena = Arena(self._arena_call, LayerSpec) if arena else None
        # arena_access asked (it offers the control socket); never, without the socket
        self._control_asked = not control_socket
        self._control_socket = control_socket

    def _arena_call(
        self, method: str, request: Any, timeout: float | None = None, *, background: bool = False
    ) -> Any:
        if method == "ArenaAccess":
            return self.arena_access(timeout=min(self.timeout, 2.0))
        if method == "PinStream":
            return self._rpc.pin_stream(request, timeout or self.timeout)
        if background:
            self._send_later(self._rpc.arena[method], request, timeout or self.timeout)
            return None
        return self._rpc.unary(self._rpc.arena[method], request, timeout or self.timeout)

    # ---- lifecycle
    def close(self) -> None:
        """Wait for pending inserts, then close the channel. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._inserts.shutdown(wait=True)
        if self._local is not None:
            self._local.close()
        if self._arena is not None:
            self._arena.close()
        with self._sender_lock:
            sender, self._sender = self._sender, None
        if sender is not None:  # send what is queued, for `timeout` seconds at most
            self._flush_deadline = time.monotonic() + self.timeout
            self._background.put(None)
            sender.join()
        self._rpc.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        return self._rpc.unary(method, request, timeout or self.timeout)

    # ---- serving path
    def lookup(
        self,
        namespace: str | bytes | Sequence[str | bytes],
        block_hashes: Sequence[bytes],
        *,
        timeout: float | None = None,
        probe: bool = False,
    ) -> int:
        """How many leading blocks of `block_hashes` are stored. One round trip.

        Counted by hash from the store's index: a block stored with another layer set
        than the blocks before it (another put's layers), or one that fails its checksum
        when read, is counted here, and `select` then stops before it (its
        Selection.stop_reason says why). So select may return fewer blocks than this.
        With a list of namespaces: the prefix stored in all of them (e.g. every TP rank).
        With local reads: answered from the daemon's files, no round trip; the same
        Lookup still goes to the daemon in the background (recency, hit counters).
        `probe`: a router asking ahead of a request (the daemon counts it apart and
        changes no recency); always a round trip.
        """
        if isinstance(namespace, (str, bytes)):
            spaces = [_ns(namespace)]
            req = pb.LookupRequest(namespace=spaces[0], block_hashes=block_hashes, probe=probe)
        else:
            spaces = [_ns(ns) for ns in namespace]
            req = pb.LookupRequest(namespaces=spaces, block_hashes=block_hashes, probe=probe)
        if self._local is not None and not self._closed.is_set() and not probe:
            n = self._local.lookup(spaces, block_hashes)
            if n is not None:
                self._send_later(self._rpc.lookup, req, timeout or self.timeout)
                return n
        self._ask_for_control()
        return int(self._unary(self._rpc.lookup, req, timeout).num_blocks)

    def where(
        self,
        namespace: str | bytes | Sequence[str | bytes],
        block_hashes: Sequence[bytes],
        *,
        timeout: float | None = None,
        lease_from: int | None = None,
        lease_holders: int = 1,
        prefetch: bool = False,
    ) -> Where:
        """lookup, and where the prefix lives: the tier each of its blocks is read from and
        how fast the tiers below memory read (what a loader weighs against recomputing).
        One round trip, always (the daemon alone knows what is in its memory tier).

        `lease_from`: also lease the prefix's blocks from there on that the memory tier
        holds (Where.lease: the pins a load would otherwise ask for, made in the same
        round trip), until `lease_holders` releases (each loader of it releases its share)
        or the daemon's lease runs out. A daemon that offers no arena, or predates leases,
        leases nothing (Where.lease is None).

        `prefetch`: also start reading the prefix's blocks from `lease_from` (or the first)
        on that only the persistent tier holds into the memory tier, without waiting
        (Where.prefetching: how many): a Pin of them a step later finds them in memory or
        joins their reads. Best effort (none while the daemon runs several prefetches)."""
        if lease_from is not None and lease_from < 0:
            raise ValueError("lease_from must be >= 0")
        if not 1 <= lease_holders <= wire.MAX_LEASE_HOLDERS:
            raise ValueError(f"lease_holders must be in 1..{wire.MAX_LEASE_HOLDERS}")
        leasing = lease_from is not None and lease_from < len(block_hashes)
        req = pb.LookupRequest(
            block_hashes=block_hashes, tiers=True, lease=leasing,
            lease_from=lease_from or 0, lease_holders=lease_holders if leasing else 0, want_layout=leasing,
            prefetch=prefetch,
        )  # fmt: skip
        spaces = [_ns(namespace)] if isinstance(namespace, (str, bytes)) else [_ns(ns) for ns in namespace]
        if len(spaces) == 1:
            req.namespace = spaces[0]
        else:
            req.namespaces.extend(spaces)
        self._ask_for_control()
        taken = time.monotonic()
        resp = self._unary(self._rpc.lookup, req, timeout)
        tiers = (
            resp.tiers
            if len(resp.tiers) == resp.num_blocks
            else bytes([wire.TIER_PERSISTENT]) * resp.num_blocks
        )
        lease = None
        if resp.leases:
            if len(resp.leases) != len(spaces):
                raise errors.StoreInternalError(
                    f"Lookup answered {len(resp.leases)} leases for {len(spaces)} namespaces"
                )
            lease = Lease(tuple(spaces), tuple(resp.leases), resp.store_id, taken)
        rates = resp.persistent_read_rate, resp.fleet_read_rate
        return Where(resp.num_blocks, tiers, *rates, lease, resp.prefetch_blocks)

    def release_lease(
        self, lease: Lease, *, namespace: str | bytes | None = None, all_holders: bool = True
    ) -> None:
        """Give a lease back (Where.lease) without waiting for the daemon's answer: every
        namespace's pin, or `namespace`'s; for every holder (a lease its asker will not hand
        on), or one holder's share. Best effort: a Release that does not arrive is ended by
        the lease's expiry."""
        pins = lease.pins if namespace is None else [lease.pin(_ns(namespace))]
        for pin_id in (pin.pin_id for pin in pins if pin is not None and pin.pin_id):
            request = pb.ReleaseRequest(pin_id=pin_id, all_holders=all_holders)
            self._send_later(self._rpc.arena["Release"], request, self.timeout)

    def _send_later(self, method: Any, request: Any, timeout: float) -> None:
        """Queue a unary call for the background sender (started on first use)."""
        with self._sender_lock:
            if self._sender is None and not self._closed.is_set():
                self._sender = threading.Thread(
                    target=self._send_queued, name="kvstore-background", daemon=True
                )
                self._sender.start()
        try:
            self._background.put_nowait((method, request, timeout))
        except queue.Full:
            log.debug("background calls are backed up; dropping a %s", request.DESCRIPTOR.name)

    def _send_queued(self) -> None:
        while (item := self._background.get()) is not None:
            method, request, timeout = item
            left = self._flush_deadline - time.monotonic()
            if left <= 0:
                continue  # closing, out of time: drop the rest
            try:
                self._rpc.unary(method, request, min(timeout, left))
            except errors.KVStoreError as exc:
                # a Lookup's answer came from the files: the daemon only missed a recency
                # update; a Release's pin ends with its lease
                log.debug("background %s failed: %s", request.DESCRIPTOR.name, exc.code)

    @overload
    def put_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
        arena: Literal[False],
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> PutStream: ...

    @overload
    def put_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
        arena: bool = True,
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> PutStream | ArenaPutStream: ...

    def put_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
        arena: bool = True,
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> PutStream | ArenaPutStream:
        """Open a Put for `block_hashes`; write each layer with write_layer, then commit.

        `timeout` (default: the client's, at least 60 s) is how long the store may go
        without taking this put's data or answering its commit; see PutStream. Through the
        daemon's arena when the client uses one (ArenaPutStream, same calls), unless `arena`
        is false. `token_ids`: the blocks' tokens, block after block, for the daemon's KV
        events (optional; not stored). `subset`: a partial put of these of `layers` (the
        block's whole layout), written by name; the blocks become visible once puts have
        covered all their layers (each tensor-parallel rank puts its own KV heads)."""
        if not layers:
            raise ValueError("a put needs at least one layer")
        carried = [layers[k] for k in subset_indices(subset, len(layers))]
        stream_timeout = timeout or max(self.timeout, 60.0)
        if self._arena is not None and arena:
            try:
                res = self._arena.reserve(
                    _ns(namespace), block_hashes, layers, parent_hash, timeout, token_ids, subset
                )
            except errors.CapacityExceeded as exc:  # the arena is full of pins: the backend may fit
                log.debug("no room in the arena, putting over gRPC: %s", exc)
                res = None
            if res is not None:
                return ArenaPutStream(res, len(block_hashes), stream_timeout)
        header = pb.PutHeader(
            namespace=_ns(namespace),
            block_hashes=block_hashes,
            parent_hash=parent_hash,
            layers=[pb.LayerSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in layers],
            token_ids=token_ids,
            layer_subset=subset,
        )
        return PutStream(self._rpc.put, header, carried, len(block_hashes), stream_timeout, self.chunk_bytes)

    def put(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Mapping[str, torch.Tensor],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
        token_ids: Sequence[int] = (),
    ) -> PutResult:
        """Store blocks and wait for the commit (`token_ids`: as for put_stream).

        Blocks whose hash is stored already are skipped, whatever their bytes: the first
        writer wins, and nothing compares the new bytes with the stored ones (a hash names
        its tokens, so equal hashes should mean equal KV). PutResult.blocks_skipped counts
        them. To replace a block, evict it (and its descendants) first."""
        if not layers:
            raise ValueError("a put needs at least one layer")
        specs = [LayerSpec.of(name, t) for name, t in layers.items()]
        with self.put_stream(
            namespace, block_hashes, specs, parent_hash=parent_hash, timeout=timeout, token_ids=token_ids
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
        the returned future is done. Blocks already stored are skipped, their new bytes
        dropped unread (first writer wins, as for put; the result's blocks_skipped).
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
        subset: Sequence[int] = (),
    ) -> LayerStream:
        """Start reading the stored prefix of `block_hashes`, one layer at a time.
        `subset`: a layer subset, only these of the stored layers (their bytes only are read
        and verified); empty: all.

        Through the arena or with local reads the stream may end in errors.LocalDataCorrupt
        (the daemon was told and drops the bad block; read again for the good prefix)."""
        if self._arena is not None:
            pinned = self._arena.pin(_ns(namespace), block_hashes, timeout)
            if pinned is not None:
                try:
                    source = ArenaSource(pinned, block_hashes, subset)
                except ValueError:
                    pinned.release()
                    raise
                return LayerStream(source, allocate, via="arena")
        if self._local is not None:
            local = self._local.stream_source(_ns(namespace), block_hashes, subset)
            if local is not None:
                return LayerStream(local, allocate, via="files")
        return self._get_call(namespace, block_hashes, timeout, allocate, subset)

    def _get_call(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        timeout: float | None,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
        subset: Sequence[int] = (),
    ) -> LayerStream:
        req = pb.GetRequest(
            namespace=_ns(namespace),
            block_hashes=block_hashes,
            max_chunk_bytes=self.chunk_bytes,
            layers=subset,
        )
        return LayerStream(CallSource(self._rpc.get(req, timeout or max(self.timeout, 60.0))), allocate)

    def _report_corrupt(self, namespace: bytes, block_hash: bytes) -> None:
        # The daemon verifies a block before it answers a Get: reading the header is
        # enough for it to count the failure and remove the block.
        try:
            self._get_call(namespace, [block_hash], self.timeout).cancel()
        except errors.KVStoreError as exc:
            log.warning("could not report a corrupt block to the daemon: %s", exc)

    def select(
        self, namespace: str | bytes, block_hashes: Sequence[bytes], *, timeout: float | None = None
    ) -> Selection:
        """The stored prefix of `block_hashes` as {layer: [n, ...]}; {} on a miss. Non-destructive.

        A Selection: a dict, with `num_blocks` and `stop_reason`, why it holds no more of
        the blocks asked for ("none" when it holds them all; "not_stored",
        "layer_set_differs", "checksum_failed", "evicted", ...: see Selection). It holds
        blocks of one layer set only: where blocks of one prefix were put with different
        layers, it stops at the first that differs, where `lookup` counts on."""
        try:
            stream = self.get_stream(namespace, block_hashes, timeout=timeout)
            layers = stream.read_all()
        except errors.LocalDataCorrupt:
            stream = self._get_call(namespace, block_hashes, timeout)
            layers = stream.read_all()
        reason = STOP_NONE if stream.num_blocks == len(block_hashes) else stream.stop_reason
        return Selection(layers, stream.num_blocks, reason)

    def take_stream(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        wait: float,
        *,
        transfer_timeout: float | None = None,
        allocate: Callable[[LayerSpec, int], torch.Tensor] | None = None,
        subset: Sequence[int] = (),
    ) -> LayerStream:
        """Streaming drop_select: wait up to `wait` s for all blocks, then take them layer by
        layer. `subset`: take only this layer subset; a block is removed once takes covered
        all its layers."""
        if not wait >= 0:
            raise ValueError("wait must be a non-negative number of seconds")
        req = pb.DropSelectRequest(
            namespace=_ns(namespace),
            block_hashes=block_hashes,
            wait_seconds=wait,
            max_chunk_bytes=self.chunk_bytes,
            layers=subset,
        )
        call = self._rpc.drop_select(req, wait + (transfer_timeout or max(self.timeout, 60.0)))
        return LayerStream(CallSource(call), allocate)

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
        fleet: bool = False,
        timeout: float | None = None,
    ) -> EvictResult:
        """Evict by exactly one selector: all=True; namespace; namespace + block_hash (with
        descendants); older_than seconds since last use; down to target_bytes. `fleet`
        (with all or namespace): remove them from the daemon's fleet tier too, every
        host's copies."""
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
        req.fleet = fleet
        resp = self._unary(self._rpc.evict, req, timeout)
        return EvictResult(resp.blocks_evicted, resp.bytes_freed, resp.fleet_objects_removed)

    def stats(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Store totals and counters (see StatsResponse in the proto)."""
        from google.protobuf.json_format import MessageToDict

        resp = self._unary(self._rpc.stats, pb.StatsRequest(), timeout)
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
        resp = self._unary(self._rpc.list, req, timeout)
        return list(resp.blocks), resp.next_page_token

    def namespaces(self, *, timeout: float | None = None) -> list[bytes]:
        """The namespaces that hold blocks (this tenant's), sorted. One round trip; from a
        daemon that predates the question, one List call per 1000 blocks."""
        resp = self._unary(self._rpc.list, pb.ListRequest(namespaces_only=True), timeout)
        if not resp.blocks:
            return list(resp.namespaces)
        seen = dict.fromkeys(b.namespace for b in resp.blocks)  # an older daemon listed blocks
        token = resp.next_page_token
        while token:
            blocks, token = self.list_blocks(page_token=token, timeout=timeout)
            seen.update(dict.fromkeys(b.namespace for b in blocks))
        return sorted(seen)

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
        return self._unary(self._rpc.describe, req, timeout)

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
        return WatchStream(self._rpc.watch(req, timeout))

    def local_access(self, *, timeout: float | None = None) -> pb.LocalAccessResponse:
        """Where a client on the daemon's host may read blocks itself (see kvstore_client.local).
        Raises errors.NotOffered when the daemon does not offer it."""
        return self._unary(self._rpc.local_access, pb.LocalAccessRequest(), timeout)

    # ---- the memory tier (same-host data plane)
    def arena_available(self) -> bool:
        """Whether saves and loads go through the daemon's arena now (mapping it if not yet)."""
        return self.arena_mapping() is not None

    def arena_mapping(self) -> ArenaMapping | None:
        """The daemon's arena as this process maps it (mapping it if not yet), or None while
        this client uses gRPC. Its pages are the caller's to pre-fault or register with CUDA
        (see kvstore_client.arena.Mapping.on_close)."""
        return self._arena.mapping() if self._arena is not None else None

    @property
    def arena_path(self) -> Path | None:
        """The daemon's arena file this client maps, or None while it uses gRPC."""
        mapping = self.arena_mapping()
        return mapping.path if mapping is not None else None

    def arena_access(self, *, timeout: float | None = None) -> pb.ArenaAccessResponse:
        """Where the daemon's arena is (see kvstore_client.arena). Raises errors.NotOffered
        when the daemon has none or does not offer it to clients. With the arena on, this
        client's later calls go over the daemon's control socket where it offers one."""
        resp = self._rpc.unary(
            self._rpc.arena["ArenaAccess"], pb.ArenaAccessRequest(), timeout or self.timeout
        )
        self._control_asked = True
        if self._arena is not None and self._control_socket:
            self._rpc.use_control(resp.control_socket, resp.store_id)
        return resp

    def _ask_for_control(self) -> None:
        """Once, before this client's first Lookup: whether the daemon offers its control
        socket here (ArenaAccess; a daemon that does not offer its arena offers none)."""
        if self._control_asked or self._arena is None:
            return
        self._control_asked = True
        try:
            self.arena_access()
        except errors.KVStoreError as exc:
            log.debug("no control socket: %s", exc)

    def reserve(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        parent_hash: bytes = b"",
        timeout: float | None = None,
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> Reservation | None:
        """Reserve arena space for the blocks of `block_hashes` the store lacks; write them
        (`reservation.layer(i)`), then `commit()`. None: no arena here (use put_stream).
        `token_ids`, `subset`: as for put_stream (the reservation holds the subset's layers)."""
        if self._arena is None:
            return None
        subset_indices(subset, len(layers))
        return self._arena.reserve(
            _ns(namespace), block_hashes, layers, parent_hash, timeout, token_ids, subset
        )

    def reserve_many(
        self,
        namespace: str | bytes,
        chains: Sequence[Chain],
        layers: Sequence[LayerSpec],
        *,
        timeout: float | None = None,
        subset: Sequence[int] = (),
    ) -> list[Reservation | errors.KVStoreError] | None:
        """reserve() for several saves of one layout in one round trip (a step's saves):
        one answer per chain, in order, each a Reservation or the KVStoreError a reserve
        of that chain alone would have raised (the others are not affected). None: no
        arena here (use put_stream)."""
        if self._arena is None:
            return None
        subset_indices(subset, len(layers))
        return self._arena.reserve_many(_ns(namespace), chains, layers, timeout, subset)

    def commit_many(
        self,
        items: Sequence[tuple[Reservation, Sequence[int] | bytes | None, str]],
        *,
        timeout: float | None = None,
    ) -> list[PutResult | errors.KVStoreError]:
        """Commit several reservations of this client in one round trip: each item is
        (reservation, its checksums or None to compute them, their kind) as for
        Reservation.commit; one answer per item, in order, each a PutResult or the
        KVStoreError that commit alone would have raised."""
        if self._arena is None:
            raise errors.NotOffered("no arena: nothing was reserved")
        return self._arena.commit_many(items, timeout)

    def pin_many(
        self, namespace: str | bytes, chains: Sequence[Sequence[bytes]], *, timeout: float | None = None
    ) -> list[Pinned | errors.KVStoreError] | None:
        """pin() of several chains of one namespace in one round trip (a step's loads): one
        answer per chain, in order, each a Pinned (its blocks in place) or the KVStoreError
        a pin of that chain alone would have raised. None: no arena here (use get_stream)."""
        if self._arena is None:
            return None
        return self._arena.pin_many(_ns(namespace), chains, timeout)

    def pin(
        self,
        namespace: str | bytes,
        block_hashes: Sequence[bytes],
        *,
        timeout: float | None = None,
        stream: bool = False,
    ) -> Pinned | None:
        """Pin the stored prefix of `block_hashes` in the arena for its lease (read it with
        `pieces(layer)`, `verify()`, then `release()`). None: no arena here (use get_stream).
        `stream`: answer before the blocks only the persistent tier held are read into the
        arena; `Pinned.wait_layers(k)` then waits for the first k layers (PinStream)."""
        if self._arena is None:
            return None
        return self._arena.pin(_ns(namespace), block_hashes, timeout, stream=stream)

    def leased(self, lease: Lease, namespace: str | bytes) -> Pinned | None:
        """The pin of `namespace` of a lookup's lease (possibly taken by another process of
        this host: the scheduler side of an engine), to load like pin()'s answer; its
        release() gives back this holder's share. None: not usable here (no arena, another
        daemon run, nothing leased in that namespace): give the share back with
        release_lease(lease, namespace=namespace, all_holders=False) and pin() instead."""
        pin = lease.pin(_ns(namespace))
        if self._arena is None or pin is None:
            return None
        return self._arena.leased(pin, lease.store_id, lease.taken)

    @property
    def local_data_dir(self) -> Path | None:
        """The daemon data directory this client reads from directly now, or None."""
        return self._local.data_dir if self._local is not None else None

    def health(self, *, timeout: float | None = None) -> str:
        """The standard gRPC health status of the KVStore service: 'SERVING', 'NOT_SERVING', ..."""
        return self._rpc.health(timeout or self.timeout)

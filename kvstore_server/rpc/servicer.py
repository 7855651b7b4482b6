"""The gRPC servicer: kvstore.v1.KVStore on a Store, and its method-handler table.

Each method validates its request (kvstore_server.rpc.validation), calls the store and
answers; errors become status codes through `translated` (kvstore_server.rpc.status,
which holds the table of codes).

NOTE: over 500 lines: one class implements the one proto service, and
`generic_handler` binds it method by method; every RPC, the memory tier's included,
uses the same tenant scope, idle reclaim and limits. Validation and the status table
are already apart; what is left is one short method per RPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from kvstore import wire
from kvstore.blocks import PackedSums, per_layout
from kvstore.host import pid_namespace
from kvstore.service import SERVICE_NAME, WATCH_START_SEQUENCE_KEY, WATCH_STORE_ID_KEY
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_server import __version__, eviction
from kvstore_server.config import ServerConfig
from kvstore_server.daemon import RunParts
from kvstore_server.errors import (
    CapacityError,
    InvalidRequest,
    LocalReadsOff,
    NoFleet,
    NoMemoryTier,
    ShuttingDown,
)
from kvstore_server.events import STORED, Event
from kvstore_server.putbuffer import PutBuffer
from kvstore_server.rpc.auth import Scope
from kvstore_server.rpc.control import ControlSocket
from kvstore_server.rpc.status import REFUSALS, _decoded, _decoder, status_of, translated
from kvstore_server.rpc.validation import (
    _chunk_size,
    check_block_tokens,
    check_hash,
    check_hashes,
    check_layer_subset,
    check_layers,
    check_layout,
    check_namespace,
    check_record_size,
)
from kvstore_server.store import PinResult, ReadResult, Store
from kvstore_server.tiers import LayerSpec
from kvstore_server.tiers.arena import MemoryTier
from kvstore_server.tiers.chain import Ready

log = logging.getLogger(__name__)

DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 10000
# How often a waiting watcher rechecks its call (cancellation also wakes it at once).
WATCH_POLL_SECONDS = 1.0


class Servicer:
    """Implements kvstore.v1.KVStore on a Store. One instance per server.

    It makes none of the run's parts: the store id, the event log, the KV events publisher,
    the Put budget and the idle reclaim come from kvstore_server.daemon.RunParts, which
    the caller closes."""

    def __init__(
        self, store: Store, config: ServerConfig, parts: RunParts, scope: Scope | None = None
    ) -> None:
        self.store = store
        self.config = config
        self.scope = scope or Scope(None)
        self.store_id = parts.store_id
        self.events = parts.events
        self.kv_events = parts.kv_events
        self.reclaim = parts.reclaim
        self._puts = parts.puts
        self._waiters = threading.BoundedSemaphore(config.max_waiting_drop_selects)
        self._watchers = threading.BoundedSemaphore(config.max_watchers)
        self.control: ControlSocket | None = None  # offered in ArenaAccess once create_server opened it

    @property
    def inflight_put_bytes(self) -> int:
        """Bytes of Put data buffered right now, across clients."""
        return self._puts.used

    def _tokens(self, token_ids: Any, blocks: int) -> list[int]:
        """A put's token ids, checked; kept only when KV events publish them (nothing else
        reads them: a store without the events holds none of them)."""
        tokens = check_block_tokens(token_ids, blocks)
        return tokens if self.kv_events is not None else []

    def _ns(self, context: grpc.ServicerContext, namespace: bytes) -> bytes:
        """The stored namespace for a caller's: the caller's tenant + the validated name."""
        return self.scope.tenant(context) + check_namespace(namespace)

    # ---- serving path
    @translated
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        hashes = check_hashes(request.block_hashes, wire.MAX_BLOCKS_PER_LOOKUP, allow_empty=True)
        if request.namespaces:
            if request.namespace:
                raise InvalidRequest("give namespace or namespaces, not both")
            if len(request.namespaces) > wire.MAX_LOOKUP_NAMESPACES:
                raise InvalidRequest(f"at most {wire.MAX_LOOKUP_NAMESPACES} namespaces per lookup")
            spaces = [self._ns(context, ns) for ns in request.namespaces]
        else:
            spaces = [self._ns(context, request.namespace)]
        if request.prefetch and request.probe:
            raise InvalidRequest("a probe lookup prefetches nothing")
        if request.lease:
            if request.probe:
                raise InvalidRequest("a probe lookup takes no lease")
            if request.lease_from > len(hashes):
                raise InvalidRequest(
                    f"lease_from {request.lease_from} is past the {len(hashes)} block_hashes"
                )
            if request.lease_holders > wire.MAX_LEASE_HOLDERS:
                raise InvalidRequest(f"at most {wire.MAX_LEASE_HOLDERS} lease_holders")
        n = min(self.store.lookup(ns, hashes, probe=request.probe) for ns in spaces)
        resp = pb.LookupResponse(num_blocks=n)
        if request.tiers:
            where = [self.store.tiers_of(ns, hashes, n) for ns in spaces]
            rates = self.store.tiers.rates()
            resp.tiers = (
                bytes(max(codes) for codes in zip(*where, strict=True)) if len(where) > 1 else where[0]
            )
            resp.persistent_read_rate = float(rates["persistent_read_rate"])
            resp.fleet_read_rate = float(rates["fleet_read_rate"])
        if (
            request.lease
            and request.lease_from < n
            and self.store.memory is not None
            and self.config.offers_memory()
        ):
            tenant, leased = self.scope.tenant(context), hashes[request.lease_from : n]
            with self.reclaim.busy():
                leases = [
                    _pin_message(
                        self.store.lease(tenant, ns, leased, max(1, request.lease_holders)),
                        request.want_layout,
                    )
                    for ns in spaces
                ]
            if sum(lease.ByteSize() for lease in leases) > wire.MAX_LEASE_ANSWER_BYTES:
                for lease in leases:  # too large to answer: the loads pin their own
                    if lease.pin_id:
                        self.store.release(tenant, lease.pin_id, all_holders=True)
            else:
                resp.leases.extend(leases)
                resp.store_id = self.store_id
        if (
            request.prefetch
            and request.lease_from < n
            and self.store.memory is not None
            and self.config.offers_memory()
        ):
            with self.reclaim.busy():
                resp.prefetch_blocks = sum(
                    self.store.prefetch(ns, hashes[request.lease_from : n]) for ns in spaces
                )
        return resp

    @translated
    def Put(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PutResponse:
        with self.reclaim.busy():
            return self._put(requests, context)

    def _put(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PutResponse:
        first = _decoded(next(requests, None))
        if not isinstance(first, pb.PutRequest) or first.WhichOneof("msg") != "header":
            raise InvalidRequest("a Put stream must start with a header")
        header = first.header
        namespace = self._ns(context, header.namespace)
        hashes = check_hashes(header.block_hashes, wire.MAX_BLOCKS_PER_PUT)
        parent = check_hash(header.parent_hash, "parent_hash") if header.parent_hash else b""
        if parent and parent in hashes:
            raise InvalidRequest("parent_hash is one of the put's own block hashes; a chain has no cycles")
        layers = check_layers(header.layers)
        subset = check_layer_subset(header.layer_subset, len(layers))
        carried = layers if subset is None else tuple(layers[k] for k in subset)
        tokens = self._tokens(header.token_ids, len(hashes))
        check_record_size(namespace, hashes[0], layers)
        total = sum(layer.nbytes for layer in carried) * len(hashes)
        if total > self.config.max_put_bytes:
            raise CapacityError(f"put of {total} bytes exceeds max_put_bytes ({self.config.max_put_bytes})")
        buffer = self._puts.acquire(carried, len(hashes))
        if buffer is None:
            raise CapacityError("too many bytes of puts in flight; retry later")
        try:
            if not self._receive(requests, buffer, context):
                context.abort(
                    grpc.StatusCode.ABORTED, "put stream ended before its commit; nothing was stored"
                )
                raise RuntimeError("context.abort returned")
            result = self.store.put(
                namespace,
                parent,
                hashes,
                layers,
                [[buffer.layer(k, i) for i in range(len(hashes))] for k in range(len(carried))],
                buffer.checksums,
                joined=[buffer.block(i) for i in range(len(hashes))] if subset is None else None,
                token_ids=tokens,
                subset=subset,
            )
        finally:
            self._puts.release(buffer)
        return pb.PutResponse(
            blocks_written=result.blocks_written,
            blocks_skipped=result.blocks_skipped,
            bytes_written=result.bytes_written,
            blocks_evicted=result.blocks_evicted,
        )

    def _receive(self, requests: Iterator[Any], buffer: PutBuffer, context: grpc.ServicerContext) -> bool:
        """Copy chunks into `buffer` until the commit; False if the stream ends first."""
        try:
            for msg in requests:
                if isinstance(msg, wire.Chunk):
                    buffer.accept(msg)
                    continue
                if isinstance(msg, wire.Malformed):
                    raise InvalidRequest(msg.reason)
                kind = msg.WhichOneof("msg")
                if kind == "chunk":  # a chunk the fast decoder left to protobuf
                    chunk = msg.chunk
                    buffer.accept(wire.Chunk(chunk.layer_index, chunk.first_block, memoryview(chunk.data)))
                elif kind == "commit":
                    missing = buffer.missing_layers()
                    if missing:
                        raise InvalidRequest(
                            f"commit before all data arrived: layers {missing[:4]} are incomplete"
                        )
                    return True
                else:
                    raise InvalidRequest(f"unexpected {kind or 'empty'} message inside a Put stream")
        except grpc.RpcError:
            # The client went away mid-stream: drop what arrived, store nothing.
            log.info("put stream broken by the client; nothing stored")
            context.abort(grpc.StatusCode.CANCELLED, "client cancelled the put")
        return False

    @translated
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse | bytes]:
        namespace = self._ns(context, request.namespace)
        hashes = check_hashes(request.block_hashes, wire.MAX_BLOCKS_PER_LOOKUP)
        with self.reclaim.busy(), self.store.read(namespace, hashes, request.layers) as result:
            yield from _stream(result, _chunk_size(request.max_chunk_bytes))

    @translated
    def DropSelect(
        self, request: pb.DropSelectRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetResponse | bytes]:
        namespace = self._ns(context, request.namespace)
        hashes = check_hashes(request.block_hashes, wire.MAX_BLOCKS_PER_LOOKUP)
        if not request.wait_seconds >= 0:  # also refuses NaN
            raise InvalidRequest("wait_seconds must be a non-negative number")
        wait = request.wait_seconds
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining)
        if not self._waiters.acquire(blocking=False):
            raise CapacityError(f"more than {self.config.max_waiting_drop_selects} DropSelect calls waiting")
        try:
            with (
                self.store.take(namespace, hashes, wait, context.is_active, request.layers) as result,
                self.reclaim.busy(),
            ):
                yield from _stream(result, _chunk_size(request.max_chunk_bytes))
        finally:
            self._waiters.release()

    # ---- operators
    @translated
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        which = request.WhichOneof("selector")
        tenant = self.scope.tenant(context)
        if request.fleet and which not in ("all", "namespace"):
            raise InvalidRequest("fleet eviction takes a namespace or all")
        if request.fleet and self.store.fleet is None:
            raise NoFleet("this daemon runs without a fleet tier (--fleet)")
        if which == "all":
            if not request.all:
                raise InvalidRequest("all must be true to evict everything")
            count, freed = self.store.evict(lambda index: eviction.namespace(index, None, tenant))
        elif which == "namespace":
            ns = self._ns(context, request.namespace)
            count, freed = self.store.evict(lambda index: eviction.namespace(index, ns))
        elif which == "block":
            ns = self._ns(context, request.block.namespace)
            block_hash = check_hash(request.block.block_hash)
            count, freed = self.store.evict(lambda index: eviction.subtree(index, ns, block_hash))
        elif which == "older_than_seconds":
            if not request.older_than_seconds >= 0:
                raise InvalidRequest("older_than_seconds must be a non-negative number")
            cutoff = time.time() - request.older_than_seconds
            count, freed = self.store.evict(lambda index: eviction.older_than(index, cutoff, tenant))
        elif which == "target_bytes":
            if tenant:
                # the byte budget is shared by every tenant: one may not squeeze the others out
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, "target_bytes eviction is not available with tenants"
                )
            target = request.target_bytes
            count, freed = self.store.evict(lambda index: eviction.down_to(index, target))
        else:
            raise InvalidRequest(
                "Evict needs a selector: all, namespace, block, older_than_seconds or target_bytes"
            )
        removed = 0
        if request.fleet:  # every namespace of this tenant (all), or the one asked
            whole = which == "namespace"
            removed = self.store.evict_fleet(
                self._ns(context, request.namespace) if whole else tenant, whole=whole
            )
        return pb.EvictResponse(blocks_evicted=count, bytes_freed=freed, fleet_objects_removed=removed)

    @translated
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(version=__version__, **self.store.stats())  # type: ignore[arg-type]

    @translated
    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        tenant = self.scope.tenant(context)
        if request.namespaces_only:
            return pb.ListResponse(namespaces=[ns[len(tenant) :] for ns in self.store.namespaces(tenant)])
        namespace = self._ns(context, request.namespace) if request.namespace else None
        if request.limit > MAX_LIST_LIMIT:
            raise InvalidRequest(f"limit {request.limit} is above {MAX_LIST_LIMIT}")
        limit = request.limit or DEFAULT_LIST_LIMIT
        after = _decode_page_token(request.page_token) if request.page_token else None
        if after is not None:
            after = (tenant + after[0], after[1])
        infos, last = self.store.list_blocks(namespace, limit, after, tenant)
        token = b""
        if last is not None:
            name = last[0][len(tenant) :]
            token = len(name).to_bytes(2, "big") + name + last[1]
        return pb.ListResponse(blocks=[_block_info(i, tenant) for i in infos], next_page_token=token)

    @translated
    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        namespace = self._ns(context, request.namespace)
        block_hash = check_hash(request.block_hash)
        info, meta = self.store.describe(namespace, block_hash)
        return pb.DescribeResponse(
            block=_block_info(info, self.scope.tenant(context)),
            layers=[
                pb.LayerInfo(
                    spec=pb.LayerSpec(name=layer.name, dtype=layer.dtype, shape=layer.shape),
                    nbytes=layer.nbytes,
                    checksum=crc,
                )
                for layer, crc in zip(meta.layers, meta.checksums, strict=True)
            ],
        )

    @translated
    def LocalAccess(
        self, request: pb.LocalAccessRequest, context: grpc.ServicerContext
    ) -> pb.LocalAccessResponse:
        if not self.config.offers_local_reads():
            reason = "local_reads = false" if self.config.local_reads is False else "tenants are configured"
            raise LocalReadsOff(f"this daemon does not offer local reads ({reason}); use Get")
        return pb.LocalAccessResponse(
            backend=self.config.backend,
            data_dir=str(self.config.data_dir.resolve()),
            store_id=self.store_id,
            namespace_prefix=self.scope.tenant(context),
            pid_namespace=pid_namespace(),
            fleet=self.store.fleet is not None,
        )

    # ---- memory tier (the same-host data plane)
    def _memory_offered(self) -> MemoryTier:
        memory = self.store.memory
        if memory is None:
            raise NoMemoryTier("this daemon runs without a memory tier (memory = 0); use Put and Get")
        if not self.config.offers_memory():
            reason = (
                "memory_clients = false" if self.config.memory_clients is False else "tenants are configured"
            )
            raise NoMemoryTier(
                f"this daemon does not offer its memory tier to clients ({reason}); use Put and Get"
            )
        return memory

    @translated
    def ArenaAccess(
        self, request: pb.ArenaAccessRequest, context: grpc.ServicerContext
    ) -> pb.ArenaAccessResponse:
        memory = self._memory_offered()
        return pb.ArenaAccessResponse(
            path=str(memory.file.path.resolve()),
            size_bytes=memory.file.size,
            store_id=self.store_id,
            namespace_prefix=self.scope.tenant(context),
            lease_seconds=memory.lease_seconds,
            control_socket=str(self.control.path) if self.control is not None else "",
            layouts=True,
        )

    @translated
    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        self._memory_offered()
        namespace = self._ns(context, request.namespace)
        layers = check_layout(request.layers, request.layout)
        subset = check_layer_subset(request.layer_subset, len(layers))
        return self._reserve(context, namespace, layers, subset, request, request.in_place)

    @translated
    def ReserveMany(
        self, request: pb.ReserveManyRequest, context: grpc.ServicerContext
    ) -> pb.ReserveManyResponse:
        """Reserve for each chain (one layout, a step's saves): a chain that Reserve would
        refuse is refused on its own, with that status code, and the others go on."""
        self._memory_offered()
        namespace = self._ns(context, request.namespace)
        layers = check_layout(request.layers, request.layout)
        subset = check_layer_subset(request.layer_subset, len(layers))
        answers = _each(
            request.chains, "chains",
            lambda chain: self._reserve(context, namespace, layers, subset, chain, request.in_place),
            lambda code, why: pb.ReserveResponse(refused_code=code, refused=why),
        )  # fmt: skip
        return pb.ReserveManyResponse(reservations=answers)

    def _reserve(
        self,
        context: grpc.ServicerContext,
        namespace: bytes,
        layers: tuple[LayerSpec, ...],
        subset: tuple[int, ...] | None,
        chain: pb.ReserveRequest | pb.ReserveChain,
        in_place: bool,
    ) -> pb.ReserveResponse:
        """One chain's reservation (its namespace, layers and subset checked already)."""
        memory = self._memory_offered()
        hashes = check_hashes(chain.block_hashes, wire.MAX_BLOCKS_PER_PUT)
        parent = check_hash(chain.parent_hash, "parent_hash") if chain.parent_hash else b""
        if parent and parent in hashes:
            raise InvalidRequest(
                "parent_hash is one of the request's own block hashes; a chain has no cycles"
            )
        carried = layers if subset is None else tuple(layers[k] for k in subset)
        tokens = self._tokens(chain.token_ids, len(hashes))
        check_record_size(namespace, hashes[0], layers)
        total = sum(layer.nbytes for layer in carried) * len(hashes)
        if total > self.config.max_put_bytes:
            raise CapacityError(f"save of {total} bytes exceeds max_put_bytes ({self.config.max_put_bytes})")
        res = self.store.reserve(self.scope.tenant(context), namespace, parent, hashes, layers,
                                 token_ids=tokens, subset=subset, in_place=in_place)  # fmt: skip
        if res is None:
            return pb.ReserveResponse(reservation_id=0)
        return pb.ReserveResponse(
            reservation_id=res.id,
            blocks=res.request_index,
            offset=res.extent,
            lease_seconds=memory.lease_seconds,
            extent_blocks=res.extent_blocks,
            position=res.position,
        )

    @translated
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        self._memory_offered()
        return self._commit(request, context)

    @translated
    def CommitMany(
        self, request: pb.CommitManyRequest, context: grpc.ServicerContext
    ) -> pb.CommitManyResponse:
        """Commit each (a step's saves): one that Commit would refuse is refused on its own,
        with that status code, and the others go on."""
        self._memory_offered()
        answers = _each(
            request.commits, "commits", lambda commit: pb.CommitAnswer(result=self._commit(commit, context)),
            lambda code, why: pb.CommitAnswer(refused_code=code, refused=why),
        )  # fmt: skip
        return pb.CommitManyResponse(answers=answers)

    def _commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.PutResponse:
        try:  # kept packed: a commit of 128 blocks of 256 store layers carries 32,768
            checksums = PackedSums(request.checksums)
        except ValueError as exc:
            raise InvalidRequest(f"packed checksums: {exc}") from exc
        result = self.store.commit(
            self.scope.tenant(context), request.reservation_id, checksums, request.checksum_kind or "xxh3",
            after_answer=context.add_callback,
        )  # fmt: skip
        return pb.PutResponse(
            blocks_written=result.blocks_written,
            blocks_skipped=result.blocks_skipped,
            bytes_written=result.bytes_written,
            blocks_evicted=result.blocks_evicted,
        )

    @translated
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self._memory_offered()
        self.store.abort(self.scope.tenant(context), request.reservation_id)
        return pb.AbortResponse()

    @translated
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        self._memory_offered()
        namespace = self._ns(context, request.namespace)
        with self.reclaim.busy():
            return self._pin(context, namespace, request, request.want_layout)

    @translated
    def PinMany(self, request: pb.PinManyRequest, context: grpc.ServicerContext) -> pb.PinManyResponse:
        """Pin each chain (a step's loads): one that Pin would refuse is refused on its own,
        with that status code, and the others go on."""
        self._memory_offered()
        namespace = self._ns(context, request.namespace)
        with self.reclaim.busy():
            pins = _each(
                request.chains, "chains",
                lambda chain: self._pin(context, namespace, chain, request.want_layout),
                lambda code, why: pb.PinResponse(refused_code=code, refused=why),
            )  # fmt: skip
        return pb.PinManyResponse(pins=pins)

    def _pin(
        self,
        context: grpc.ServicerContext,
        namespace: bytes,
        chain: pb.PinRequest | pb.PinChain,
        layout: bool,
    ) -> pb.PinResponse:
        hashes = check_hashes(chain.block_hashes, wire.MAX_BLOCKS_PER_LOOKUP)
        return _pin_message(self.store.pin(self.scope.tenant(context), namespace, hashes), layout)

    @translated
    def PinStream(self, request: pb.PinRequest, context: grpc.ServicerContext) -> Iterator[pb.PinProgress]:
        self._memory_offered()
        namespace = self._ns(context, request.namespace)
        hashes = check_hashes(request.block_hashes, wire.MAX_BLOCKS_PER_LOOKUP)
        with self.reclaim.busy():
            progress = self.store.pin_stream(self.scope.tenant(context), namespace, hashes)
            try:
                for item in progress:
                    if isinstance(item, PinResult):
                        ready = len(item.layers) if item.ready_layers < 0 else item.ready_layers
                        whole = item.num_blocks if item.ready_blocks < 0 else item.ready_blocks
                        yield pb.PinProgress(
                            pin=_pin_message(item, request.want_layout),
                            ready_layers=ready,
                            ready_blocks=whole,
                        )
                    elif isinstance(item, Ready):
                        yield pb.PinProgress(ready_layers=item.layers, ready_blocks=item.blocks)
                    else:
                        yield pb.PinProgress(stop_reason=wire.STOP_REASONS[item])
            finally:
                progress.close()  # a cancelled stream: the promotion still finishes

    @translated
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        self._memory_offered()
        corrupt = check_hashes(request.corrupt_block_hashes, wire.MAX_BLOCKS_PER_LOOKUP, allow_empty=True)
        found = self.store.release(self.scope.tenant(context), request.pin_id, corrupt,
                                   all_holders=request.all_holders)  # fmt: skip
        return pb.ReleaseResponse(was_pinned=found)

    # ---- routers and observers
    @translated
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        tenant = self.scope.tenant(context)
        namespace = self._ns(context, request.namespace) if request.namespace else None
        if not self._watchers.acquire(blocking=False):
            raise CapacityError(f"more than {self.config.max_watchers} Watch streams open (max_watchers)")
        try:
            cursor = self.events.subscribe(request.from_sequence, namespace, tenant)
            try:
                context.add_callback(lambda: self.events.cancel(cursor))
                # Once this arrives, every event committed afterwards reaches this stream.
                try:
                    context.send_initial_metadata(
                        (
                            (WATCH_STORE_ID_KEY, self.store_id),
                            (WATCH_START_SEQUENCE_KEY, str(cursor.next_sequence)),
                        )
                    )
                except grpc.RpcError:
                    return  # the client already went away
                while not cursor.cancelled and context.is_active():
                    batch = self.events.read(cursor, WATCH_POLL_SECONDS)
                    if batch is None:
                        raise ShuttingDown("the daemon is shutting down; watch again once it is back")
                    for event in batch:
                        yield _event_message(event, self.store_id, tenant)
            finally:
                self.events.unsubscribe(cursor)
        finally:
            self._watchers.release()


def _event_message(event: Event, store_id: str, tenant: bytes = b"") -> pb.Event:
    return pb.Event(
        sequence=event.sequence,
        kind=pb.Event.STORED if event.kind == STORED else pb.Event.REMOVED,
        namespace=event.namespace[len(tenant) :],
        block_hashes=event.block_hashes(),
        parent_hashes=event.parent_hashes(),
        timestamp=event.timestamp,
        store_id=store_id,
    )


def _stream(result: ReadResult, chunk_bytes: int) -> Iterator[pb.GetResponse | bytes]:
    """GetHeader, then each layer's blocks in chunks of at most `chunk_bytes`."""
    subset_indices = result.subset_indices
    yield pb.GetResponse(
        header=pb.GetHeader(
            num_blocks=result.num_blocks,
            layers=_layer_messages(tuple(result.layers[k] for k in subset_indices)),
            stop_reason=wire.STOP_REASONS[result.stop],
        )
    )
    for position, index in enumerate(subset_indices):  # a layer subset: chunks count within it
        per_chunk = max(1, chunk_bytes // result.layers[index].nbytes)
        for first in range(0, result.num_blocks, per_chunk):
            blocks = result.blocks[first : first + per_chunk]
            yield wire.encode_chunk(position, first, [b.layers[index] for b in blocks])


def _decode_page_token(token: bytes) -> tuple[bytes, bytes]:
    size = int.from_bytes(token[:2], "big")
    if len(token) != 2 + size + wire.HASH_BYTES:
        raise InvalidRequest("invalid page_token; pass the one from the previous ListResponse")
    return token[2 : 2 + size], token[2 + size :]


def _block_info(info: Any, tenant: bytes = b"") -> pb.BlockInfo:
    return pb.BlockInfo(
        namespace=info.namespace[len(tenant) :],
        block_hash=info.block_hash,
        parent_hash=info.entry.parent,
        size_bytes=info.entry.size,
        num_layers=info.entry.num_layers,
        created_at=info.entry.created_at,
        last_access_at=info.entry.last_access,
        num_children=info.num_children,
    )


T = TypeVar("T")
A = TypeVar("A")


def _each(
    items: Sequence[T], what: str, answer: Callable[[T], A], refused: Callable[[int, str], A]
) -> list[A]:
    """A *Many call's answers: answer(item) for each item (at most wire.MAX_MANY), and for
    an item that fails as its own call would, refused(that status code, why); the others
    go on."""
    if len(items) > wire.MAX_MANY:
        raise InvalidRequest(f"{len(items)} {what}; the limit is {wire.MAX_MANY}")
    out = []
    for item in items:
        try:
            out.append(answer(item))
        except REFUSALS as exc:
            out.append(refused(status_of(exc).value[0], str(exc)))
    return out


def _pin_message(pin: PinResult, layout: bool = False) -> pb.PinResponse:
    """A pin as Pin answers it; its layers as a serialized Layout where the caller asked
    (`layout`: want_layout), else as LayerSpec messages."""
    return pb.PinResponse(
        pin_id=pin.pin_id,
        num_blocks=pin.num_blocks,
        layers=_layer_messages(pin.layers) if not layout else (),
        layout=_layout_bytes(pin.layers) if layout and pin.layers else b"",
        runs=[
            pb.ArenaRun(offset=r.extent, extent_blocks=r.extent_blocks, first=r.position, count=r.count)
            for r in pin.runs
        ],
        checksums=pin.checksums,
        lease_seconds=pin.lease_seconds,
        checksum_kinds=pin.kinds,
        stop_reason=wire.STOP_REASONS[pin.stop],
    )


def generic_handler(servicer: Servicer) -> grpc.GenericRpcHandler:
    """Method handlers; Put, Get and DropSelect use the fast codec in kvstore.wire."""
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Lookup": unary(servicer.Lookup, _decoder(pb.LookupRequest), pb.LookupResponse.SerializeToString),
        "Put": grpc.stream_unary_rpc_method_handler(
            servicer.Put, wire.decode_put_request, pb.PutResponse.SerializeToString
        ),
        "Get": grpc.unary_stream_rpc_method_handler(
            servicer.Get, _decoder(pb.GetRequest), wire.encode_get_response
        ),
        "DropSelect": grpc.unary_stream_rpc_method_handler(
            servicer.DropSelect, _decoder(pb.DropSelectRequest), wire.encode_get_response
        ),
        "Evict": unary(servicer.Evict, _decoder(pb.EvictRequest), pb.EvictResponse.SerializeToString),
        "Stats": unary(servicer.Stats, _decoder(pb.StatsRequest), pb.StatsResponse.SerializeToString),
        "List": unary(servicer.List, _decoder(pb.ListRequest), pb.ListResponse.SerializeToString),
        "Describe": unary(
            servicer.Describe, _decoder(pb.DescribeRequest), pb.DescribeResponse.SerializeToString
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, _decoder(pb.WatchRequest), pb.Event.SerializeToString
        ),
        "PinStream": grpc.unary_stream_rpc_method_handler(
            servicer.PinStream, _decoder(pb.PinRequest), pb.PinProgress.SerializeToString
        ),
        "LocalAccess": unary(
            servicer.LocalAccess, _decoder(pb.LocalAccessRequest), pb.LocalAccessResponse.SerializeToString
        ),
    }
    for name, request, response in (
        ("ArenaAccess", pb.ArenaAccessRequest, pb.ArenaAccessResponse),
        ("Reserve", pb.ReserveRequest, pb.ReserveResponse),
        ("ReserveMany", pb.ReserveManyRequest, pb.ReserveManyResponse),
        ("Commit", pb.CommitRequest, pb.PutResponse),
        ("CommitMany", pb.CommitManyRequest, pb.CommitManyResponse),
        ("Abort", pb.AbortRequest, pb.AbortResponse),
        ("Pin", pb.PinRequest, pb.PinResponse),
        ("PinMany", pb.PinManyRequest, pb.PinManyResponse),
        ("Release", pb.ReleaseRequest, pb.ReleaseResponse),
    ):
        handlers[name] = unary(getattr(servicer, name), _decoder(request), response.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


_LAYER_MESSAGES: dict[int, tuple[tuple[LayerSpec, ...], list[pb.LayerSpec]]] = {}


def _layer_messages(layers: tuple[LayerSpec, ...]) -> list[pb.LayerSpec]:
    """A layout's LayerSpec messages, made once per (interned) layout: a Pin answers with
    its blocks' layout, 32+ messages, on every load."""
    return per_layout(_LAYER_MESSAGES, layers, _make_layer_messages)


def _make_layer_messages(layers: tuple[LayerSpec, ...]) -> list[pb.LayerSpec]:
    return [pb.LayerSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in layers]


_LAYOUT_BYTES: dict[int, tuple[tuple[LayerSpec, ...], bytes]] = {}


def _layout_bytes(layers: tuple[LayerSpec, ...]) -> bytes:
    """A layout as a serialized Layout (PinResponse.layout), made once per (interned) layout."""
    return per_layout(
        _LAYOUT_BYTES, layers, lambda ls: pb.Layout(layers=_make_layer_messages(ls)).SerializeToString()
    )

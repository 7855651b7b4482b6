"""Every RPC through KVStoreClient against a real server (in-process; a subprocess daemon
where the test pauses it). What reads back from the backend runs on both backends."""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future

import grpc
import pytest
import torch
import xxhash

from kvstore.service import SERVICE_NAME
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc
from kvstore_client import KVStoreClient, LayerSpec, PutResult, errors

from .helpers import (
    NS,
    as_bytes,
    assert_same,
    block_bytes,
    both_backends,
    chain,
    make_layers,
    raw_unary,
    rows,
    rpc_code,
)


# ---- lookup ----------------------------------------------------------------------
def test_lookup_full_partial_and_unknown_namespace(kv: KVStoreClient) -> None:
    hashes = chain("lookup", 6)
    kv.put(NS, hashes[:4], make_layers(4))

    assert kv.lookup(NS, hashes[:4]) == 4
    assert kv.lookup(NS, hashes[:2]) == 2
    assert kv.lookup(NS, hashes) == 4  # partial prefix: blocks 4 and 5 are not stored
    assert kv.lookup(NS, [hashes[5], *hashes[:4]]) == 0  # a missing first block is a miss
    assert kv.lookup(NS, chain("never-stored", 3)) == 0
    assert kv.lookup("unknown-namespace", hashes) == 0
    assert kv.lookup(NS, []) == 0


def test_a_probe_lookup_answers_alike_but_counts_apart_and_moves_no_recency(make_server) -> None:
    # capacity for 4 blocks: a fifth evicts the least recently used
    server = make_server("probe", capacity=str(4 * block_bytes(make_layers(1))))
    with KVStoreClient(server.address, arena=False) as kv:
        hashes = [chain(f"probe-{i}", 1)[0] for i in range(5)]
        for h in hashes[:4]:
            kv.put(NS, [h], make_layers(1))
        before = kv.stats()
        assert kv.lookup(NS, hashes[:1], probe=True) == 1  # a router asking about the oldest block
        assert kv.lookup(NS, [hashes[0], chain("absent", 1)[0]], probe=True) == 1
        after = kv.stats()
        assert after["probe_lookups"] - before["probe_lookups"] == 2
        assert (after["lookups"], after["hit_blocks"], after["miss_blocks"]) == (
            before["lookups"], before["hit_blocks"], before["miss_blocks"])  # fmt: skip
        kv.put(NS, hashes[4:], make_layers(1))  # the oldest goes: the probes did not refresh it
        assert kv.lookup(NS, hashes[:1]) == 0 and kv.lookup(NS, hashes[1:2]) == 1


def test_lookup_across_namespaces_is_the_common_prefix(server, kv: KVStoreClient) -> None:
    hashes = chain("ranks", 5)
    layers = make_layers(5, seed=23)
    kv.put("rank-0", hashes, layers)
    kv.put(b"rank-1", hashes[:3], rows(layers, 0, 3))

    assert kv.lookup(["rank-0"], hashes) == 5
    assert kv.lookup(["rank-0", b"rank-1"], hashes) == 3
    assert kv.lookup([b"rank-1", "rank-0"], hashes[:2]) == 2
    assert kv.lookup(["rank-0", "rank-1", "rank-2"], hashes) == 0
    with pytest.raises(errors.InvalidRequest):
        kv.lookup([f"rank-{i}" for i in range(65)], hashes)
    with pytest.raises(errors.InvalidRequest):
        kv.lookup(["rank-0", ""], hashes)
    # both forms at once is refused; only a raw request can say that
    both = pb.LookupRequest(namespace=b"rank-0", namespaces=[b"rank-1"], block_hashes=hashes)
    assert rpc_code(lambda: raw_unary(server.address, "Lookup", both, pb.LookupResponse)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


# ---- put / insert / select ---------------------------------------------------------
def test_put_waits_for_commit_and_insert_returns_a_future(kv: KVStoreClient) -> None:
    hashes = chain("put", 3)
    layers = make_layers(3, seed=1)
    size = block_bytes(layers)

    assert kv.put(NS, hashes, layers) == PutResult(3, 0, 3 * size, 0)
    assert kv.lookup(NS, hashes) == 3
    assert_same(kv.select(NS, hashes), layers)

    more = chain("insert", 4)
    more_layers = make_layers(4, seed=2)
    future = kv.insert(NS, more, more_layers)
    assert isinstance(future, Future)
    assert future.result(timeout=30) == PutResult(4, 0, 4 * size, 0)
    assert kv.lookup(NS, more) == 4
    assert_same(kv.select(NS, more), more_layers)


def test_a_put_stream_timeout_counts_the_store_not_the_writer(daemon, daemon_kv: KVStoreClient) -> None:
    """The writer may take several timeouts between layers (a long forward pass);
    a store that stops taking data fails the stream with StoreTimeout, then stores nothing."""
    hashes = chain("slow-writer", 2)
    layers = make_layers(2, num_layers=2)
    specs = [LayerSpec.of(name, t) for name, t in layers.items()]
    stream = daemon_kv.put_stream(NS, hashes, specs, timeout=0.2)
    for name, tensor in layers.items():
        time.sleep(0.5)  # the writer's own work, 2.5x the timeout each time
        stream.write_layer(name, tensor)
    assert stream.commit().blocks_written == 2

    big = make_layers(4, num_layers=4, shape=(256, 1024))  # 2 MiB a layer: more than gRPC's windows
    stalled = daemon_kv.put_stream(
        NS, chain("stalled", 4), [LayerSpec.of(n, t) for n, t in big.items()], timeout=0.5
    )
    daemon.pause()  # connected, taking nothing
    try:
        with pytest.raises(errors.StoreTimeout, match="took no data"):
            for name, tensor in big.items():
                stalled.write_layer(name, tensor)
            stalled.commit()
    finally:
        daemon.resume()
    assert daemon_kv.lookup(NS, chain("stalled", 4)) == 0
    assert_same(daemon_kv.select(NS, hashes), layers)


def test_reput_reports_skipped_blocks_and_keeps_the_first_data(kv: KVStoreClient) -> None:
    hashes = chain("reput", 6)
    layers = make_layers(6, seed=3)
    size = block_bytes(layers)

    assert kv.put(NS, hashes[:4], rows(layers, 0, 4)) == PutResult(4, 0, 4 * size, 0)
    # the same blocks again, even with other bytes: skipped, not rewritten
    other = make_layers(4, seed=99)
    assert kv.put(NS, hashes[:4], other) == PutResult(0, 4, 0, 0)
    # an overlapping put continuing the chain: only the new tail is written
    overlap = kv.put(NS, hashes[2:], rows(layers, 2, 6), parent_hash=hashes[1])
    assert overlap == PutResult(2, 2, 2 * size, 0)

    assert kv.stats()["blocks"] == 6
    assert_same(kv.select(NS, hashes), layers)
    assert kv.describe(NS, hashes[4]).block.parent_hash == hashes[3]


def test_select_returns_the_stored_prefix_or_nothing(kv: KVStoreClient) -> None:
    hashes = chain("select", 5)
    layers = make_layers(5, seed=4)
    kv.put(NS, hashes[:3], rows(layers, 0, 3))

    assert_same(kv.select(NS, hashes), rows(layers, 0, 3))
    assert_same(kv.select(NS, hashes[:2]), rows(layers, 0, 2))
    assert kv.select(NS, hashes[3:]) == {}
    assert kv.select("unknown-namespace", hashes) == {}
    # select is not destructive
    assert kv.lookup(NS, hashes) == 3


def test_select_stops_where_the_layer_layout_changes(kv: KVStoreClient) -> None:
    hashes = chain("layout", 4)
    head = make_layers(2, shape=(2, 4, 8), seed=20)
    tail = make_layers(2, shape=(4, 8), dtype=torch.float32, seed=21)  # same bytes per block, other layout
    kv.put(NS, hashes[:2], head)
    kv.put(NS, hashes[2:], tail, parent_hash=hashes[1])

    assert kv.lookup(NS, hashes) == 4
    assert_same(kv.select(NS, hashes), head)  # never a mix of layouts
    assert_same(kv.select(NS, hashes[2:]), tail)


def test_select_says_why_it_stops_where_lookup_counts_on(make_server) -> None:
    server = make_server(log_level="DEBUG")
    hashes = chain("layer-sets", 2)
    both = make_layers(2, num_layers=2, seed=22)
    with KVStoreClient(server.address, arena=False) as kv:
        kv.put(NS, hashes[:1], rows(both, 0, 1))
        # the block after it, put with another layer set (one layer fewer)
        kv.put(NS, hashes[1:], {"layer.0": both["layer.0"][1:].contiguous()}, parent_hash=hashes[0])

        assert kv.lookup(NS, hashes) == 2  # by hash: both are stored
        got = kv.select(NS, hashes)
    assert_same(got, rows(both, 0, 1))  # the first block only, in its own layer set
    assert (got.num_blocks, got.stop_reason) == (1, "layer_set_differs")
    log = server.log()
    assert "has another layer layout than its prefix" in log
    assert f"returned 1: layer_set_differs at block {hashes[1].hex()}" in log


def test_select_stop_reasons_of_a_full_read_and_a_miss(kv: KVStoreClient) -> None:
    hashes = chain("stop-reasons", 3)
    kv.put(NS, hashes[:2], make_layers(2, seed=23))
    whole = kv.select(NS, hashes[:2])
    assert (whole.num_blocks, whole.stop_reason) == (2, "none")
    short = kv.select(NS, hashes)
    assert (short.num_blocks, short.stop_reason) == (2, "not_stored")
    miss = kv.select("nothing-here", hashes)
    assert miss == {} and (miss.num_blocks, miss.stop_reason) == (0, "not_stored")


def test_a_put_of_stored_hashes_keeps_the_first_bytes(kv: KVStoreClient) -> None:
    hashes = chain("first-writer", 2)
    first, second = make_layers(2, seed=24), make_layers(2, seed=25)
    kv.put(NS, hashes, first)
    assert kv.put(NS, hashes, second) == PutResult(0, 2, 0, 0)  # skipped, not compared
    assert_same(kv.select(NS, hashes), first)


def test_get_stream_delivers_layer_by_layer(server, kv: KVStoreClient) -> None:
    n = 5
    g = torch.Generator().manual_seed(5)
    layers = {
        "k": torch.randint(0, 256, (n, 2, 16), dtype=torch.uint8, generator=g).view(torch.float16),
        "v": torch.randint(0, 256, (n, 4, 4, 2), dtype=torch.uint8, generator=g).view(torch.bfloat16),
        "scale": torch.randint(0, 256, (n, 12), dtype=torch.uint8, generator=g).view(torch.float32),
    }
    hashes = chain("stream", n)
    kv.put(NS, hashes, layers)

    # chunks smaller than one block: the daemon sends one block per message
    with KVStoreClient(server.address, chunk_bytes=40) as small:
        events: list[str] = []

        def allocate(spec: LayerSpec, num_blocks: int) -> torch.Tensor:
            events.append(f"alloc {spec.name}")
            return torch.full((num_blocks, *spec.shape), 7, dtype=getattr(torch, spec.dtype))

        stream = small.get_stream(NS, [*hashes, *chain("absent-tail", 2)], allocate=allocate)
        assert stream.num_blocks == n
        assert stream.layers == [LayerSpec.of(name, t) for name, t in layers.items()]
        got = {}
        for name, tensor in stream:
            events.append(f"got {name}")
            got[name] = tensor
        # each layer is handed over before the next one is even allocated
        assert events == [f"{what} {name}" for name in layers for what in ("alloc", "got")]
        assert_same(got, layers)

    miss = kv.get_stream(NS, chain("absent", 2))
    assert miss.num_blocks == 0
    assert miss.layers == []
    assert list(miss) == []


def test_layers_larger_than_one_message_chunk(kv: KVStoreClient) -> None:
    """Default 4 MiB chunks: a layer spans several messages, and a block may exceed a chunk."""
    n = 3
    g = torch.Generator().manual_seed(22)
    layers = {
        "two_mib_blocks": torch.randint(0, 256, (n, 1024, 2048), dtype=torch.uint8, generator=g).view(
            torch.float16
        ),
        "five_mib_blocks": torch.randint(0, 256, (n, 5, 1 << 20), dtype=torch.uint8, generator=g).view(
            torch.bfloat16
        ),
    }
    hashes = chain("large", n)
    assert kv.put(NS, hashes, layers).bytes_written == n * 7 * (1 << 20)
    assert_same(kv.select(NS, hashes), layers)
    assert_same(kv.drop_select(NS, hashes, timeout=1.0), layers)


# ---- drop_select -----------------------------------------------------------------
def test_drop_select_consumes_once(kv: KVStoreClient) -> None:
    hashes = chain("drop", 4)
    layers = make_layers(4, seed=6)
    kv.put(NS, hashes, layers)
    blocks_before = kv.stats()["blocks"]

    got = kv.drop_select(NS, hashes[:3], timeout=5.0)
    assert_same(got, rows(layers, 0, 3))
    assert kv.lookup(NS, hashes) == 0
    assert kv.stats()["blocks"] == blocks_before - 3
    assert kv.lookup(NS, hashes[3:]) == 1  # the block below the taken prefix stays

    with pytest.raises(errors.StoreTimeout):
        kv.drop_select(NS, hashes[:3], timeout=0.2)


def test_take_stream_consumes_layer_by_layer(kv: KVStoreClient) -> None:
    hashes = chain("take-stream", 3)
    layers = make_layers(3, num_layers=3, seed=24)
    kv.put(NS, hashes, layers)
    events: list[str] = []

    def allocate(spec: LayerSpec, num_blocks: int) -> torch.Tensor:
        events.append(f"alloc {spec.name}")
        return torch.empty((num_blocks, *spec.shape), dtype=getattr(torch, spec.dtype))

    stream = kv.take_stream(NS, hashes, 5.0, allocate=allocate)
    assert stream.num_blocks == 3
    assert kv.lookup(NS, hashes) == 0  # taken as soon as the stream started
    got = {}
    for name, tensor in stream:
        events.append(f"got {name}")
        got[name] = tensor
    assert events == [f"{what} {name}" for name in layers for what in ("alloc", "got")]
    assert_same(got, layers)
    with pytest.raises(errors.StoreTimeout):
        kv.take_stream(NS, hashes, 0.1)


def test_drop_select_timeout_removes_nothing(kv: KVStoreClient) -> None:
    hashes = chain("drop-timeout", 3)
    layers = make_layers(3, seed=7)
    kv.put(NS, hashes[:2], rows(layers, 0, 2))

    with pytest.raises(errors.StoreTimeout) as info:
        kv.drop_select(NS, hashes, timeout=0.2)
    assert isinstance(info.value, TimeoutError)
    assert kv.lookup(NS, hashes) == 2
    assert_same(kv.select(NS, hashes), rows(layers, 0, 2))
    assert kv.stats()["blocks"] == 2


# ---- evict -----------------------------------------------------------------------
def test_evict_all(kv: KVStoreClient) -> None:
    a, b = chain("all-a", 3), chain("all-b", 2, namespace="other")
    layers = make_layers(3)
    kv.put(NS, a, layers)
    kv.put("other", b, rows(layers, 0, 2))

    result = kv.evict(all=True)
    assert result.blocks_evicted == 5
    assert result.bytes_freed == 5 * block_bytes(layers)
    stats = kv.stats()
    assert (stats["blocks"], stats["bytes_used"], stats["namespaces"]) == (0, 0, 0)
    assert kv.lookup(NS, a) == 0 and kv.lookup("other", b) == 0
    assert kv.list_blocks() == ([], b"")


def test_evict_namespace(kv: KVStoreClient) -> None:
    a, b = chain("ns-a", 3), chain("ns-b", 2, namespace=b"other")
    layers = make_layers(3, seed=8)
    kv.put(NS, a, layers)
    kv.put(b"other", b, rows(layers, 0, 2))
    assert kv.stats()["namespaces"] == 2

    result = kv.evict(namespace="other")
    assert (result.blocks_evicted, result.bytes_freed) == (2, 2 * block_bytes(layers))
    assert kv.lookup("other", b) == 0
    assert kv.stats()["namespaces"] == 1
    assert_same(kv.select(NS, a), layers)
    assert kv.evict(namespace="other").blocks_evicted == 0


def test_evict_block_and_descendants(kv: KVStoreClient) -> None:
    main = chain("tree", 5)
    layers = make_layers(5, seed=9)
    kv.put(NS, main, layers)
    # a branch sharing blocks 0..2, continuing differently after block 2
    branch = chain("tree-branch", 2)
    kv.put(NS, branch, rows(layers, 0, 2), parent_hash=main[2])
    assert kv.describe(NS, main[2]).block.num_children == 2
    size = block_bytes(layers)

    result = kv.evict(namespace=NS, block_hash=main[2])
    assert (result.blocks_evicted, result.bytes_freed) == (5, 5 * size)  # main[2:], both branch blocks
    assert kv.lookup(NS, main) == 2
    assert kv.lookup(NS, branch) == 0
    assert {b.block_hash for b in kv.list_blocks(NS)[0]} == set(main[:2])
    assert kv.describe(NS, main[1]).block.num_children == 0
    assert_same(kv.select(NS, main), rows(layers, 0, 2))


def test_evict_older_than(kv: KVStoreClient) -> None:
    old, new = chain("age-old", 3), chain("age-new", 2)
    layers = make_layers(3, seed=10)
    kv.put(NS, old, layers)
    # Let some of the daemon's own time pass between the two puts: a DropSelect
    # of an absent block waits that long on the daemon before it times out.
    with pytest.raises(errors.StoreTimeout):
        kv.drop_select(NS, chain("age-absent", 1), timeout=0.4)
    kv.put(NS, new, rows(layers, 0, 2))

    access = {info.block_hash: info.last_access_at for info in kv.list_blocks(NS)[0]}
    old_last = max(access[h] for h in old)
    new_first = min(access[h] for h in new)
    assert new_first - old_last >= 0.4
    # The daemon computes cutoff = its now - older_than, a little after our now:
    # aim just past the old group, leaving the rest of the gap for that latency.
    older_than = time.time() - (old_last + 0.01)

    result = kv.evict(older_than=older_than)
    assert (result.blocks_evicted, result.bytes_freed) == (3, 3 * block_bytes(layers))
    assert kv.lookup(NS, old) == 0
    assert kv.lookup(NS, new) == 2
    assert kv.evict(older_than=3600).blocks_evicted == 0


def test_evict_target_bytes_trims_least_recent_tails(kv: KVStoreClient) -> None:
    a, b = chain("target-a", 4), chain("target-b", 4)
    layers = make_layers(4, seed=11)
    size = block_bytes(layers)
    kv.put(NS, a, layers)
    kv.put(NS, b, layers)
    used = kv.stats()["bytes_used"]
    assert used == 8 * size

    result = kv.evict(target_bytes=used - 3 * size)
    assert (result.blocks_evicted, result.bytes_freed) == (3, 3 * size)
    assert kv.stats()["bytes_used"] == 5 * size
    # the older chain lost its tail, keeping a reachable prefix; the newer one is whole
    assert kv.lookup(NS, a) == 1
    assert kv.lookup(NS, b) == 4
    assert_same(kv.select(NS, a), rows(layers, 0, 1))
    assert kv.evict(target_bytes=used).blocks_evicted == 0


# ---- stats / list / describe / health ----------------------------------------------
@both_backends
def test_stats_counters(server, kv: KVStoreClient, backend: str) -> None:
    before = kv.stats()
    assert before["backend"] == backend
    assert before["capacity_bytes"] == 1 << 30  # the servers' default capacity in tests, 1GiB
    assert before["version"]
    assert before["uptime_seconds"] > 0

    hashes = chain("stats", 3)
    layers = make_layers(3, seed=12)
    size = block_bytes(layers)
    kv.put(NS, hashes, layers)
    kv.put(NS, hashes, layers)  # all skipped
    assert kv.lookup(NS, [*hashes, *chain("stats-miss", 2)]) == 3
    # Read the whole Get stream, to its closing status: the daemon counts the bytes
    # read when its stream generator finishes, just before that status is sent.
    with grpc.insecure_channel(server.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        assert len(list(stub.Get(pb.GetRequest(namespace=NS.encode(), block_hashes=hashes)))) == 3

    after = kv.stats()
    delta = {
        k: after[k] - before[k]
        for k in (
            "puts",
            "blocks_written",
            "bytes_written",
            "lookups",
            "hit_blocks",
            "miss_blocks",
            "bytes_read",
        )
    }
    assert delta == {
        "puts": 2,
        "blocks_written": 3,
        "bytes_written": 3 * size,
        "lookups": 1,
        "hit_blocks": 3,
        "miss_blocks": 2,
        "bytes_read": 3 * size,
    }
    assert (after["blocks"], after["bytes_used"], after["namespaces"]) == (3, 3 * size, 1)
    assert after["evictions"] == after["checksum_failures"] == 0
    assert after["uptime_seconds"] >= before["uptime_seconds"]


def test_list_blocks_pages_with_a_token(kv: KVStoreClient) -> None:
    hashes = chain("list", 25)
    layers = make_layers(25, seed=13)
    size = block_bytes(layers)
    started = time.time()
    kv.put(NS, hashes, layers)
    other = chain("list-other", 3, namespace="other")
    kv.put("other", other, rows(layers, 0, 3))

    pages = []
    token = b""
    while True:
        page, token = kv.list_blocks(NS, limit=10, page_token=token)
        pages.append(page)
        if not token:
            break
    assert [len(p) for p in pages] == [10, 10, 5]
    listed = [info for page in pages for info in page]
    keys = [info.block_hash for info in listed]
    assert keys == sorted(hashes)  # (namespace, hash) order, no repeats, nothing missing
    parent = {h: hashes[i - 1] if i else b"" for i, h in enumerate(hashes)}
    for info in listed:
        assert info.namespace == NS.encode()
        assert info.parent_hash == parent[info.block_hash]
        assert info.size_bytes == size
        assert info.num_children == (0 if info.block_hash == hashes[-1] else 1)
        assert started - 5 <= info.created_at <= time.time() + 5

    # every namespace, a page size dividing the total: the last full page still has a token
    sizes = []
    token = b""
    seen = []
    while True:
        page, token = kv.list_blocks(limit=7, page_token=token)
        sizes.append(len(page))
        seen += [(i.namespace, i.block_hash) for i in page]
        if not token:
            break
    assert sizes == [7, 7, 7, 7, 0]
    assert sorted(seen) == seen
    assert set(seen) == {(NS.encode(), h) for h in hashes} | {(b"other", h) for h in other}
    assert len(list(kv.iter_blocks(page_size=4))) == 28


def test_namespaces_lists_those_that_hold_blocks(server, kv: KVStoreClient) -> None:
    assert kv.namespaces() == []
    kv.put("zeta", chain("ns-z", 2, namespace="zeta"), make_layers(2))
    kv.put(NS, chain("ns-a", 1), make_layers(1))
    kv.put(b"\xff", chain("ns-bin", 1, namespace=b"\xff"), make_layers(1))
    assert kv.namespaces() == [NS.encode(), b"zeta", b"\xff"]
    kv.evict(namespace="zeta")
    assert kv.namespaces() == [NS.encode(), b"\xff"]  # an emptied namespace is gone
    # as the daemon answers it: one message, no blocks
    resp = raw_unary(server.address, "List", pb.ListRequest(namespaces_only=True), pb.ListResponse)
    assert (list(resp.namespaces), list(resp.blocks), resp.next_page_token) == (
        [NS.encode(), b"\xff"],
        [],
        b"",
    )


def test_namespaces_from_a_daemon_that_only_lists_blocks() -> None:
    """A daemon that predates namespaces_only ignores it and answers with blocks: the
    client pages through them all."""
    blocks = [
        pb.BlockInfo(namespace=ns, block_hash=bytes([i]) * 32)
        for i, ns in enumerate([b"a", b"a", b"b", b"c"])
    ]

    def list_blocks(request: pb.ListRequest, context: object) -> pb.ListResponse:
        start = int(request.page_token or b"0")
        end = start + 2
        return pb.ListResponse(
            blocks=blocks[start:end], next_page_token=b"%d" % end if end < len(blocks) else b""
        )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(
        list_blocks, pb.ListRequest.FromString, pb.ListResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"List": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with KVStoreClient(f"127.0.0.1:{port}", arena=False) as kv:
            assert kv.namespaces() == [b"a", b"b", b"c"]
    finally:
        server.stop(None).wait()


@both_backends
def test_describe(kv: KVStoreClient) -> None:
    hashes = chain("describe", 2)
    layers = {
        "k": make_layers(2, num_layers=1, shape=(2, 8), dtype=torch.bfloat16, seed=14)["layer.0"],
        "v": make_layers(2, num_layers=1, shape=(3,), dtype=torch.float32, seed=15)["layer.0"],
    }
    started = time.time()
    kv.put(NS, hashes, layers)

    first = kv.describe(NS, hashes[0])
    assert first.block.namespace == NS.encode()
    assert first.block.block_hash == hashes[0]
    assert first.block.parent_hash == b""
    assert first.block.num_layers == 2
    assert first.block.num_children == 1
    assert first.block.size_bytes == block_bytes(layers)
    assert started - 5 <= first.block.created_at <= time.time() + 5
    assert [(i.spec.name, i.spec.dtype, list(i.spec.shape), i.nbytes) for i in first.layers] == [
        ("k", "bfloat16", [2, 8], 32),
        ("v", "float32", [3], 12),
    ]
    for info, tensor in zip(first.layers, layers.values(), strict=True):
        assert info.checksum == xxhash.xxh3_64_intdigest(as_bytes(tensor[0]))

    second = kv.describe(NS.encode(), hashes[1])
    assert second.block.parent_hash == hashes[0]
    assert second.block.num_children == 0

    with pytest.raises(errors.BlockNotFound):
        kv.describe(NS, chain("describe-absent", 1)[0])
    with pytest.raises(errors.BlockNotFound):
        kv.describe("other", hashes[0])


def test_health(kv: KVStoreClient) -> None:
    assert kv.health() == "SERVING"


# ---- data types and keys -----------------------------------------------------------
@both_backends
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_dtypes_round_trip_bit_exactly(kv: KVStoreClient, dtype: torch.dtype) -> None:
    hashes = chain(f"dtype-{dtype}", 4)
    layers = make_layers(4, num_layers=3, shape=(2, 3, 8), dtype=dtype, seed=16)
    kv.put(NS, hashes, layers)

    got = kv.select(NS, hashes)
    assert all(t.dtype == dtype for t in got.values())
    assert_same(got, layers)
    assert kv.describe(NS, hashes[0]).layers[0].spec.dtype == str(dtype).removeprefix("torch.")
    assert_same(kv.drop_select(NS, hashes, timeout=1.0), layers)


def test_namespace_str_and_bytes_are_the_same_key(kv: KVStoreClient) -> None:
    name = "tenant-ß/模型"
    hashes = chain("ns-equiv", 2, namespace=name)
    layers = make_layers(2, seed=17)
    kv.put(name, hashes, layers)

    assert kv.lookup(name.encode(), hashes) == 2
    assert_same(kv.select(name.encode(), hashes), layers)
    assert kv.put(name.encode(), hashes, layers).blocks_skipped == 2
    assert [i.namespace for i in kv.list_blocks(name)[0]] == [name.encode()] * 2
    assert kv.describe(name.encode(), hashes[0]).block.namespace == name.encode()
    assert kv.stats()["namespaces"] == 1
    assert kv.evict(namespace=name.encode()).blocks_evicted == 2
    assert kv.lookup(name, hashes) == 0


# ---- the generated stubs interoperate with the daemon ------------------------------
def test_generated_stub_get_matches_the_fast_client_path(server, kv: KVStoreClient) -> None:
    hashes = chain("stub", 3)
    layers = make_layers(3, num_layers=2, shape=(4, 16), dtype=torch.bfloat16, seed=18)
    kv.put(NS, hashes, layers)
    fast = kv.select(NS, hashes)

    with grpc.insecure_channel(server.address) as channel:
        stub = kvstore_pb2_grpc.KVStoreStub(channel)
        assert stub.Lookup(pb.LookupRequest(namespace=NS.encode(), block_hashes=hashes)).num_blocks == 3
        responses = list(
            stub.Get(pb.GetRequest(namespace=NS.encode(), block_hashes=hashes, max_chunk_bytes=300))
        )

    assert responses[0].WhichOneof("msg") == "header"
    head = responses[0].header
    assert head.num_blocks == 3
    assert [(s.name, s.dtype, list(s.shape)) for s in head.layers] == [
        (name, "bfloat16", [4, 16]) for name in layers
    ]
    data: dict[int, bytearray] = {i: bytearray() for i in range(len(head.layers))}
    order = []
    for response in responses[1:]:
        assert response.WhichOneof("msg") == "chunk"
        c = response.chunk
        assert c.first_block * 128 == len(data[c.layer_index])  # contiguous, in block order
        data[c.layer_index] += c.data
        order.append(c.layer_index)
    assert order == sorted(order)  # layer by layer
    assert len(responses) > 1 + len(head.layers)  # really chunked
    assert [bytes(data[i]) for i in range(len(layers))] == [as_bytes(t) for t in fast.values()]
    assert [bytes(data[i]) for i in range(len(layers))] == [as_bytes(t) for t in layers.values()]


def test_generated_stub_put_is_readable_by_the_client(server, kv: KVStoreClient) -> None:
    hashes = chain("stub-put", 2)
    layers = make_layers(2, num_layers=2, shape=(2, 8), dtype=torch.float16, seed=19)
    requests = [
        pb.PutRequest(
            header=pb.PutHeader(
                namespace=NS.encode(),
                block_hashes=hashes,
                layers=[pb.LayerSpec(name=n, dtype="float16", shape=[2, 8]) for n in layers],
            )
        )
    ]
    for index, tensor in enumerate(layers.values()):
        for block in range(2):  # one message per block, plain protobuf encoding
            requests.append(
                pb.PutRequest(
                    chunk=pb.LayerChunk(layer_index=index, first_block=block, data=as_bytes(tensor[block]))
                )
            )
    requests.append(pb.PutRequest(commit=pb.PutCommit()))

    with grpc.insecure_channel(server.address) as channel:
        response = kvstore_pb2_grpc.KVStoreStub(channel).Put(iter(requests), timeout=30)
    assert (response.blocks_written, response.blocks_skipped) == (2, 0)
    assert response.bytes_written == 2 * block_bytes(layers)
    assert_same(kv.select(NS, hashes), layers)

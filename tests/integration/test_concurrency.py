"""Many clients and threads at once against one server (in-process: a real gRPC server on
a real port; the clients are threads here as they were beside a daemon process). One backend:
the Store serialises every change to the backend (`_commit_lock`), so the races are the
Store's and the service's, not the backend's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kvstore_client import KVStoreClient, PutResult, errors

from .helpers import (
    NS,
    assert_same,
    block_bytes,
    chain,
    drop_select_parked,
    make_layers,
    wait_until_parked,
)

NUM_CLIENTS = 100


def test_drop_select_is_handed_its_data_by_an_insert_from_another_thread(make_server) -> None:
    d = make_server(max_waiting_drop_selects=1)
    hashes = chain("handoff", 4)
    layers = make_layers(4, seed=21)
    parked = threading.Event()
    inserted: dict[str, PutResult] = {}

    def producer() -> None:
        with KVStoreClient(d.address) as client:
            assert parked.wait(60)
            inserted["result"] = client.insert(NS, hashes, layers).result(timeout=60)

    with KVStoreClient(d.address) as kv:
        consumer, outcome = drop_select_parked(d.address, NS, hashes, timeout=60.0)
        producing = threading.Thread(target=producer, name="producer")
        producing.start()
        # the consumer's DropSelect is waiting on the daemon before anything is inserted
        wait_until_parked(kv)
        assert kv.lookup(NS, hashes) == 0
        parked.set()
        producing.join(60)
        consumer.join(60)
        assert not producing.is_alive() and not consumer.is_alive()

        assert inserted["result"].blocks_written == 4
        assert "error" not in outcome, outcome.get("error")
        assert_same(outcome["result"], layers)
        # consumed: gone from the store
        assert kv.lookup(NS, hashes) == 0
        assert kv.stats()["blocks"] == 0


def test_racing_drop_selects_take_a_prefix_exactly_once(kv: KVStoreClient, server) -> None:
    hashes = chain("race", 3)
    layers = make_layers(3, seed=22)
    kv.put(NS, hashes, layers)
    start = threading.Barrier(8)

    def take() -> dict[str, torch.Tensor] | None:
        with KVStoreClient(server.address) as client:
            start.wait(30)
            try:
                return client.drop_select(NS, hashes, timeout=0.5)
            except errors.StoreTimeout:
                return None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: take(), range(8)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    assert_same(winners[0], layers)
    assert kv.lookup(NS, hashes) == 0


def test_concurrent_puts_of_the_same_blocks_store_each_once(kv: KVStoreClient, server) -> None:
    hashes = chain("same-blocks", 6)
    layers = make_layers(6, seed=23)
    start = threading.Barrier(10)

    def put() -> PutResult:
        with KVStoreClient(server.address) as client:
            start.wait(30)
            return client.put(NS, hashes, layers)

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda _: put(), range(10)))
    assert sum(r.blocks_written for r in results) == 6
    assert all(r.blocks_written + r.blocks_skipped == 6 for r in results)
    assert sum(r.bytes_written for r in results) == 6 * block_bytes(layers)
    stats = kv.stats()
    assert (stats["blocks"], stats["bytes_used"]) == (6, 6 * block_bytes(layers))
    assert_same(kv.select(NS, hashes), layers)


def test_hundred_concurrent_clients(kv: KVStoreClient, server) -> None:
    blocks_each = 3
    start = threading.Barrier(NUM_CLIENTS)

    def work(i: int) -> tuple[list[bytes], dict[str, torch.Tensor]]:
        namespace = f"client-{i % 7}"
        hashes = chain(f"client-{i}", blocks_each, namespace=namespace)
        layers = make_layers(blocks_each, seed=1000 + i)
        with KVStoreClient(server.address, timeout=60) as client:
            start.wait(60)
            if i % 2:
                result = client.insert(namespace, hashes, layers).result(timeout=120)
            else:
                result = client.put(namespace, hashes, layers)
            assert result.blocks_written == blocks_each
            assert client.lookup(namespace, hashes) == blocks_each
            assert_same(client.select(namespace, hashes), layers)
            assert client.lookup(namespace, chain(f"client-{i}-absent", 1, namespace=namespace)) == 0
        return hashes, layers

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        futures = [pool.submit(work, i) for i in range(NUM_CLIENTS)]
        outcomes = [f.result(timeout=180) for f in futures]  # re-raises any client's failure

    stats = kv.stats()
    size = block_bytes(outcomes[0][1])
    assert stats["blocks"] == NUM_CLIENTS * blocks_each
    assert stats["bytes_used"] == NUM_CLIENTS * blocks_each * size
    assert stats["namespaces"] == 7
    assert stats["puts"] == NUM_CLIENTS
    assert kv.health() == "SERVING"
    # nothing was mixed up between clients: every chain reads back as its owner wrote it
    for i, (hashes, layers) in enumerate(outcomes):
        assert_same(kv.select(f"client-{i % 7}", hashes), layers)


def test_overload_is_refused_cleanly(make_server) -> None:
    """With a tiny in-flight budget, concurrent puts either succeed or get CapacityExceeded."""
    d = make_server(max_inflight_put_bytes="2KiB")
    layers = make_layers(8, seed=24)  # 8 * 256 bytes = the whole budget per put
    start = threading.Barrier(20)

    def put(i: int) -> tuple[list[bytes], PutResult | None]:
        hashes = chain(f"overload-{i}", 8)
        with KVStoreClient(d.address) as client:
            start.wait(30)
            try:
                return hashes, client.put(NS, hashes, layers)
            except errors.CapacityExceeded:
                return hashes, None

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(put, range(20)))
    with KVStoreClient(d.address) as kv:
        stored = 0
        for hashes, result in results:
            if result is None:
                assert kv.lookup(NS, hashes) == 0  # refused: nothing of it stored
            else:
                stored += 1
                assert_same(kv.select(NS, hashes), layers)
        assert stored >= 1
        assert kv.stats()["blocks"] == 8 * stored
        assert kv.health() == "SERVING"
        # the budget is released again: a put after the storm succeeds
        assert kv.put(NS, chain("after-storm", 8), layers).blocks_written == 8

"""kvstore_server.store.Store over real backends in tmp_path (no mocks)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from kvunit import (
    BLOCK_BYTES,
    LAYERS,
    NS,
    NS2,
    backend_file_with,
    block_data,
    chain,
    flip_byte_in_file,
    h,
    layer_bytes,
    make_write,
    new_backend,
)

from kvstore_server import eviction
from kvstore_server.errors import CapacityError, InvalidChain, NotFoundError, ShuttingDown, WaitTimeout
from kvstore_server.store import Store
from kvstore_server.tiers import LayerSpec, StorageFullError
from kvstore_server.tiers import lmdb as lmdb_backend

MakeStore = Callable[..., Store]


@pytest.fixture
def make_store(backend_kind: str, tmp_path: Path) -> Iterator[MakeStore]:
    """Open a Store on the backend under tmp_path; reopening gives the same data."""
    opened: list[Store] = []

    def make(capacity: int = 100 * BLOCK_BYTES) -> Store:
        store = Store(new_backend(backend_kind, tmp_path, capacity_bytes=capacity), capacity)
        opened.append(store)
        return store

    yield make
    for store in opened:
        if not store._closed:
            store.close()


@pytest.fixture
def store(make_store: MakeStore) -> Store:
    return make_store()


def put(store: Store, hashes: Sequence[bytes], parent: bytes = b"", ns: bytes = NS):
    return store.put(ns, parent, hashes, LAYERS, block_data(hashes))


def read(store: Store, hashes: Sequence[bytes], ns: bytes = NS) -> list[list[bytes]]:
    with store.read(ns, hashes) as result:
        assert result.layers == (LAYERS if result.blocks else ())
        return [[bytes(v) for v in block.layers] for block in result.blocks]


def expected(hashes: Sequence[bytes]) -> list[list[bytes]]:
    return [[layer_bytes(x, layer) for layer in LAYERS] for x in hashes]


def in_backend(store: Store, hashes: Sequence[bytes], ns: bytes = NS) -> list[bool]:
    with store.backend.read([(ns, x) for x in hashes]) as blocks:
        return [b is not None for b in blocks]


def reopen(store: Store, make_store: MakeStore, capacity: int | None = None) -> Store:
    store.close()
    return make_store(capacity if capacity is not None else store.capacity_bytes)


# ---- put / lookup / read -------------------------------------------------------------
def test_put_lookup_read(store: Store) -> None:
    a = chain("a", 3)
    result = put(store, a)
    assert (result.blocks_written, result.blocks_skipped, result.bytes_written, result.blocks_evicted) == (
        3,
        0,
        3 * BLOCK_BYTES,
        0,
    )
    assert store.lookup(NS, a) == 3
    assert store.lookup(NS, a + [h("x")]) == 3
    assert store.lookup(NS, [h("x")] + a) == 0
    assert store.lookup(NS2, a) == 0
    assert read(store, a) == expected(a)
    assert read(store, a[:2] + [h("x")]) == expected(a[:2])
    assert read(store, [h("x")]) == []
    stats = store.stats()
    assert stats["blocks"] == 3
    assert stats["bytes_used"] == 3 * BLOCK_BYTES
    assert stats["namespaces"] == 1
    assert stats["backend"] == store.backend.name
    assert (stats["lookups"], stats["hit_blocks"], stats["miss_blocks"]) == (4, 6, 8)
    assert (stats["puts"], stats["blocks_written"], stats["bytes_written"]) == (1, 3, 3 * BLOCK_BYTES)
    assert stats["bytes_read"] == 5 * BLOCK_BYTES


def test_put_skips_existing_blocks(store: Store) -> None:
    a = chain("a", 3)
    put(store, a[:2])
    other_bytes = [[memoryview(b"\x00" * layer.nbytes) for _ in a] for layer in LAYERS]
    result = store.put(NS, b"", a, LAYERS, other_bytes)
    assert (result.blocks_written, result.blocks_skipped, result.bytes_written) == (1, 2, BLOCK_BYTES)
    got = read(store, a)
    assert got[:2] == expected(a[:2]), "stored blocks are not rewritten"
    assert got[2] == [b"\x00" * layer.nbytes for layer in LAYERS]
    assert store.stats()["bytes_used"] == 3 * BLOCK_BYTES
    again = put(store, a)
    assert (again.blocks_written, again.blocks_skipped, again.bytes_written) == (0, 3, 0)


def test_put_links_parent(store: Store) -> None:
    a = chain("a", 4)
    put(store, a[:2])
    put(store, a[2:], parent=a[1])
    assert store.lookup(NS, a) == 4
    info, meta = store.describe(NS, a[2])
    assert info.entry.parent == a[1]
    assert meta.parent_hash == a[1]
    assert meta.layers == LAYERS
    assert store.describe(NS, a[1])[0].num_children == 1
    assert store.describe(NS, a[0])[0].entry.parent == b""


def test_namespaces_are_separate(store: Store) -> None:
    a = chain("a", 2)
    put(store, a, ns=NS)
    assert store.lookup(NS2, a) == 0
    put(store, a, ns=NS2)
    assert store.stats()["namespaces"] == 2
    assert store.evict(lambda index: eviction.namespace(index, NS)) == (2, 2 * BLOCK_BYTES)
    assert store.lookup(NS, a) == 0
    assert store.lookup(NS2, a) == 2
    assert in_backend(store, a, NS) == [False, False]


# ---- capacity ----------------------------------------------------------------------------
def test_put_larger_than_capacity_is_refused(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    with pytest.raises(CapacityError, match="exceeds the store's capacity"):
        put(store, chain("a", 5))
    assert store.stats()["blocks"] == 0
    assert list(store.backend.scan()) == []
    result = put(store, chain("b", 4))  # exactly the capacity fits
    assert result.blocks_written == 4


def test_put_evicts_tails_to_make_room(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    a, b = chain("a", 3), chain("b", 2)
    put(store, a)
    result = put(store, b)
    assert result.blocks_evicted == 1
    assert store.lookup(NS, a) == 2
    assert store.lookup(NS, b) == 2
    assert in_backend(store, a) == [True, True, False]
    stats = store.stats()
    assert stats["bytes_used"] == 4 * BLOCK_BYTES <= stats["capacity_bytes"]
    assert stats["evictions"] == 1


def test_put_evicts_least_recently_used_chain(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    a, b, c = chain("a", 2), chain("b", 2), chain("c", 2)
    put(store, a)
    put(store, b)
    assert store.lookup(NS, a) == 2  # a is now more recent than b
    assert put(store, c).blocks_evicted == 2
    assert store.lookup(NS, b) == 0
    assert store.lookup(NS, a) == 2
    assert store.lookup(NS, c) == 2


def test_put_does_not_evict_the_chain_it_extends(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    a = chain("a", 5)
    put(store, a[:4])
    with pytest.raises(CapacityError, match="not enough evictable"):
        put(store, a[4:], parent=a[3])
    assert store.lookup(NS, a) == 4
    assert in_backend(store, a[:4]) == [True] * 4


def test_put_of_partly_stored_chain_keeps_the_stored_part(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    a, old = chain("a", 3), chain("old", 2)
    put(store, a[:2])
    put(store, old)
    store.lookup(NS, old)  # a[1] is the LRU tail, but it belongs to the incoming chain
    result = put(store, a)
    assert (result.blocks_written, result.blocks_skipped, result.blocks_evicted) == (1, 2, 1)
    assert store.lookup(NS, a) == 3
    assert store.lookup(NS, old) == 1


def test_closed_store_refuses_puts(store: Store) -> None:
    store.close()
    with pytest.raises(ShuttingDown):
        put(store, chain("a", 1))


# ---- the StorageFullError path (LMDB map full below the byte budget) --------------------
BIG = (LayerSpec("k", "uint8", (16384,), 16384),)


@pytest.fixture
def tiny_lmdb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], lmdb_backend.LmdbBackend]]:
    def make() -> lmdb_backend.LmdbBackend:
        return lmdb_backend.LmdbBackend(tmp_path / "lmdb", capacity_bytes=8 * 16384, sync=False)

    yield make


def test_full_capacity_puts_keep_succeeding_on_a_tight_lmdb_map(tiny_lmdb) -> None:
    capacity = 8 * 16384  # the segments hold exactly this
    store = Store(tiny_lmdb(), capacity)
    try:
        for round_ in range(5):
            hashes = chain(f"r{round_}-", 8)
            result = store.put(NS, b"", hashes, BIG, block_data(hashes, BIG))
            assert result.blocks_written == 8
            assert store.lookup(NS, hashes) == 8
            assert sorted(m.block_hash for m in store.backend.scan()) == sorted(hashes)
    finally:
        store.close()


def test_extra_eviction_on_a_full_backend_spares_the_chain_being_extended(tiny_lmdb) -> None:
    backend = tiny_lmdb()
    parent = h("parent")
    backend.write([make_write(NS, parent, layers=BIG, created_at=1.0)])  # the oldest block
    fillers: list[bytes] = []
    with pytest.raises(StorageFullError):
        for i, x in enumerate(chain("fill", 100)):
            backend.write([make_write(NS, x, layers=BIG, created_at=100.0 + i)])
            fillers.append(x)
    store = Store(backend, 1 << 30)  # the byte budget is far away: only the map is full
    try:
        child = h("child")
        result = store.put(NS, parent, [child], BIG, block_data([child], BIG))
        assert result.blocks_written == 1
        assert result.blocks_evicted >= 1
        assert store.lookup(NS, [parent, child]) == 2
        assert store.stats()["evictions"] == result.blocks_evicted
        # the index and the backend agree
        assert sorted(m.block_hash for m in store.backend.scan()) == sorted(k[1] for k in store._index.keys())
    finally:
        store.close()


def fill_map(backend: lmdb_backend.LmdbBackend, tag: str, *, chained: bool = False) -> list[bytes]:
    """Write 16 KiB blocks until the map is full; their hashes (a chain with `chained`)."""
    written: list[bytes] = []
    with pytest.raises(StorageFullError):
        for i, x in enumerate(chain(tag, 100)):
            parent = written[-1] if chained and written else b""
            backend.write([make_write(NS, x, parent=parent, layers=BIG, created_at=100.0 + i)])
            written.append(x)
    return written


def test_when_eviction_does_not_make_room_a_burst_of_full_puts_evicts_once(tiny_lmdb) -> None:
    """A read that holds freed extents (a promotion's) means they are not reused: the
    first put evicts for its bytes (the budget), then, the segments still full, one
    put's worth and a block more, finds it did not help, and every later full put fails
    at once without evicting."""
    backend = tiny_lmdb()
    fill_map(backend, "fill")
    store = Store(backend, 1 << 30)  # the budget: what the segments hold (payload_capacity)
    assert store.capacity_bytes == backend.payload_capacity
    pin = backend.locate([])  # a read in progress: what is freed now waits for it
    pin.__enter__()
    try:
        before = store.stats()["blocks"]
        x = h("new-0")
        with pytest.raises(CapacityError, match="no room"):
            store.put(NS, b"", [x], BIG, block_data([x], BIG))
        first = before - store.stats()["blocks"]
        assert first == 3  # the put's 16 KiB for the budget, then its 16 KiB and one block more
        for i in range(1, 17):
            x = h(f"new-{i}")
            with pytest.raises(CapacityError, match="no room"):
                store.put(NS, b"", [x], BIG, block_data([x], BIG))
        assert before - store.stats()["blocks"] == first  # later full puts evict nothing
        assert store.stats()["evictions"] == first
    finally:
        pin.__exit__(None, None, None)
    x = h("after")
    assert store.put(NS, b"", [x], BIG, block_data([x], BIG)).blocks_written == 1
    assert sorted(m.block_hash for m in store.backend.scan()) == sorted(k[1] for k in store._index.keys())
    store.close()


def test_a_full_backend_evicts_nothing_when_nothing_evictable_would_make_room(tiny_lmdb) -> None:
    backend = tiny_lmdb()
    stored = fill_map(backend, "one-chain", chained=True)
    store = Store(backend, 1 << 30)
    try:
        child = h("child")  # extends the chain: every stored block is its ancestor
        with pytest.raises(CapacityError, match="not enough evictable|would not free"):
            store.put(NS, stored[-1], [child], BIG, block_data([child], BIG))
        assert store.stats()["evictions"] == 0
        assert store.lookup(NS, stored) == len(stored)
    finally:
        store.close()


# ---- read integrity -----------------------------------------------------------------------
def test_corrupt_block_ends_the_prefix(store: Store, backend_kind: str, tmp_path: Path) -> None:
    a = chain("a", 4)
    put(store, a)
    flip_byte_in_file(backend_file_with(backend_kind, tmp_path, NS, a[2]), layer_bytes(a[2], LAYERS[0]))
    assert read(store, a) == expected(a[:2])
    stats = store.stats()
    assert stats["checksum_failures"] == 1
    assert stats["bytes_read"] == 2 * BLOCK_BYTES
    # the bad block is gone from the index and the backend; the rest of the chain is cut off
    assert store.lookup(NS, a) == 2
    assert in_backend(store, a) == [True, True, False, True]
    assert read(store, a) == expected(a[:2])
    assert store.stats()["checksum_failures"] == 1


def test_corrupt_block_is_gone_after_restart(
    store: Store, make_store: MakeStore, backend_kind, tmp_path
) -> None:
    a = chain("a", 3)
    put(store, a)
    flip_byte_in_file(backend_file_with(backend_kind, tmp_path, NS, a[1]), layer_bytes(a[1], LAYERS[0]))
    assert read(store, a) == expected(a[:1])
    store = reopen(store, make_store)
    assert store.lookup(NS, a) == 1
    assert store.stats()["blocks"] == 2  # a[2] is still stored, unreachable, first to be evicted
    assert eviction.down_to(store._index, store._index.bytes_used - 1) == [(NS, a[2])]


def test_corrupt_block_in_take(store: Store, backend_kind: str, tmp_path: Path) -> None:
    a = chain("a", 3)
    put(store, a)
    flip_byte_in_file(backend_file_with(backend_kind, tmp_path, NS, a[1]), layer_bytes(a[1], LAYERS[1]))
    with store.take(NS, a, 0.0, lambda: True) as result:
        assert [[bytes(v) for v in b.layers] for b in result.blocks] == expected(a[:1])
    assert store.stats()["checksum_failures"] == 1
    assert store.lookup(NS, a) == 0
    assert in_backend(store, a) == [False, False, False]


# ---- take (DropSelect) ------------------------------------------------------------------------
def test_take_returns_and_removes(store: Store) -> None:
    a = chain("a", 3)
    put(store, a)
    with store.take(NS, a[:2], 5.0, lambda: True) as result:
        assert result.num_blocks == 2
        assert result.layers == LAYERS
        assert [[bytes(v) for v in b.layers] for b in result.blocks] == expected(a[:2])
    assert store.lookup(NS, a) == 0
    assert in_backend(store, a) == [False, False, True]
    assert store.stats()["bytes_read"] == 2 * BLOCK_BYTES


def test_take_waits_for_a_put_from_another_thread(store: Store) -> None:
    a = chain("a", 3)
    woke_incomplete = threading.Event()
    results: queue.Queue = queue.Queue()

    def is_active() -> bool:
        # called each time the waiter wakes up and still lacks part of the prefix
        woke_incomplete.set()
        return True

    def taker() -> None:
        try:
            with store.take(NS, a, 30.0, is_active) as result:
                results.put([[bytes(v) for v in b.layers] for b in result.blocks])
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results.put(exc)

    thread = threading.Thread(target=taker)
    thread.start()
    put(store, a[:2])  # a partial prefix does not release the waiter
    assert woke_incomplete.wait(10)
    assert results.empty()
    put(store, a[2:], parent=a[1])
    got = results.get(timeout=10)
    thread.join(10)
    assert got == expected(a)
    assert store.lookup(NS, a) == 0


def test_two_takes_of_one_prefix_one_wins(store: Store) -> None:
    a = chain("a", 2)
    results: queue.Queue = queue.Queue()
    barrier = threading.Barrier(3)

    def taker() -> None:
        barrier.wait()
        try:
            with store.take(NS, a, 30.0, lambda: True) as result:
                results.put(result.num_blocks)
        except BaseException as exc:  # noqa: BLE001
            results.put(exc)

    threads = [threading.Thread(target=taker) for _ in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    put(store, a)
    assert results.get(timeout=10) == 2
    store.begin_shutdown()  # release the loser, which would otherwise wait its 30 s
    assert isinstance(results.get(timeout=10), ShuttingDown)
    for t in threads:
        t.join(10)
    assert store.lookup(NS, a) == 0


def test_take_times_out_and_removes_nothing(store: Store) -> None:
    a = chain("a", 3)
    put(store, a[:2])
    with pytest.raises(WaitTimeout, match="not stored within"):
        with store.take(NS, a, 0.0, lambda: True):
            pytest.fail("take must not yield")
    with pytest.raises(WaitTimeout):
        with store.take(NS, a, 0.05, lambda: True):
            pytest.fail("take must not yield")
    assert store.lookup(NS, a) == 2
    assert in_backend(store, a[:2]) == [True, True]


def test_take_gives_up_when_caller_went_away(store: Store) -> None:
    with pytest.raises(WaitTimeout, match="caller went away"):
        with store.take(NS, chain("a", 1), 0.2, lambda: False):
            pytest.fail("take must not yield")


def test_begin_shutdown_releases_waiters(store: Store) -> None:
    waiting = threading.Event()
    results: queue.Queue = queue.Queue()

    def taker() -> None:
        def is_active() -> bool:
            waiting.set()
            return True

        try:
            with store.take(NS, chain("a", 1), 30.0, is_active):
                results.put("took")
        except BaseException as exc:  # noqa: BLE001
            results.put(exc)

    thread = threading.Thread(target=taker)
    thread.start()
    put(store, [h("unrelated")])  # wakes the waiter without satisfying it
    assert waiting.wait(10)
    store.begin_shutdown()
    assert isinstance(results.get(timeout=10), ShuttingDown)
    thread.join(10)
    with pytest.raises(ShuttingDown):
        with store.take(NS, [h("unrelated")], 1.0, lambda: True):
            pytest.fail("take must not yield")
    assert store.lookup(NS, [h("unrelated")]) == 1, "everything else keeps working"


# ---- restart -----------------------------------------------------------------------------
def test_restart_rebuilds_the_index(store: Store, make_store: MakeStore) -> None:
    a, b = chain("a", 4), chain("b", 2)
    put(store, a[:2])
    put(store, a[2:], parent=a[1])
    put(store, b, ns=NS2)
    before = {
        (k.namespace, k.block_hash): (k.entry.parent, k.entry.size, k.num_children)
        for k in store.list_blocks(None, 100, None)[0]
    }
    created = store.describe(NS, a[0])[0].entry.created_at
    store = reopen(store, make_store)
    assert store.lookup(NS, a) == 4
    assert store.lookup(NS2, b) == 2
    stats = store.stats()
    assert (stats["blocks"], stats["bytes_used"], stats["namespaces"]) == (6, 6 * BLOCK_BYTES, 2)
    after = {
        (k.namespace, k.block_hash): (k.entry.parent, k.entry.size, k.num_children)
        for k in store.list_blocks(None, 100, None)[0]
    }
    assert after == before
    assert store.describe(NS, a[0])[0].entry.created_at == created
    assert read(store, a) == expected(a)
    # the rebuilt links drive eviction: chain tails first
    assert store.evict(lambda index: eviction.down_to(index, 5 * BLOCK_BYTES))[0] == 1
    assert store.lookup(NS, a) + store.lookup(NS2, b) == 5


def test_restart_with_smaller_capacity_trims_tails(store: Store, make_store: MakeStore) -> None:
    a, b = chain("a", 4), chain("b", 4)
    put(store, a)
    put(store, b)
    store = reopen(store, make_store, capacity=5 * BLOCK_BYTES)
    stats = store.stats()
    assert stats["bytes_used"] <= 5 * BLOCK_BYTES
    assert stats["blocks"] == 5
    assert store.lookup(NS, a) + store.lookup(NS, b) == 5
    assert len(list(store.backend.scan())) == 5


# ---- operators ----------------------------------------------------------------------------
def test_evict_subtree_and_older_than(store: Store) -> None:
    a = chain("a", 4)
    put(store, a)
    assert store.evict(lambda index: eviction.subtree(index, NS, a[2])) == (2, 2 * BLOCK_BYTES)
    assert store.lookup(NS, a) == 2
    assert in_backend(store, a) == [True, True, False, False]
    assert store.evict(lambda index: eviction.older_than(index, 0.0)) == (0, 0)
    assert store.evict(lambda index: eviction.older_than(index, float("inf"))) == (2, 2 * BLOCK_BYTES)
    assert store.stats()["evictions"] == 4
    assert store.stats()["bytes_used"] == 0


def test_describe_unknown_block(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.describe(NS, h("nope"))


def test_describe_returns_checksums(store: Store) -> None:
    from kvstore_server.tiers import checksum

    put(store, [h(1)])
    info, meta = store.describe(NS, h(1))
    assert info.block_hash == h(1) and info.namespace == NS
    assert info.entry.size == BLOCK_BYTES
    assert meta.checksums == tuple(checksum(layer_bytes(h(1), layer)) for layer in LAYERS)


def test_list_blocks_pages_in_key_order(store: Store) -> None:
    put(store, chain("a", 5))
    put(store, chain("b", 3), ns=NS2)
    everything = sorted([(NS, x) for x in chain("a", 5)] + [(NS2, x) for x in chain("b", 3)])
    seen = []
    after = None
    while True:
        page, after = store.list_blocks(None, 3, after)
        seen.extend((i.namespace, i.block_hash) for i in page)
        if after is None:
            break
        assert after == seen[-1]
    assert seen == everything
    assert [i.block_hash for i in store.list_blocks(NS2, 10, None)[0]] == sorted(chain("b", 3))


def test_a_page_short_of_a_removed_block_still_pages_on(store: Store, monkeypatch) -> None:
    put(store, chain("a", 6))
    everything = sorted(chain("a", 6))
    # a block removed between the copy of the hashes (under the lock) and the reading
    # of the page's entries: the page comes back short, and paging still goes on
    gone = b"\x00" * 32
    copy = store._index.hashes  # noqa: SLF001
    monkeypatch.setattr(store._index, "hashes", lambda ns: [gone, *copy(ns)])  # noqa: SLF001
    page, after = store.list_blocks(NS, 3, None)
    assert [i.block_hash for i in page] == everything[:2]
    assert after == (NS, everything[1])
    seen = [i.block_hash for i in page]
    while after is not None:
        page, after = store.list_blocks(NS, 3, after)
        seen.extend(i.block_hash for i in page)
    assert seen == everything


# ---- concurrency and events ---------------------------------------------------------------
def test_concurrent_overlapping_puts_stay_consistent(store: Store) -> None:
    shared = chain("shared", 4)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            own = chain(f"own{t}-", 3)
            barrier.wait()
            for _ in range(3):
                put(store, shared)
                put(store, own, parent=shared[-1])
                assert store.lookup(NS, shared + own) == 7
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = store.stats()
    assert stats["blocks"] == 4 + 4 * 3
    assert stats["blocks_written"] == 16
    assert len(list(store.backend.scan())) == 16
    assert store.describe(NS, shared[-1])[0].num_children == 4


def test_listener_events_in_commit_order(make_store: MakeStore) -> None:
    store = make_store(capacity=4 * BLOCK_BYTES)
    events: list[tuple[str, bytes, list[bytes], list[bytes]]] = []
    tiers: list[str | None] = []

    def listener(kind, ns, hashes, parents, tokens, tier) -> None:
        events.append((kind, ns, list(hashes), list(parents)))
        tiers.append(tier)

    store.add_listener(listener)
    a, b = chain("a", 3), chain("b", 2)
    put(store, a)
    put(store, a)  # nothing new: no event
    put(store, b)  # evicts a[2] first, then stores b
    with store.take(NS, b, 0.0, lambda: True):
        pass
    put(store, [h("x")], ns=NS2)
    store.evict(lambda index: eviction.namespace(index, None))
    assert events[:4] == [
        ("stored", NS, a, [b"", a[0], a[1]]),
        ("removed", NS, [a[2]], []),
        ("stored", NS, b, [b"", b[0]]),
        ("removed", NS, b, []),
    ]
    assert events[4] == ("stored", NS2, [h("x")], [b""])
    # evicting everything reports each namespace once
    final = sorted((e[1], sorted(e[2])) for e in events[5:])
    assert [e[0] for e in events[5:]] == ["removed", "removed"]
    assert final == sorted([(NS, sorted(a[:2])), (NS2, [h("x")])])
    # puts land in the persistent tier; a removal is from every tier
    assert [t for e, t in zip(events, tiers, strict=True) if e[0] == "stored"] == ["persistent"] * 3
    assert {t for e, t in zip(events, tiers, strict=True) if e[0] == "removed"} == {None}


def test_parent_claims_that_would_form_a_cycle_are_refused(store: Store) -> None:
    # parents are client-supplied; a confused client could link two blocks both ways
    a, b = h("a"), h("b")
    put(store, [b], parent=a)
    with pytest.raises(InvalidChain):
        put(store, [a], parent=b)
    assert store.lookup(NS, [a]) == 0
    assert store.stats()["blocks"] == 1
    # a longer loop through stored ancestors is refused too
    c, d = h("c"), h("d")
    put(store, [c], parent=b)
    put(store, [d], parent=c)
    with pytest.raises(InvalidChain):
        put(store, [a, h("e")], parent=d)
    assert store.stats()["blocks"] == 3


def test_block_with_another_layer_layout_ends_the_prefix(store: Store) -> None:
    a = chain("a", 3)
    put(store, a[:1])
    other = (LayerSpec("k", "uint8", (384,), 384),)  # same size, other layout
    store.put(NS, a[0], a[1:2], other, block_data(a[1:2], other))
    put(store, a[2:], parent=a[1])
    assert store.lookup(NS, a) == 3
    assert read(store, a) == expected(a[:1])
    assert store.stats()["checksum_failures"] == 0

"""Write-behind with batches in flight at once: kvstore_server.tiers.chain.TierChain.
write_behind_once over a real memory tier and a real LMDB persistent tier."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvunit import BLOCK_BYTES, LAYERS, NS, chain, layer_bytes, new_backend

from kvstore.blocks import checksum
from kvstore_server import eviction
from kvstore_server.store import Store
from kvstore_server.tiers.arena import open_memory_tier
from kvstore_server.tiers.segments import aligned


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def make(persist: str = "every") -> Store:
        memory = open_memory_tier(tmp_path / "shm", tmp_path / "arena", 64 << 20, "run", lease_seconds=30.0,
                                  write_behind_bytes=32 << 20, persist=persist)  # fmt: skip
        store = Store(new_backend("lmdb", tmp_path, capacity_bytes=64 << 20), 64 << 20, memory=memory)
        store._writer.close()  # these tests drive write_behind_once themselves
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    return make_store()


def save(store: Store, hashes: list[bytes]) -> None:
    """Reserve, write and commit `hashes` through the memory tier, as a same-host client does."""
    res = store.reserve(b"", NS, b"", hashes, LAYERS)
    store.memory.fill(res, lambda i, k: layer_bytes(hashes[i], LAYERS[k]))
    sums = [checksum(layer_bytes(x, layer)) for x in hashes for layer in LAYERS]
    store.commit(b"", res.id, sums)


def test_a_second_batch_takes_other_blocks_while_the_first_is_being_written(store: Store) -> None:
    first, second, third = chain("one", 4), chain("two", 4), chain("three", 4)
    for hashes in (first, second, third):
        save(store, hashes)
    backend = store.tiers.persistent
    real_write, written, inside, go_on = backend.write, [], threading.Event(), threading.Event()

    def write(puts, deletes=()):
        written.append({put.meta.key[1] for put in puts})
        if len(written) == 1:  # the first batch waits, mid-write, for the second to finish
            inside.set()
            go_on.wait(30)
        real_write(puts, deletes)

    backend.write = write
    batch = 4 * BLOCK_BYTES
    slow = threading.Thread(target=store.tiers.write_behind_once, args=(batch,))
    slow.start()
    assert inside.wait(30)
    assert store.tiers.write_behind_once(batch)  # not blocked by the batch in flight
    go_on.set()
    slow.join(30)
    assert written[:2] == [set(first), set(second)]  # the oldest first; none written twice
    assert store.tiers.write_behind_once(batch) and written[2] == set(third)
    assert not store.tiers.write_behind_once(batch)
    assert store.memory.stats()["write_behind_blocks"] == 0
    with backend.read([(NS, x) for x in first + second + third]) as blocks:
        for x, block in zip(first + second + third, blocks, strict=True):
            assert block is not None
            assert [bytes(v) for v in block.layers] == [layer_bytes(x, layer) for layer in LAYERS]


def in_backend(store: Store, hashes: list[bytes]) -> list[bool]:
    with store.tiers.persistent.read([(NS, x) for x in hashes]) as blocks:
        return [block is not None for block in blocks]


def test_persist_reused_writes_behind_only_blocks_loaded_again(make_store: Callable[..., Store]) -> None:
    store = make_store("reused")
    read_once, pinned_once, never = chain("read", 3), chain("pinned", 3), chain("never", 3)
    for hashes in (read_once, pinned_once, never):
        save(store, hashes)
    assert not store.tiers.write_behind_once(1 << 30)  # nothing queued: none was used again
    assert store.stats()["unused_blocks"] == 9
    with store.read(NS, read_once) as result:  # a Get / Select hit
        assert result.num_blocks == 3
    pin = store.pin(b"", NS, pinned_once[:2])  # a same-host load of the first two
    store.release(b"", pin.pin_id)
    while store.tiers.write_behind_once(1 << 30):
        pass
    assert in_backend(store, read_once) == [True] * 3
    assert in_backend(store, pinned_once) == [True, True, False]
    assert in_backend(store, never) == [False] * 3
    stats = store.stats()
    assert (stats["unused_blocks"], stats["persisted_on_reuse"], stats["written_behind"]) == (4, 5, 5)


def test_persist_every_writes_behind_every_committed_block(store: Store) -> None:
    hashes = chain("every", 3)
    save(store, hashes)
    while store.tiers.write_behind_once(1 << 30):
        pass
    assert in_backend(store, hashes) == [True] * 3
    assert store.stats()["unused_blocks"] == 0


def test_a_commit_wakes_write_behind_once_its_answer_is_out_when_the_call_can(store: Store) -> None:
    """Commit hands write-behind's wake to the call (its context's add_callback: run once
    the answer is sent), so the writer threads do not take the GIL from the answer; a call
    that cannot take it (over already: add_callback says False) wakes it at once."""
    woken: list[str] = []
    store._writer.wake = lambda: woken.append("wake")  # type: ignore[method-assign]
    callbacks: list[Callable[[], None]] = []

    def commit(hashes: list[bytes], call_takes_it: bool) -> None:
        def add_callback(callback: Callable[[], None]) -> bool:
            if call_takes_it:
                callbacks.append(callback)
            return call_takes_it

        res = store.reserve(b"", NS, b"", hashes, LAYERS)
        store.memory.fill(res, lambda i, k: layer_bytes(hashes[i], LAYERS[k]))
        sums = [checksum(layer_bytes(x, layer)) for x in hashes for layer in LAYERS]
        store.commit(b"", res.id, sums, after_answer=add_callback)

    commit(chain("after", 2), call_takes_it=True)
    assert woken == [] and len(callbacks) == 1
    callbacks.pop()()  # the answer is out
    assert woken == ["wake"]
    commit(chain("at-once", 2), call_takes_it=False)
    assert woken == ["wake", "wake"] and not callbacks


def test_blocks_wait_for_room_that_reads_hold_and_are_written_when_they_end(tmp_path: Path) -> None:
    """A tier kept at its budget: blocks deleted while a read sees them free their room only
    when the read ends. Write-behind meanwhile keeps the blocks that need that room queued
    (not dropped to memory only) and writes them once the read is over."""
    backend = new_backend("lmdb", tmp_path, capacity_bytes=4096)
    room = backend.payload_capacity // aligned(BLOCK_BYTES)
    assert room >= 2
    memory = open_memory_tier(tmp_path / "shm", tmp_path / "arena", 64 << 20, "run", lease_seconds=30.0,
                              write_behind_bytes=32 << 20)  # fmt: skip
    store = Store(backend, 4096, memory=memory)
    store._writer.close()  # this test drives write_behind_once itself
    try:
        first, second = chain("first", room), chain("second", 2)
        save(store, first)
        while store.tiers.write_behind_once(1 << 30):
            pass
        assert in_backend(store, first) == [True] * room
        with backend.locate([(NS, x) for x in first]):  # a read that sees the first chain's extents
            store.evict(functools.partial(eviction.subtree, namespace=NS, block_hash=first[0]))
            save(store, second)  # the store's budget has room again; the tier's room waits for the read
            assert not store.tiers.write_behind_once(1 << 30)  # nothing written, nothing dropped
            stats = store.stats()
            assert (stats["write_behind_blocks"], stats["write_behind_dropped"]) == (2, 0)
        assert store.tiers.write_behind_once(1 << 30)
        assert in_backend(store, second) == [True, True]
        stats = store.stats()
        assert (stats["write_behind_blocks"], stats["write_behind_dropped"]) == (0, 0)
    finally:
        store.close()

"""Write-behind with batches in flight at once: kvstore_server.tiers.chain.TierChain.
write_behind_once over a real memory tier and a real LMDB persistent tier."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvunit import BLOCK_BYTES, LAYERS, NS, chain, layer_bytes, new_backend

from kvstore.blocks import checksum
from kvstore_server.store import Store
from kvstore_server.tiers.arena import open_memory_tier


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    memory = open_memory_tier(tmp_path / "shm", tmp_path / "arena", 64 << 20, "run", lease_seconds=30.0,
                              write_behind_bytes=32 << 20)  # fmt: skip
    store = Store(new_backend("lmdb", tmp_path, capacity_bytes=64 << 20), 64 << 20, memory=memory)
    store._writer.close()  # this test drives write_behind_once itself
    yield store
    store.close()


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

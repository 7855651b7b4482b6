"""Promotions (kvstore_server.tiers.chain.Promotion) over a real memory tier and a real
LMDB persistent tier: blocks only the persistent tier holds, read into the arena."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvunit import BLOCK_BYTES, LAYERS, NS, backend_file_with, chain, layer_bytes, make_write, new_backend

from kvstore.blocks import STOP_EVICTED
from kvstore_server.store import Store
from kvstore_server.tiers.arena import open_memory_tier
from kvstore_server.tiers.chain import Ready
from kvstore_server.tiers.iopool import IOPool


@pytest.fixture
def cold(tmp_path: Path) -> Iterator[tuple[Store, list[bytes]]]:
    """A store whose 6 chained blocks only the persistent tier holds."""
    hashes = chain("cold", 6)
    backend = new_backend("lmdb", tmp_path)
    backend.write([make_write(NS, x, parent) for x, parent in zip(hashes, [b"", *hashes[:-1]], strict=True)])
    memory = open_memory_tier(tmp_path / "shm", tmp_path / "arena", 16 << 20, "run", lease_seconds=30.0,
                              write_behind_bytes=8 << 20)  # fmt: skip
    store = Store(backend, 64 << 20, memory=memory)
    try:
        yield store, hashes
    finally:
        store.close()


def test_two_promotions_of_the_same_blocks_at_once_place_them_once(cold: tuple[Store, list[bytes]]) -> None:
    """Two loads of one prompt that both find it cold read it twice, but the blocks become
    resident once: the second promotion's copies are let go, and the arena's accounts
    hold one copy."""
    store, hashes = cold
    keys = [(NS, x) for x in hashes]
    first = store.tiers.promote_start(keys[:4], time.time())
    second = store.tiers.promote_start(keys, time.time())  # the first is not placed yet
    assert first.promotion is not None and second.promotion is not None
    assert not second.joined  # blocks 4 and 5 are not being read: its own promotion reads all
    assert first.promotion.finish() is None and second.promotion.finish() is None
    memory = store.memory
    assert memory is not None
    with memory.lock:
        assert set(memory.resident) == set(keys)
        assert memory.resident_bytes == len(keys) * BLOCK_BYTES
        placed = {memory.resident[key].extent for key in keys}
        assert set(memory.extents) == placed  # the second promotion's extents were freed
        used = memory.allocator.total - memory.allocator.free_bytes
        assert used == sum(extent.nbytes for extent in memory.extents.values())
    with store.read(NS, hashes) as got:  # and they read back whole
        assert [bytes(view) for view in got.blocks[2].layers] == [layer_bytes(hashes[2], s) for s in LAYERS]


def test_loads_of_blocks_being_promoted_join_the_promotion_and_read_nothing_twice(
    cold: tuple[Store, list[bytes]],
) -> None:
    """Two TP ranks loading one cold prompt at once: the second load joins the first one's
    promotion (the blocks are read once, into one set of extents) and gets every block
    as it is read, without waiting for the first load to end; a plain Pin joins likewise."""
    store, hashes = cold
    memory = store.memory
    assert memory is not None
    owner = store.pin_stream(b"", NS, hashes)
    first = next(owner)
    assert not isinstance(first, (Ready, str)) and first.num_blocks == 6 and first.ready_layers == 0
    joiner = store.pin_stream(b"", NS, hashes)
    second = next(joiner)
    assert not isinstance(second, (Ready, str)) and second.num_blocks == 6
    assert [run.extent for run in second.runs] == [run.extent for run in first.runs]  # the same bytes
    reports = list(joiner)  # to the last read, while the owner has not even started reading its reports
    assert reports[-1] == Ready(len(LAYERS), 6)
    plain = store.pin(b"", NS, hashes)  # joins too, and waits for the reads only
    assert plain.num_blocks == 6 and [run.extent for run in plain.runs] == [run.extent for run in first.runs]
    with memory.lock:
        assert not any((NS, x) in memory.resident for x in hashes)  # the owner has not placed them
    assert list(owner)[-1] == Ready(len(LAYERS), 6)  # the owner's stream ends: placed
    stats = store.stats()
    assert (stats["promotions"], stats["promoted_blocks"]) == (1, 6)
    with memory.lock:
        assert set(memory.resident) == {(NS, x) for x in hashes}
        assert len(memory.extents) == 6 and memory.resident_bytes == 6 * BLOCK_BYTES
    for pin_id in (first.pin_id, second.pin_id, plain.pin_id):
        assert store.release(b"", pin_id)
    with memory.lock:
        assert not memory.pins and all(extent.pins == 0 for extent in memory.extents.values())
    with store.read(NS, hashes) as got:
        assert [bytes(view) for view in got.blocks[5].layers] == [layer_bytes(hashes[5], s) for s in LAYERS]
    assert store.tiers.promote_start([(NS, x) for x in hashes], time.time()).promotion is None  # all resident


def test_a_load_joined_to_a_promotion_whose_read_fails_stops_where_it_failed(
    cold: tuple[Store, list[bytes]], tmp_path: Path
) -> None:
    """The segment cut short after block 2: both loads of the joined promotion hear that
    the read failed (never a report of the blocks beyond); a plain Pin that joins pins
    only blocks read whole (none here: the failed read was one task of all six, so none
    counts as read); nothing stays pinned once all three are done."""
    store, hashes = cold
    os.truncate(backend_file_with("lmdb", tmp_path, NS, hashes[0]), 3 * BLOCK_BYTES)
    owner = store.pin_stream(b"", NS, hashes)
    first = next(owner)
    assert not isinstance(first, (Ready, str)) and first.num_blocks == 6
    joiner = store.pin_stream(b"", NS, hashes)
    second = next(joiner)
    assert not isinstance(second, (Ready, str)) and second.num_blocks == 6
    plain = store.pin(b"", NS, hashes)
    assert plain.num_blocks <= 3 and plain.stop == STOP_EVICTED  # blocks read whole only
    for stream in (joiner, owner):
        reports = list(stream)
        assert reports[-1] == STOP_EVICTED
        assert all(r.blocks <= 3 and r.layers < len(LAYERS) for r in reports if isinstance(r, Ready))
    assert store.stats()["promotions"] == 1
    for pin_id in (first.pin_id, second.pin_id, plain.pin_id):
        if pin_id:
            store.release(b"", pin_id)
    memory = store.memory
    assert memory is not None
    with memory.lock:
        assert not memory.pins and all(extent.pins == 0 for extent in memory.extents.values())
        assert set(memory.resident) <= {(NS, x) for x in hashes[:3]}


def test_a_streamed_pin_places_its_blocks_after_the_last_report_and_its_release_waits_for_that(
    cold: tuple[Store, list[bytes]], tmp_path: Path
) -> None:
    """The last report goes out before the blocks are placed (the client copies while the
    daemon places them); a Release reporting a corrupt block waits for the placement, so
    the block it names is verified where it now lies and removed."""
    store, hashes = cold
    needle = layer_bytes(hashes[3], LAYERS[0])[:64]
    path = backend_file_with("lmdb", tmp_path, NS, hashes[3])
    raw = path.read_bytes()
    at = raw.index(needle) + 10
    with open(path, "r+b") as f:  # a byte of block 3 flipped on disk
        f.seek(at)
        f.write(bytes([raw[at] ^ 0x01]))
    progress = store.pin_stream(b"", NS, hashes)
    pinned = next(progress)
    assert not isinstance(pinned, (Ready, str)) and pinned.num_blocks == 6 and pinned.ready_layers == 0
    last = None
    while not (isinstance(last, Ready) and last.layers == len(LAYERS)):
        last = next(progress)
    memory = store.memory
    assert memory is not None
    with memory.lock:
        assert not any((NS, x) in memory.resident for x in hashes)  # told, not placed yet
    released: list[bool] = []
    release = threading.Thread(target=lambda: released.append(store.release(b"", pinned.pin_id, [hashes[3]])))
    release.start()
    release.join(0.2)
    assert release.is_alive()  # waiting for the placement
    assert list(progress) == []  # the stream ends: the promotion places its blocks
    release.join(30)
    assert released == [True]
    assert store.stats()["checksum_failures"] == 1
    assert store.lookup(NS, hashes) == 3  # the corrupt block was removed where it was placed
    with memory.lock:
        assert {(NS, x) for x in hashes[:3]} <= set(memory.resident)


def test_a_streamed_pin_answers_before_its_reads_and_a_read_it_cannot_issue_ends_the_stream(
    cold: tuple[Store, list[bytes]],
) -> None:
    """The answer goes out before any read is issued (they are issued when the stream goes
    on): an I/O pool that refuses them then (closed) fails the load like a failed read,
    and nothing stays pinned or held."""
    store, hashes = cold
    backend = store.tiers.persistent
    progress = store.pin_stream(b"", NS, hashes)
    answer = next(progress)
    assert not isinstance(answer, (Ready, str)) and answer.num_blocks == 6 and answer.ready_layers == 0
    refusing = IOPool(1)
    refusing.close()
    working, backend.io = backend.io, refusing  # type: ignore[attr-defined]
    try:
        assert list(progress) == [STOP_EVICTED]
    finally:
        backend.io = working  # type: ignore[attr-defined]
    assert store.release(b"", answer.pin_id)
    memory = store.memory
    assert memory is not None
    with memory.lock:
        assert not memory.pins and not memory.resident and not memory.extents
    assert store.lookup(NS, hashes) == 6  # still stored below, and promoted by the next load
    again = store.pin(b"", NS, hashes)
    assert again.num_blocks == 6
    assert store.release(b"", again.pin_id)

"""The LMDB backend: LMDB as the index, payloads in segment files (tiers.segments).

Allocation and reuse, alignment, recovery of the index at start, the capacity bound,
atomic writes, and reads straight into caller's buffers. Real files in tmp_path.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest
from kvunit import LAYERS, NS, chain, h, layer_bytes, make_write

from kvstore import records
from kvstore.layouts import BLOCKS_DB, SEGMENTS_DIR
from kvstore_server.tiers import LayerSpec, StorageError, StorageFullError, open_backend
from kvstore_server.tiers.lmdb import LmdbBackend, index_reserve
from kvstore_server.tiers.segments import ALIGN, SMALL_ALIGN, Segments, aligned, segment_size_for

BIG = (LayerSpec("k", "uint8", (16384,), 16384),)  # 16 KiB: four pages
ODD = (LayerSpec("k", "uint8", (3000,), 3000),)  # not a multiple of a page


def extents(backend: LmdbBackend, keys: list[bytes]) -> list[tuple[int, int, int]]:
    with backend.locate([(NS, k) for k in keys]) as found:
        return [r.where if r is not None else (-1, -1, -1) for r in found]


def test_open_backend_places_index_and_segments_under_lmdb(tmp_path: Path) -> None:
    backend = open_backend("lmdb", tmp_path, capacity_bytes=64 << 20, sync=True)
    try:
        backend.write([make_write(NS, h(1))])
        assert (tmp_path / "lmdb" / "data.mdb").is_file()
        segments = sorted(os.listdir(tmp_path / "lmdb" / SEGMENTS_DIR))
        assert segments == ["seg-00000000"]
    finally:
        backend.close()


def test_extents_are_aligned_and_hold_exactly_the_payload(tmp_path: Path) -> None:
    """Whole-page payloads start on a page (direct I/O can move them); others on 64 bytes."""
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        keys = chain("a", 6)
        shapes = [ODD if i % 2 == 0 else BIG for i in range(6)]
        backend.write([make_write(NS, k, layers=layers) for k, layers in zip(keys, shapes, strict=True)])
        where = extents(backend, keys)
        spans = []
        for (offset, _, nbytes), layers in zip(where, shapes, strict=True):
            assert nbytes == layers[0].nbytes
            assert offset % (ALIGN if layers is BIG else SMALL_ALIGN) == 0
            spans.append((offset, offset + nbytes))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap
        raw = (tmp_path / SEGMENTS_DIR / "seg-00000000").read_bytes()
        for k, (offset, _, nbytes), layers in zip(keys, where, shapes, strict=True):
            assert raw[offset : offset + nbytes] == layer_bytes(k, layers[0])
    finally:
        backend.close()


def test_freed_extents_rest_while_other_space_has_room(tmp_path: Path) -> None:
    """A same-host client may still read an extent freed a moment ago: new writes go to
    other free space first, and take the freed extents only once nothing else has room."""
    backend = LmdbBackend(tmp_path, capacity_bytes=8 * BIG[0].nbytes, sync=False)
    try:
        first = chain("a", 4)
        backend.write([make_write(NS, k, layers=BIG) for k in first])
        freed = {offset for offset, _, _ in extents(backend, first)}
        backend.delete([(NS, k) for k in first])
        second = chain("b", 4)
        backend.write([make_write(NS, k, layers=BIG) for k in second])
        assert not {offset for offset, _, _ in extents(backend, second)} & freed
        third = chain("c", 4)  # the segments are full but for the resting extents
        backend.write([make_write(NS, k, layers=BIG) for k in third])
        assert {offset for offset, _, _ in extents(backend, third)} == freed
    finally:
        backend.close()


def test_an_extent_is_not_reused_while_a_read_that_saw_it_is_open(tmp_path: Path) -> None:
    """locate (the promotion's reads into the arena run inside it) keeps the extents it
    found: a deletion meanwhile frees them only once it ends."""
    backend = LmdbBackend(tmp_path, capacity_bytes=2 * BIG[0].nbytes, sync=False)  # two blocks
    try:
        backend.write([make_write(NS, h(1), layers=BIG)])
        with backend.locate([(NS, h(1))]) as found:
            backend.delete([(NS, h(1))])
            backend.write([make_write(NS, h(2), layers=BIG)])
            with pytest.raises(StorageFullError):  # the freed extent is still being read
                backend.write([make_write(NS, h(3), layers=BIG)])
            record = found[0]
            assert record is not None
            target = bytearray(BIG[0].nbytes)
            backend.read_into(record, [memoryview(target)]).result()
            assert bytes(target) == layer_bytes(h(1), BIG[0])  # its bytes stayed
        backend.write([make_write(NS, h(3), layers=BIG)])  # the read ended: reused now
        assert extents(backend, [h(3)])[0][0] == 0
    finally:
        backend.close()


def test_the_index_is_rebuilt_at_start_and_bad_records_are_dropped(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    keys = chain("a", 6)
    backend.write([make_write(NS, k, layers=BIG) for k in keys])
    where = extents(backend, keys)
    # a record naming an extent that overlaps another's, and one that is not a record
    with backend._env.begin(write=True, db=backend._env.open_db(BLOCKS_DB)) as txn:
        raw = txn.get(records.index_key(NS, keys[5]))
        head = bytearray(raw)
        head[:8] = where[4][0].to_bytes(8, "little")
        txn.put(records.index_key(NS, keys[5]), bytes(head))
        txn.put(records.index_key(NS, h("junk")), b"\x01\x02")
    backend.close()
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        assert sorted(m.block_hash for m in backend.scan()) == sorted(keys[:5])
        assert backend.stored_prefix([(NS, k) for k in keys]) == 5
        # the extents of the recovered blocks are taken: a new write goes elsewhere
        backend.write([make_write(NS, h("new"), layers=BIG)])
        assert extents(backend, [h("new")])[0][0] not in {offset for offset, _, _ in where[:5]}
        with backend.read([(NS, k) for k in keys[:5]]) as blocks:
            assert all(b is not None and b.corrupt_layer() is None for b in blocks)
    finally:
        backend.close()


def test_writes_are_all_or_nothing_when_the_segments_fill(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=512 << 10, sync=False)
    try:
        assert backend.payload_capacity <= 512 << 10
        fits = backend.payload_capacity // aligned(BIG[0].nbytes)
        backend.write([make_write(NS, k, layers=BIG) for k in chain("a", fits - 1)])
        with pytest.raises(StorageFullError, match="full"):
            backend.write([make_write(NS, k, layers=BIG) for k in chain("b", 3)])
        assert not {m.block_hash for m in backend.scan()} & set(chain("b", 3))
        # the deletion makes room in the same call (the store's pattern)
        backend.write(
            [make_write(NS, k, layers=BIG) for k in chain("b", 3)],
            deletes=[(NS, k) for k in chain("a", 4)],
        )
        assert backend.stored_prefix([(NS, k) for k in chain("b", 3)]) == 3
    finally:
        backend.close()


@pytest.mark.parametrize("capacity", [2000, 1 << 20, 64 << 20, 1 << 30, 100 << 30])
def test_segments_and_index_stay_within_the_capacity(tmp_path: Path, capacity: int) -> None:
    reserve = index_reserve(capacity)
    size = segment_size_for(capacity - reserve)
    segs = Segments(tmp_path, max_bytes=capacity - reserve, segment_bytes=size, direct=False)
    try:
        assert segs.max_bytes + reserve <= capacity and segs.max_bytes >= capacity * 0.9 - reserve
        assert size <= segs.max_bytes
    finally:
        segs.close()


def test_read_into_fills_scattered_buffers(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        backend.write([make_write(NS, h(1))])
        target = bytearray(1000)
        view = memoryview(target)
        pieces = [view[500 : 500 + LAYERS[0].nbytes], view[0 : LAYERS[1].nbytes]]
        with backend.locate([(NS, h(1)), (NS, h(2))]) as found:
            assert found[1] is None
            record = found[0]
            assert record is not None
            backend.read_into(record, pieces).result()
        assert bytes(pieces[0]) == layer_bytes(h(1), LAYERS[0])
        assert bytes(pieces[1]) == layer_bytes(h(1), LAYERS[1])
        with pytest.raises(ValueError, match="bytes of buffers"):
            backend.read_into(record, pieces[:1])
    finally:
        backend.close()


def test_a_payload_cut_short_on_disk_is_an_error_not_bytes(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        backend.write([make_write(NS, h(1), layers=BIG)])
        with backend.locate([(NS, h(1))]) as found:
            record = found[0]
        assert record is not None
        os.truncate(tmp_path / SEGMENTS_DIR / "seg-00000000", record.where[0] + 100)
        with pytest.raises(StorageError, match="short read"):
            backend.read_into(record, [memoryview(bytearray(BIG[0].nbytes))]).result()
    finally:
        backend.close()


def test_an_environment_of_the_older_layout_is_replaced(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"data")) as txn:
        txn.put(b"k", b"v" * 1000)
    env.close()
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        assert list(backend.scan()) == []
        backend.write([make_write(NS, h(1))])
        assert backend.stored_prefix([(NS, h(1))]) == 1
    finally:
        backend.close()


def test_other_lmdb_errors_are_storage_errors(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    try:
        # LMDB's default key limit is 511 bytes: a 600-byte namespace is refused by LMDB itself
        with pytest.raises(StorageError) as info:
            backend.write([make_write(b"n" * 600, h(1))])
        assert not isinstance(info.value, StorageFullError)
        assert isinstance(info.value.__cause__, lmdb.Error)
        # its extent went back: the segments hold nothing
        assert backend.segments.free_bytes == backend.payload_capacity
    finally:
        backend.close()


def test_a_batch_lies_back_to_back_and_goes_to_disk_in_one_request(tmp_path: Path) -> None:
    """A write-behind batch of small blocks is placed in one run of a segment and written
    as one request (one per block kept the I/O pool's Python on the daemon's GIL)."""
    backend = LmdbBackend(tmp_path, capacity_bytes=64 << 20, sync=False)
    requests: list[int] = []
    submit_many = backend.io.submit_many

    def counted(tasks):  # type: ignore[no-untyped-def]
        requests.append(len(tasks))
        return submit_many(tasks)

    backend.io.submit_many = counted  # type: ignore[method-assign]
    try:
        keys = chain("a", 8)
        backend.write([make_write(NS, k, layers=BIG) for k in keys])
        assert requests == [1]
        where = extents(backend, keys)
        assert len({segment for _, segment, _ in where}) == 1
        assert [offset for offset, _, _ in where] == [where[0][0] + i * BIG[0].nbytes for i in range(8)]
        with backend.read([(NS, k) for k in keys]) as blocks:
            for k, block in zip(keys, blocks, strict=True):
                assert block is not None and block.corrupt_layer() is None
                assert bytes(block.layers[0]) == layer_bytes(k, BIG[0])
    finally:
        backend.close()


def test_a_batch_no_free_run_holds_goes_into_the_holes_one_by_one(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=8 * BIG[0].nbytes, sync=False)
    try:
        first = chain("a", 8)
        backend.write([make_write(NS, k, layers=BIG) for k in first])
        holes = [extents(backend, [k])[0][0] for k in first[::2]]
        backend.delete([(NS, k) for k in first[::2]])  # four holes of one block each
        second = chain("b", 4)
        backend.write([make_write(NS, k, layers=BIG) for k in second])
        assert sorted(offset for offset, _, _ in extents(backend, second)) == sorted(holes)
        with backend.read([(NS, k) for k in [*second, *first[1::2]]]) as blocks:
            for k, block in zip([*second, *first[1::2]], blocks, strict=True):
                assert block is not None and bytes(block.layers[0]) == layer_bytes(k, BIG[0])
    finally:
        backend.close()


def test_a_batch_no_free_run_holds_leaves_resting_extents_resting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """allocate_run's try at one run for a batch does not end the rest of freed extents
    (a same-host client may still read them) when its blocks fit elsewhere one by one."""
    import kvstore_server.tiers.segments as segments_module

    segs = Segments(tmp_path, max_bytes=8 * ALIGN, segment_bytes=8 * ALIGN, direct=False)
    try:
        taken = [segs.allocate(ALIGN) for _ in range(8)]
        monkeypatch.setattr(segments_module, "_REST_S", 0.0)
        for k in (1, 5):  # rested at once
            segs.free(*taken[k], ALIGN)
        monkeypatch.setattr(segments_module, "_REST_S", 3600.0)
        segs.free(*taken[3], ALIGN)  # still resting
        assert sorted(segs.allocate_run([ALIGN, ALIGN])) == [taken[1], taken[5]]
    finally:
        segs.close()

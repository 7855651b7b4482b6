"""LmdbBackend specifics: map sizing, atomic transactions, a full map."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
from kvunit import LAYERS, NS, chain, h, layer_bytes, make_write

from kvstore_server.tiers import LayerSpec, StorageFullError, open_backend
from kvstore_server.tiers import lmdb as lmdb_backend
from kvstore_server.tiers.lmdb import LmdbBackend

BIG = (LayerSpec("k", "uint8", (16384,), 16384),)


def test_map_size_is_twice_capacity_with_a_floor(tmp_path: Path) -> None:
    small = LmdbBackend(tmp_path / "small", capacity_bytes=1 << 20, sync=False)
    big = LmdbBackend(tmp_path / "big", capacity_bytes=3 << 30, sync=False)
    try:
        assert small._env.info()["map_size"] == 1 << 30
        assert big._env.info()["map_size"] == 6 << 30
    finally:
        small.close()
        big.close()


def test_open_backend_places_environment_under_lmdb(tmp_path: Path) -> None:
    backend = open_backend("lmdb", tmp_path, capacity_bytes=1 << 20, sync=True)
    try:
        assert backend.name == "lmdb"
        backend.write([make_write(NS, h(1))])
        assert (tmp_path / "lmdb" / "data.mdb").is_file()
    finally:
        backend.close()


def test_views_point_into_the_map(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=1 << 20, sync=False)
    try:
        backend.write([make_write(NS, h(1))])
        with backend.read([(NS, h(1))]) as blocks:
            block = blocks[0]
            assert block is not None
            assert block.layers[0].readonly
            assert bytes(block.layers[0]) == layer_bytes(h(1), LAYERS[0])
    finally:
        backend.close()


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An environment whose map is 256 KiB (the real floor is 1 GiB; lowered for the test)."""
    monkeypatch.setattr(lmdb_backend, "_MAP_MIN_BYTES", 0)
    backend = LmdbBackend(tmp_path, capacity_bytes=128 << 10, sync=False)
    yield backend
    backend.close()


def fill(backend: LmdbBackend, prefix: str) -> list[bytes]:
    """Write single big blocks until the map is full; return what was stored."""
    stored: list[bytes] = []
    with pytest.raises(StorageFullError, match="map is full"):
        for block_hash in chain(prefix, 100):
            backend.write([make_write(NS, block_hash, layers=BIG)])
            stored.append(block_hash)
    return stored


def test_full_map_raises_storage_full_error(tiny: LmdbBackend) -> None:
    stored = fill(tiny, "a")
    assert 3 <= len(stored) < 16
    # the env is still usable and holds exactly what was committed
    assert sorted(m.block_hash for m in tiny.scan()) == sorted(stored)
    with tiny.read([(NS, x) for x in stored]) as blocks:
        assert all(b is not None and b.corrupt_layer() is None for b in blocks)


def test_full_map_puts_are_all_or_nothing(tiny: LmdbBackend) -> None:
    stored = fill(tiny, "a")
    # a batch that cannot fit even after its deletion: none of its blocks may stick
    batch = [make_write(NS, x, layers=BIG) for x in chain("b", 10)]
    with pytest.raises(StorageFullError):
        tiny.write(batch, deletes=[(NS, stored[0])])
    scanned = sorted(m.block_hash for m in tiny.scan())
    assert not set(scanned) & set(chain("b", 10))
    # the deletion itself may have been committed (the store wants it gone either way)
    assert set(scanned) >= set(stored[1:])


def test_room_freed_by_a_delete_is_reused_by_the_next_write(tiny: LmdbBackend) -> None:
    # LMDB reuses pages freed by a commit only two commits later; the backend
    # must not leave the caller stuck with a map full of free pages.
    stored = fill(tiny, "a")
    tiny.delete([(NS, x) for x in stored])
    batch = chain("b", len(stored) - 1)
    tiny.write([make_write(NS, x, layers=BIG) for x in batch])
    assert sorted(m.block_hash for m in tiny.scan()) == sorted(batch)


def test_full_map_put_succeeds_by_evicting_in_the_same_call(tiny: LmdbBackend) -> None:
    # the store's pattern: delete the victims and store the new blocks in one call
    for round_ in range(4):
        stored = sorted(m.block_hash for m in tiny.scan())
        batch = chain(f"r{round_}-", 6)
        tiny.write([make_write(NS, x, layers=BIG) for x in batch], deletes=[(NS, x) for x in stored])
        assert sorted(m.block_hash for m in tiny.scan()) == sorted(batch)
        with tiny.read([(NS, x) for x in batch]) as blocks:
            assert all(b is not None and b.corrupt_layer() is None for b in blocks)


def test_unreadable_metadata_is_skipped(tmp_path: Path) -> None:
    backend = LmdbBackend(tmp_path, capacity_bytes=1 << 20, sync=False)
    try:
        backend.write([make_write(NS, h(1)), make_write(NS, h(2))])
        key = len(NS).to_bytes(2, "big") + NS + h(2)
        with backend._env.begin(write=True, db=backend._meta) as txn:
            txn.put(key, b"{not json")
        assert [m.block_hash for m in backend.scan()] == [h(1)]
        with backend.read([(NS, h(1)), (NS, h(2))]) as blocks:
            assert blocks[0] is not None
            assert blocks[1] is None
    finally:
        backend.close()


def test_other_lmdb_errors_are_storage_errors(tmp_path: Path) -> None:
    from kvstore_server.tiers import StorageError

    backend = LmdbBackend(tmp_path, capacity_bytes=1 << 20, sync=False)
    try:
        # LMDB's default key limit is 511 bytes: a 600-byte namespace is refused by LMDB itself
        with pytest.raises(StorageError) as info:
            backend.write([make_write(b"n" * 600, h(1))])
        assert not isinstance(info.value, StorageFullError)
        assert isinstance(info.value.__cause__, lmdb.Error)
    finally:
        backend.close()

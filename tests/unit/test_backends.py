"""The Backend contract, run against every backend (kvstore_server.tiers)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import xxhash
from kvunit import LAYERS, NS, NS2, chain, h, layer_bytes, make_write, new_backend

from kvstore_server.tiers import (
    BACKENDS,
    Backend,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    StorageError,
    StoredBlock,
    checksum,
    open_backend,
)


@pytest.fixture
def backend(backend_kind: str, tmp_path: Path):
    b = new_backend(backend_kind, tmp_path)
    yield b
    b.close()


def read_bytes(backend: Backend, keys: list[tuple[bytes, bytes]]) -> list[list[bytes] | None]:
    with backend.read(keys) as blocks:
        return [None if b is None else [bytes(v) for v in b.layers] for b in blocks]


def expected_bytes(block_hash: bytes, layers=LAYERS) -> list[bytes]:
    return [layer_bytes(block_hash, layer) for layer in layers]


def test_names() -> None:
    assert BACKENDS == ("lmdb", "disk")


def test_open_backend_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown backend 'redis'"):
        open_backend("redis", tmp_path, capacity_bytes=1 << 20, sync=False)


def test_new_backend_is_empty(backend: Backend) -> None:
    assert list(backend.scan()) == []
    assert read_bytes(backend, [(NS, h(1))]) == [None]


def test_write_then_read(backend: Backend) -> None:
    a = chain("a", 3)
    writes = [make_write(NS, a[0]), make_write(NS, a[1], a[0]), make_write(NS, a[2], a[1])]
    backend.write(writes)
    with backend.read([(NS, x) for x in a]) as blocks:
        assert len(blocks) == 3
        for block, write in zip(blocks, writes, strict=True):
            assert isinstance(block, StoredBlock)
            assert block.meta == write.meta
            assert all(isinstance(v, memoryview) for v in block.layers)
            assert [bytes(v) for v in block.layers] == [bytes(x) for x in write.layers]
            assert block.corrupt_layer() is None


def test_read_keeps_key_order_and_marks_missing(backend: Backend) -> None:
    a = chain("a", 3)
    backend.write([make_write(NS, x) for x in a])
    keys = [(NS, a[2]), (NS, h("missing")), (NS, a[0]), (NS2, a[1]), (NS, a[2])]
    got = read_bytes(backend, keys)
    assert got == [expected_bytes(a[2]), None, expected_bytes(a[0]), None, expected_bytes(a[2])]
    assert read_bytes(backend, []) == []


def test_scan_lists_every_block_with_full_metadata(backend: Backend) -> None:
    writes = [make_write(NS, x, created_at=1000.0 + i) for i, x in enumerate(chain("a", 5))]
    writes.append(make_write(NS2, h("a0"), created_at=5.25))  # same hash, other namespace
    backend.write(writes)
    scanned = sorted(backend.scan(), key=lambda m: m.key)
    assert scanned == sorted((w.meta for w in writes), key=lambda m: m.key)


def test_namespaces_are_separate(backend: Backend) -> None:
    shared = h("shared")
    one = make_write(NS, shared, layers=LAYERS[:1])
    two = make_write(NS2, shared, layers=LAYERS)
    backend.write([one, two])
    with backend.read([(NS, shared), (NS2, shared)]) as blocks:
        assert blocks[0] is not None and blocks[0].meta.layers == LAYERS[:1]
        assert blocks[1] is not None and blocks[1].meta.layers == LAYERS
    backend.delete([(NS, shared)])
    assert read_bytes(backend, [(NS, shared), (NS2, shared)]) == [None, expected_bytes(shared)]


@pytest.mark.parametrize("namespace", [b"\x00", b"a/../../b", b"\xff" * 256, "ünï".encode()])
def test_odd_namespaces(backend: Backend, namespace: bytes) -> None:
    backend.write([make_write(namespace, h(1))])
    assert read_bytes(backend, [(namespace, h(1))]) == [expected_bytes(h(1))]
    assert [m.namespace for m in backend.scan()] == [namespace]


def test_delete_and_unknown_keys_are_ignored(backend: Backend) -> None:
    a = chain("a", 3)
    backend.write([make_write(NS, x) for x in a])
    backend.delete([(NS, a[1]), (NS, h("never")), (NS2, a[0])])
    assert read_bytes(backend, [(NS, x) for x in a]) == [expected_bytes(a[0]), None, expected_bytes(a[2])]
    assert sorted(m.block_hash for m in backend.scan()) == sorted([a[0], a[2]])
    backend.delete([])
    backend.delete([(NS, a[1])])  # twice is fine
    assert len(list(backend.scan())) == 2


def test_write_deletes_then_puts_in_one_call(backend: Backend) -> None:
    a, b = chain("a", 2), chain("b", 2)
    backend.write([make_write(NS, x) for x in a])
    backend.write([make_write(NS, x) for x in b], deletes=[(NS, a[0]), (NS, a[1])])
    assert sorted(m.block_hash for m in backend.scan()) == sorted(b)
    # deleting and storing the same key in one call leaves it stored
    backend.write([make_write(NS, a[0])], deletes=[(NS, a[0])])
    assert read_bytes(backend, [(NS, a[0])]) == [expected_bytes(a[0])]


def test_empty_write_is_a_noop(backend: Backend) -> None:
    backend.write([])
    assert list(backend.scan()) == []


def test_rewrite_replaces(backend: Backend) -> None:
    backend.write([make_write(NS, h(1), layers=LAYERS)])
    one_layer = make_write(NS, h(1), layers=LAYERS[1:])
    backend.write([one_layer])
    with backend.read([(NS, h(1))]) as blocks:
        assert blocks[0] is not None
        assert blocks[0].meta == one_layer.meta
    assert len(list(backend.scan())) == 1


def test_read_snapshot_survives_delete(backend: Backend) -> None:
    # Store.take reads, then deletes, then streams from the read views
    a = chain("a", 2)
    backend.write([make_write(NS, x) for x in a])
    with backend.read([(NS, x) for x in a]) as blocks:
        backend.delete([(NS, x) for x in a])
        backend.write([make_write(NS, h("other"))])
        assert [[bytes(v) for v in b.layers] for b in blocks] == [expected_bytes(x) for x in a]
    assert read_bytes(backend, [(NS, x) for x in a]) == [None, None]


def test_data_survives_reopen(backend_kind: str, tmp_path: Path) -> None:
    a = chain("a", 4)
    writes = [make_write(NS, x, parent) for x, parent in zip(a, [b""] + a[:-1], strict=True)]
    first = new_backend(backend_kind, tmp_path)
    first.write(writes)
    first.delete([(NS, a[3])])
    first.close()
    second = new_backend(backend_kind, tmp_path)
    try:
        assert sorted(second.scan(), key=lambda m: m.block_hash) == sorted(
            (w.meta for w in writes[:3]), key=lambda m: m.block_hash
        )
        assert read_bytes(second, [(NS, x) for x in a]) == [expected_bytes(x) for x in a[:3]] + [None]
    finally:
        second.close()


def test_many_layers_and_dtypes(backend: Backend) -> None:
    # more layers than one writev call takes (IOV_MAX batches in the disk backend)
    layers = tuple(
        LayerSpec(f"layer.{i}", dtype, (3, 5), 15 * size)
        for i, (dtype, size) in enumerate([("bfloat16", 2), ("float8_e4m3fn", 1), ("float32", 4)] * 200)
    )
    backend.write([make_write(NS, h("wide"), layers=layers)])
    with backend.read([(NS, h("wide"))]) as blocks:
        block = blocks[0]
        assert block is not None
        assert block.meta.layers == layers
        assert [bytes(v) for v in block.layers] == expected_bytes(h("wide"), layers)
        assert block.corrupt_layer() is None


def test_short_data_is_never_served(backend: Backend) -> None:
    """A write whose bytes are shorter than its record: refused (lmdb: it knows where the
    payload ends only from the record) or stored and read as missing (disk)."""
    good = make_write(NS, h(1))
    short = BlockWrite(good.meta, [good.layers[0], good.layers[1][:-1]])
    if backend.name == "lmdb":
        with pytest.raises(StorageError, match="bytes"):
            backend.write([short])
    else:
        backend.write([short])
    assert read_bytes(backend, [(NS, h(1))]) == [None]


def test_concurrent_writers_and_readers(backend: Backend) -> None:
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            hashes = chain(f"t{t}-", 20)
            barrier.wait()
            for x in hashes:
                backend.write([make_write(NS, x)])
                assert read_bytes(backend, [(NS, x)]) == [expected_bytes(x)]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(list(backend.scan())) == 80


# ---- BlockMeta and StoredBlock (storage/base.py) -------------------------------------
def test_block_meta_json_round_trip() -> None:
    meta = BlockMeta(
        namespace=b"\x00\xffns",
        block_hash=h(1),
        parent_hash=h(0),
        layers=(
            LayerSpec("model.layers.0.kv", "bfloat16", (2, 16, 8, 128), 65536),
            LayerSpec("ü", "bool", (3,), 3),
        ),
        checksums=(2**64 - 1, 0),
        created_at=1712345678.123456,
    )
    raw = meta.to_json()
    assert isinstance(raw, bytes)
    assert b"\n" not in raw
    assert BlockMeta.from_json(raw) == meta
    assert BlockMeta.from_json(memoryview(raw)) == meta
    assert BlockMeta.from_json(raw.decode()) == meta
    assert meta.size == 65536 + 3
    assert meta.key == (b"\x00\xffns", h(1))
    root = BlockMeta(NS, h(2), b"", LAYERS, (1, 2))
    assert BlockMeta.from_json(root.to_json()).parent_hash == b""


def test_block_meta_json_checks_version() -> None:
    raw = BlockMeta(NS, h(1), b"", LAYERS, (1, 2), 1.0).to_json().replace(b'"v":1', b'"v":2')
    with pytest.raises(StorageError, match="version 2"):
        BlockMeta.from_json(raw)


def test_block_meta_needs_one_checksum_per_layer() -> None:
    with pytest.raises(ValueError):
        BlockMeta(NS, h(1), b"", LAYERS, (1,), 1.0).to_json()


def test_checksum_is_xxh3_64() -> None:
    assert checksum(b"abc") == xxhash.xxh3_64_intdigest(b"abc")
    assert checksum(memoryview(b"abc")) == checksum(b"abc")
    assert checksum(b"abc") != checksum(b"abd")


def test_corrupt_layer_finds_the_bad_layer() -> None:
    write = make_write(NS, h(1))
    datas = [bytearray(x) for x in write.layers]
    assert StoredBlock(write.meta, [memoryview(d) for d in datas]).corrupt_layer() is None
    datas[1][5] ^= 0x40
    assert StoredBlock(write.meta, [memoryview(d) for d in datas]).corrupt_layer() == 1
    short = [memoryview(bytes(write.layers[0]))[:-1], memoryview(bytes(write.layers[1]))]
    assert StoredBlock(write.meta, short).corrupt_layer() == 0

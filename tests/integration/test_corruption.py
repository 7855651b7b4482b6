"""Bytes flipped on disk under a running server are caught by the checksums, never served.

In-process servers (the files are flipped from outside the store either way), both backends."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvstore_client import KVStoreClient

from .helpers import NS, assert_same, both_backends, chain, rows

SHAPE = (4, 32)  # float16: 256 bytes per block per layer


def marker(block: int, layer: int) -> bytes:
    return hashlib.sha256(f"corruption-marker {block} {layer}".encode()).digest()[:16]


def recognisable_layers(n: int, num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Every block's bytes of every layer are a marker of its own, repeated."""
    per_block = 2 * SHAPE[0] * SHAPE[1]
    out = {}
    for layer in range(num_layers):
        raw = b"".join(marker(b, layer) * (per_block // 16) for b in range(n))
        out[f"layer.{layer}"] = torch.frombuffer(bytearray(raw), dtype=torch.float16).reshape(n, *SHAPE)
    return out


def stored_with_a_flipped_byte(
    server, kv: KVStoreClient, backend: str, name: str, bad_block: int, bad_layer: int
) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    """Three recognisable blocks stored under `name`, one byte of (bad_block, bad_layer)
    then flipped in the server's files (`server`: a Daemon or an InProcServer). Returns the hashes and the layers as put."""
    hashes = chain(name, 3)
    layers = recognisable_layers(3)
    kv.put(NS, hashes, layers)
    flip_payload_byte(server.data_dir, backend, hashes[bad_block], marker(bad_block, bad_layer))
    return hashes, layers


def flip_payload_byte(data_dir: Path, backend: str, block_hash: bytes, needle: bytes) -> int:
    """Flip one byte of `needle`'s stored copy in place, with the daemon running. Returns copies hit."""
    if backend == "lmdb":
        files = sorted((data_dir / "lmdb" / "segments").glob("seg-*"))
    else:
        files = list((data_dir / "blocks").rglob(f"{block_hash.hex()}.safetensors"))
        assert len(files) == 1
    hits = 0
    for path in files:
        content = path.read_bytes()
        offsets = []
        start = content.find(needle)
        while start >= 0:
            offsets.append(start)
            start = content.find(needle, start + 1)
        # the marker is repeated through the block: flip the 6th byte of its first copy in
        # every stored copy of the block (LMDB may keep an old page with the same bytes)
        firsts = [o for o in offsets if o < len(needle) or content[o - len(needle) : o] != needle]
        with open(path, "r+b") as f:
            for offset in firsts:
                f.seek(offset + 5)
                f.write(bytes([content[offset + 5] ^ 0xFF]))
        hits += len(firsts)
    assert hits >= 1, "payload not found on disk"
    return hits


@both_backends
def test_corrupt_block_ends_the_prefix(server, kv: KVStoreClient, backend: str) -> None:
    hashes = chain("corrupt-middle", 3)
    layers = recognisable_layers(3)
    kv.put(NS, hashes, layers)
    assert_same(kv.select(NS, hashes), layers)
    assert kv.stats()["checksum_failures"] == 0

    flip_payload_byte(server.data_dir, backend, hashes[1], marker(1, 0))

    got = kv.select(NS, hashes)
    assert_same(got, rows(layers, 0, 1))  # the prefix before the bad block, never wrong bytes
    assert got.stop_reason == "checksum_failed"
    assert kv.stats()["checksum_failures"] == 1
    log = server.log()
    assert "checksum mismatch" in log
    assert hashes[1].hex() in log
    # the bad block is dropped: lookups no longer promise it
    assert kv.lookup(NS, hashes) == 1
    again = kv.select(NS, hashes)
    assert_same(again, rows(layers, 0, 1))
    assert again.stop_reason == "not_stored"
    assert kv.stats()["checksum_failures"] == 1
    assert kv.health() == "SERVING"


@both_backends
def test_corrupt_first_block_in_a_later_layer_is_a_miss(server, kv: KVStoreClient, backend: str) -> None:
    hashes = chain("corrupt-first", 2)
    layers = recognisable_layers(2, num_layers=3)
    kv.put(NS, hashes, layers)
    other = chain("corrupt-bystander", 2)
    bystander = recognisable_layers(2, num_layers=1)
    kv.put(NS, other, bystander)

    flip_payload_byte(server.data_dir, backend, hashes[0], marker(0, 2))

    stream = kv.get_stream(NS, hashes)
    assert stream.num_blocks == 0
    assert list(stream) == []
    assert kv.select(NS, hashes) == {}
    assert kv.stats()["checksum_failures"] == 1
    assert "layer 'layer.2'" in server.log()
    # other blocks are untouched
    assert_same(kv.select(NS, other), bystander)


@both_backends
def test_drop_select_never_hands_out_corrupt_bytes(server, kv: KVStoreClient, backend: str) -> None:
    hashes, layers = stored_with_a_flipped_byte(server, kv, backend, "corrupt-drop", 2, 1)

    got = kv.drop_select(NS, hashes, timeout=1.0)
    assert_same(got, rows(layers, 0, 2))
    assert kv.stats()["checksum_failures"] == 1
    assert kv.lookup(NS, hashes) == 0
    assert "checksum mismatch" in server.log()

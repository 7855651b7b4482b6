"""tiers.chain.verified_prefix: where a read of the chain of tiers stops, and why."""

from __future__ import annotations

import logging

import pytest
from kvunit import NS, chain, make_write

from kvstore_server.tiers import LayerSpec, StoredBlock
from kvstore_server.tiers.chain import verified_prefix

OTHER = (LayerSpec("k", "uint8", (128,), 128),)


def stored(block_hash: bytes, layers: tuple[LayerSpec, ...] | None = None, flip: bool = False) -> StoredBlock:
    write = make_write(NS, block_hash) if layers is None else make_write(NS, block_hash, layers=layers)
    views = [bytearray(data) for data in write.layers]
    if flip:
        views[-1][3] ^= 1
    return StoredBlock(write.meta, [memoryview(v) for v in views])


def test_a_whole_good_read_is_the_prefix() -> None:
    hashes = chain("all", 3)
    result, bad = verified_prefix([stored(x) for x in hashes], [(NS, x) for x in hashes])
    assert [b.meta.block_hash for b in result.blocks] == hashes and bad is None
    assert result.layers == stored(hashes[0]).meta.layers


def test_a_corrupt_block_ends_the_prefix_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    hashes = chain("bad", 4)
    blocks = [stored(hashes[0]), stored(hashes[1]), stored(hashes[2], flip=True), stored(hashes[3])]
    with caplog.at_level(logging.ERROR):
        result, bad = verified_prefix(blocks, [(NS, x) for x in hashes])
    assert result.num_blocks == 2 and bad == (NS, hashes[2])
    assert hashes[2].hex() in caplog.text and "'v'" in caplog.text  # the layer that failed


def test_a_missing_block_or_another_layout_ends_it_with_nothing_to_remove() -> None:
    hashes = chain("gap", 3)
    keys = [(NS, x) for x in hashes]
    result, bad = verified_prefix([stored(hashes[0]), None, stored(hashes[2])], keys)
    assert (result.num_blocks, bad) == (1, None)
    result, bad = verified_prefix([stored(hashes[0]), stored(hashes[1], OTHER), stored(hashes[2])], keys)
    assert (result.num_blocks, bad) == (1, None)
    result, bad = verified_prefix([None, *[stored(x) for x in hashes[1:]]], keys)
    assert (result.num_blocks, result.layers, bad) == (0, (), None)

"""kvstore_server.putbuffer: a Put's payload in one mapping, and the budget that admits it."""

from __future__ import annotations

import pytest

from kvstore import wire
from kvstore_server.putbuffer import MalformedPut, PutBudget, PutBuffer
from kvstore_server.tiers import LayerSpec, checksum

LAYERS = (LayerSpec("k", "uint8", (4,), 4), LayerSpec("v", "uint8", (2,), 2))


def chunk(layer: int, first: int, data: bytes) -> wire.Chunk:
    return wire.Chunk(layer, first, memoryview(data))


def test_blocks_are_laid_out_block_major_with_their_checksums() -> None:
    buffer = PutBuffer(LAYERS, 3)
    buffer.accept(chunk(1, 0, b"aabb"))  # layer v, blocks 0-1
    assert buffer.missing_layers() == ["k", "v"]
    buffer.accept(chunk(0, 0, b"000011112222"))  # layer k, blocks 0-2
    buffer.accept(chunk(1, 2, b"cc"))
    assert buffer.missing_layers() == []
    assert [bytes(buffer.block(i)) for i in range(3)] == [b"0000aa", b"1111bb", b"2222cc"]
    assert bytes(buffer.layer(1, 2)) == b"cc"
    assert buffer.checksums == [
        [checksum(b"0000"), checksum(b"1111"), checksum(b"2222")],
        [checksum(x) for x in (b"aa", b"bb", b"cc")],
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (chunk(2, 0, b"aa"), "the header declared 2"),
        (chunk(0, 1, b"1111"), "expected 0"),
        (chunk(0, 0, b"000"), "whole number"),
        (chunk(0, 0, b"0000" * 4), "more data than the 3"),
    ],
)
def test_chunks_that_do_not_fit_the_header_are_refused(bad: wire.Chunk, message: str) -> None:
    with pytest.raises(MalformedPut, match=message):
        PutBuffer(LAYERS, 3).accept(bad)


def test_the_budget_refuses_beyond_its_limit_and_counts_kept_mappings() -> None:
    budget = PutBudget(limit=5 * 6)  # room for five blocks of 6 bytes
    first = budget.acquire(LAYERS, 3)
    assert first is not None and budget.used == 18
    assert budget.acquire(LAYERS, 3) is None  # 36 > 30
    second = budget.acquire(LAYERS, 2)
    assert second is not None and budget.used == 30
    budget.release(first)  # its mapping is kept for the next put of 18 bytes
    assert budget.used == 12 and budget._kept_bytes == 18
    again = budget.acquire(LAYERS, 3)
    assert again is not None and budget._kept_bytes == 0  # reused, not mapped anew
    budget.release(again)
    budget.release(second)
    assert budget.used == 0 and budget._kept_bytes == 30
    third = budget.acquire(LAYERS, 4)  # 24 bytes: kept mappings are given up to make room
    assert third is not None and budget.used + budget._kept_bytes <= budget.limit
    budget.release(third)
    budget.drain()
    assert budget._kept_bytes == 0


def test_reusing_the_last_kept_mapping_of_a_size_then_making_room_for_another() -> None:
    budget = PutBudget(limit=5 * 6)
    a, b = budget.acquire(LAYERS, 3), budget.acquire(LAYERS, 1)
    assert a is not None and b is not None
    budget.release(a)
    budget.release(b)  # kept: one mapping of 18 bytes, one of 6
    again = budget.acquire(LAYERS, 3)  # takes the 18-byte one: none of that size is left
    assert again is not None and budget._kept_bytes == 6
    other = budget.acquire(LAYERS, 2)  # 12 new bytes: the 6-byte mapping is given up for them
    assert other is not None and budget._kept_bytes == 0 and budget.used == 30
    budget.release(other)
    budget.release(again)


def test_a_mapping_still_referenced_is_not_kept() -> None:
    budget = PutBudget(limit=1 << 20)
    buffer = budget.acquire(LAYERS, 1)
    assert buffer is not None
    held = buffer.block(0)  # e.g. a traceback still holding a view
    budget.release(buffer)
    assert budget.used == 0 and budget._kept_bytes == 0
    held.release()

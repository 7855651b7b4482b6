"""Blocks put in parts (kvstore_server.parts): whole only when every layer is in, bounded, reclaimed."""

from __future__ import annotations

import pytest

from kvstore.blocks import LayerSpec, checksum
from kvstore_server.parts import PartAssembler, PartError, PartsFull, check_subset

NS = b"ns"
LAYERS = tuple(LayerSpec(f"l{i}#h{h}", "uint8", (8,)) for i in range(2) for h in range(2))
HASHES = [bytes([i]) * 32 for i in range(1, 4)]
PARENTS = [b"", HASHES[0], HASHES[1]]


def data_of(block: int, layer: int) -> bytes:
    return bytes([16 * block + layer]) * 8


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def put(parts: PartAssembler, subset: tuple[int, ...], indices=None):
    return parts.add(NS, HASHES, PARENTS, LAYERS, subset,
                     lambda k, i: memoryview(data_of(i, subset[k])), indices=indices)  # fmt: skip


def test_a_block_is_whole_once_its_parts_cover_every_layer() -> None:
    parts = PartAssembler(1 << 20, 30.0, clock=Clock())
    assert put(parts, (0, 2)) == []  # rank 0's heads of each layer
    assert len(parts) == 3 and parts.nbytes == 3 * 32
    whole = put(parts, (1, 3))
    assert [w.block_hash for w in whole] == HASHES and [w.parent for w in whole] == PARENTS
    for w in whole:
        assert bytes(w.data) == b"".join(data_of(w.index, k) for k in range(4))
        assert w.checksums == tuple(checksum(data_of(w.index, k)) for k in range(4))
    assert len(parts) == 0 and parts.nbytes == 0 and parts.completed == 3


def test_a_repeated_part_does_not_complete_a_block() -> None:
    parts = PartAssembler(1 << 20, 30.0, clock=Clock())
    put(parts, (0, 2))
    assert put(parts, (0, 2)) == [] and len(parts) == 3


def test_a_part_of_another_layout_or_parent_is_refused_and_changes_nothing() -> None:
    parts = PartAssembler(1 << 20, 30.0, clock=Clock())
    put(parts, (0, 2), indices=[0])
    other = tuple(LayerSpec(s.name, "uint8", (4,)) for s in LAYERS)
    with pytest.raises(PartError, match="layout"):
        parts.add(NS, HASHES, PARENTS, other, (1,), lambda k, i: memoryview(b"x" * 4))
    with pytest.raises(PartError, match="parent"):
        parts.add(NS, HASHES, [b"\x09" * 32, b"", b""], LAYERS, (1, 3), lambda k, i: memoryview(b"x" * 8))
    assert len(parts) == 1
    assert [w.index for w in put(parts, (1, 3), indices=[0])] == [0]


def test_parts_beyond_the_bound_are_refused_whole() -> None:
    parts = PartAssembler(2 * 32, 30.0, clock=Clock())  # room for two blocks' parts
    with pytest.raises(PartsFull, match="max_partial_bytes"):
        put(parts, (0, 2))  # three blocks: none taken
    assert len(parts) == 0 and parts.nbytes == 0
    put(parts, (0, 2), indices=[0, 1])
    assert [w.index for w in put(parts, (1, 3), indices=[0, 1])] == [0, 1]  # completing needs no room


def test_parts_whose_other_layers_never_come_are_dropped_after_the_timeout() -> None:
    clock = Clock()
    parts = PartAssembler(1 << 20, 30.0, clock=clock)
    put(parts, (0, 2))
    clock.now += 29.0
    assert parts.stats()["partial_blocks"] == 3
    clock.now += 1.0
    assert parts.stats() == {
        "partial_blocks": 0,
        "partial_bytes": 0,
        "partials_completed": 0,
        "partials_expired": 3,
    }
    assert put(parts, (1, 3)) == []  # a late part starts over: never half a block visible


@pytest.mark.parametrize(("subset", "want"), [((), None), ((0, 1, 2, 3), None), ((1, 3), (1, 3))])
def test_subsets_that_are_all_layers_are_whole_puts(subset, want) -> None:
    assert check_subset(subset, 4) == want


@pytest.mark.parametrize("subset", [(4,), (1, 1), (2, 1)])
def test_bad_subsets_are_refused(subset) -> None:
    with pytest.raises(PartError):
        check_subset(subset, 4)

"""Blocks put in parts (kvstore_server.parts): whole only when every layer is in, bounded, reclaimed."""

from __future__ import annotations

import pytest

from kvstore import arena_format as fmt
from kvstore.blocks import LayerSpec, checksum
from kvstore_server.parts import ArenaRoom, PartAssembler, PartError, PartsFull, check_subset

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
        "part_layers_in_place": 0,
        "part_layers_copied": 3 * 2,
    }
    assert put(parts, (1, 3)) == []  # a late part starts over: never half a block visible


class Room:
    """An arena of a bytearray: extents handed out one after another, holds counted."""

    def __init__(self) -> None:
        self.buffer = bytearray(1 << 16)
        self.next = 0
        self.holds: dict[int, int] = {}

    def hold(self, layers: tuple[LayerSpec, ...], blocks: int) -> int:
        at, self.next = self.next, self.next + fmt.extent_bytes(sum(s.nbytes for s in layers), blocks)
        self.holds[at] = blocks
        return at

    def let_go(self, extent: int) -> None:
        self.holds[extent] -= 1

    def room(self) -> ArenaRoom:
        return ArenaRoom(memoryview(self.buffer), self.hold, self.let_go)

    def write(self, extent: int, blocks: int, position: int, subset: tuple[int, ...]) -> None:
        """A rank's layers written where they lie in the extent (as the client does)."""
        starts = fmt.layer_offsets([s.nbytes for s in LAYERS], blocks)
        for i in range(len(HASHES) - position):
            for k in subset:
                at = extent + starts[k] + (position + i) * LAYERS[k].nbytes
                self.buffer[at : at + 8] = data_of(i, k)


def sums_of(subset: tuple[int, ...]) -> list[list[int]]:
    """The xxh3 of each block's layers of `subset`, as a rank commits them ([block][layer])."""
    return [[checksum(data_of(i, k)) for k in subset] for i in range(len(HASHES))]


def never(k: int, i: int) -> memoryview:
    raise AssertionError("a part written in place was copied")


def test_ranks_write_their_layers_in_place_and_nothing_is_copied() -> None:
    room = Room()
    parts = PartAssembler(1 << 20, 30.0, clock=Clock(), arena=room.room())
    assert parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (0, 2)) == (0, 3, 0)  # extent, blocks, position
    assert room.holds == {0: 3}
    assert parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (0, 2)) is None  # claimed already
    assert parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (1, 2)) is None  # layer 2 claimed
    assert parts.place_in_arena(NS, HASHES[1:], PARENTS[1:], LAYERS, (1, 3)) == (0, 3, 1)  # blocks 1, 2
    assert parts.place_in_arena(NS, HASHES[:1], [b"x" * 32], LAYERS, (3,)) is None  # another parent
    parts = PartAssembler(1 << 20, 30.0, clock=Clock(), arena=room.room())
    extent, _, _ = parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (0, 2)) or (None, 0, 0)
    assert extent is not None and parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (1, 3)) == (extent, 3, 0)
    room.write(extent, 3, 0, (0, 1, 2, 3))
    assert (
        parts.add(NS, HASHES, PARENTS, LAYERS, (0, 2), never, sums=sums_of((0, 2)), lies_at=(extent, 0)) == []
    )
    whole = parts.add(NS, HASHES, PARENTS, LAYERS, (1, 3), never, sums=sums_of((1, 3)), lies_at=(extent, 0))
    assert [w.block_hash for w in whole] == HASHES and {w.extent for w in whole} == {extent}
    for w in whole:
        assert bytes(w.data) == b"".join(data_of(w.index, k) for k in range(4))
    stats = parts.stats()
    assert (stats["part_layers_in_place"], stats["part_layers_copied"]) == (3 * 4, 0)


def test_parts_dropped_under_a_writer_are_copied_from_where_it_wrote() -> None:
    clock, room = Clock(), Room()
    parts = PartAssembler(1 << 20, 30.0, clock=clock, arena=room.room())
    extent, _, _ = parts.place_in_arena(NS, HASHES, PARENTS, LAYERS, (0, 2)) or (None, 0, 0)
    assert extent is not None
    room.write(extent, 3, 0, (0, 2))
    clock.now += 30.0  # the other rank never came: the group was let go (its writer holds it)
    assert parts.stats()["partials_expired"] == 3 and room.holds[extent] == 0
    starts = fmt.layer_offsets([s.nbytes for s in LAYERS], 3)

    def written(k: int, i: int) -> memoryview:
        at = extent + starts[(0, 2)[k]] + i * 8
        return memoryview(room.buffer)[at : at + 8]

    assert parts.add(NS, HASHES, PARENTS, LAYERS, (0, 2), written, lies_at=(extent, 0)) == []
    assert parts.stats()["part_layers_copied"] == 3 * 2  # into a new group, from where it lay
    whole = put(parts, (1, 3))
    assert all(bytes(w.data) == b"".join(data_of(w.index, k) for k in range(4)) for w in whole)
    assert {w.extent for w in whole} == {room.next - fmt.extent_bytes(32, 3)}


@pytest.mark.parametrize(("subset", "want"), [((), None), ((0, 1, 2, 3), None), ((1, 3), (1, 3))])
def test_subsets_that_are_all_layers_are_whole_puts(subset, want) -> None:
    assert check_subset(subset, 4) == want


@pytest.mark.parametrize("subset", [(4,), (1, 1), (2, 1)])
def test_bad_subsets_are_refused(subset) -> None:
    with pytest.raises(PartError):
        check_subset(subset, 4)

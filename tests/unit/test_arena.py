"""The memory tier's parts: the allocator, the file, the committed-block index, leases."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import lmdb
import pytest

from kvstore import arena_format as fmt
from kvstore import records
from kvstore_server.tiers import BlockMeta, LayerSpec
from kvstore_server.tiers.arena import (
    Allocator,
    ArenaError,
    ArenaFile,
    ArenaIndex,
    MemoryTier,
    NoRoom,
    Pin,
    Placed,
    Reservation,
    open_memory_tier,
)

PAGE = fmt.ALIGN
LAYERS = (LayerSpec("a", "uint8", (3000,), 3000), LayerSpec("b", "uint8", (1000,), 1000))


def meta(i: int, ns: bytes = b"ns") -> BlockMeta:
    return BlockMeta(ns, i.to_bytes(32, "big"), b"", LAYERS, (1, 2), 1.0)


# ---- allocator
def test_allocator_first_fit_and_coalescing() -> None:
    alloc = Allocator(PAGE, 11 * PAGE)
    a, b, c = (alloc.allocate(2 * PAGE) for _ in range(3))
    assert (a, b, c) == (PAGE, 3 * PAGE, 5 * PAGE)
    assert alloc.free_bytes == 4 * PAGE
    alloc.free(b, 2 * PAGE)  # type: ignore[arg-type]
    assert alloc.allocate(3 * PAGE) == 7 * PAGE  # the hole of 2 pages is too small
    alloc.free(a, 2 * PAGE)  # type: ignore[arg-type]
    assert alloc.largest == 4 * PAGE  # a and b merged
    alloc.free(c, 2 * PAGE)  # type: ignore[arg-type]
    alloc.free(7 * PAGE, 3 * PAGE)
    assert alloc.free_bytes == alloc.total and alloc.largest == alloc.total


def test_allocator_random_workload_never_overlaps() -> None:
    rng = random.Random(7)
    alloc = Allocator(PAGE, 257 * PAGE)
    held: dict[int, int] = {}
    for _ in range(3000):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            alloc.free(offset, held.pop(offset))
        else:
            size = rng.randint(1, 9) * PAGE
            offset = alloc.allocate(size)
            if offset is not None:
                held[offset] = size
        spans = sorted(held.items())
        for (o1, s1), (o2, _) in zip(spans, spans[1:], strict=False):
            assert o1 + s1 <= o2
        assert alloc.free_bytes == alloc.total - sum(held.values())
    for offset, size in held.items():
        alloc.free(offset, size)
    assert alloc.largest == alloc.total


def test_allocator_claim_refuses_what_is_not_free() -> None:
    alloc = Allocator(PAGE, 9 * PAGE)
    assert alloc.claim(3 * PAGE, 2 * PAGE)
    assert not alloc.claim(4 * PAGE, PAGE)  # inside the claimed range
    assert not alloc.claim(8 * PAGE, 2 * PAGE)  # past the end
    assert alloc.allocate(2 * PAGE) == PAGE
    assert alloc.allocate(4 * PAGE) == 5 * PAGE


# ---- file and index
def test_file_is_private_sized_and_kept_across_opens(tmp_path: Path) -> None:
    path = tmp_path / "a.arena"
    first = ArenaFile(path, 1 << 20, "run-1")
    assert first.fresh and path.stat().st_size == 1 << 20
    assert path.stat().st_mode & 0o777 == 0o600
    first.view[PAGE : PAGE + 5] = b"hello"
    first.close()
    again = ArenaFile(path, 1 << 20, "run-2")
    assert not again.fresh and again.header.arena_id == first.header.arena_id
    assert bytes(again.view[PAGE : PAGE + 5]) == b"hello"
    assert fmt.Header.unpack(again.view[: fmt.HEADER_BYTES]).store_id == "run-2"
    again.close()
    resized = ArenaFile(path, 2 << 20, "run-3")  # another size: a new, empty arena
    assert resized.fresh and resized.header.arena_id != first.header.arena_id
    assert bytes(resized.view[PAGE : PAGE + 5]) == b"\0" * 5
    resized.close()


def test_file_too_small_or_unwritable(tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="too small"):
        ArenaFile(tmp_path / "a.arena", 100, "x")
    (tmp_path / "file").write_text("")
    with pytest.raises(ArenaError, match="cannot"):
        ArenaFile(tmp_path / "file" / "a.arena", 1 << 20, "x")  # its directory is a file


def test_no_room_in_the_shared_memory_filesystem_is_an_error_at_start(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(shm)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        with pytest.raises(ArenaError, match="no room for a memory tier"):
            ArenaFile(shm / "a.arena", 4 << 20, "x")
        assert not (shm / "a.arena").exists()  # nothing half-made is left
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=True)


def test_index_keeps_committed_records_of_its_own_arena_only(tmp_path: Path) -> None:
    index = ArenaIndex(tmp_path / "idx", "arena-1")
    placed = [Placed(meta(i), PAGE, 2, i) for i in range(2)]
    index.put(placed)
    index.close()
    again = ArenaIndex(tmp_path / "idx", "arena-1")
    assert sorted(p.meta.block_hash for p in again.scan()) == [m.meta.block_hash for m in placed]
    again.close()
    other = ArenaIndex(tmp_path / "idx", "arena-2")  # the file was replaced: records are stale
    assert list(other.scan()) == []
    other.close()


def test_index_after_a_reopen_goes_on_in_commit_order_and_deletes_what_it_recovered(tmp_path: Path) -> None:
    """Records are keyed by a sequence number: a reopened index continues after the last
    one (an append below it would fail), deletes a recovered block by its key, and a block
    indexed again keeps only its newest record."""
    index = ArenaIndex(tmp_path / "idx", "arena-1")
    index.put([Placed(meta(i), PAGE, 2, i) for i in range(2)])
    index.close()
    again = ArenaIndex(tmp_path / "idx", "arena-1")
    assert len(list(again.scan())) == 2
    again.put([Placed(meta(2), 3 * PAGE, 1, 0)])
    again.put([Placed(meta(1), 5 * PAGE, 1, 0)])  # block 1 again, elsewhere
    again.delete([meta(0).key, meta(7).key])  # a recovered block, and one never indexed
    again.close()
    last = ArenaIndex(tmp_path / "idx", "arena-1")
    found = {p.meta.block_hash: p.extent for p in last.scan()}
    assert found == {meta(1).block_hash: 5 * PAGE, meta(2).block_hash: 3 * PAGE}
    last.close()


def _records(path: Path) -> dict[str, int]:
    """How many records each of a closed index's databases holds."""
    env = lmdb.open(str(path), readonly=True, max_dbs=3, lock=False)
    try:
        with env.begin() as txn:
            return {
                name: txn.stat(env.open_db(name.encode(), txn=txn))["entries"] for name in ("blocks", "dead")
            }
    finally:
        env.close()


def test_index_a_commits_blocks_are_one_record_and_a_delete_keeps_the_rest_of_it(tmp_path: Path) -> None:
    """A put of one namespace's blocks is one record; deleting some of them keeps the others
    across a reopen (the run's bitmap of dead blocks), deleting the last drops the record."""
    index = ArenaIndex(tmp_path / "idx", "arena-1")
    index.put([Placed(meta(i), PAGE, 5, i) for i in range(5)])
    index.delete([meta(1).key, meta(3).key])
    index.close()
    assert _records(tmp_path / "idx") == {"blocks": 1, "dead": 1}
    again = ArenaIndex(tmp_path / "idx", "arena-1")
    found = {p.meta.block_hash: (p.position, tuple(p.meta.checksums)) for p in again.scan()}
    assert found == {meta(i).block_hash: (i, (1, 2)) for i in (0, 2, 4)}
    again.delete([meta(i).key for i in (0, 1, 2, 4)])  # block 1 is gone already
    again.close()
    assert _records(tmp_path / "idx") == {"blocks": 0, "dead": 0}
    assert list(ArenaIndex(tmp_path / "idx", "arena-1").scan()) == []


def test_index_a_put_of_two_namespaces_or_layouts_keeps_each_blocks_own(tmp_path: Path) -> None:
    other = (LayerSpec("c", "uint8", (512,), 512),)
    blocks = [
        Placed(meta(0), PAGE, 1, 0),
        Placed(meta(1, ns=b"other"), 2 * PAGE, 1, 0),
        Placed(BlockMeta(b"ns", (2).to_bytes(32, "big"), meta(0).block_hash, other, (9,), 3.0, "wsum32"), 3 * PAGE, 1, 0),
    ]  # fmt: skip
    index = ArenaIndex(tmp_path / "idx", "arena-1")
    index.put(blocks)
    index.close()
    again = ArenaIndex(tmp_path / "idx", "arena-1")
    assert {p.meta.key: (p.meta, p.extent) for p in again.scan()} == {
        p.meta.key: (p.meta, p.extent) for p in blocks
    }
    again.close()


def test_index_reads_the_record_per_block_of_the_format_before(tmp_path: Path) -> None:
    """An index written by the daemon before runs (format 3: one record per block) is
    recovered, not dropped: an upgrade keeps the blocks only the arena holds."""
    old = Placed(meta(0), PAGE, 2, 1)
    env = lmdb.open(str(tmp_path / "idx"), max_dbs=3)
    raw, layout = records.pack((old.extent, old.extent_blocks, old.position), old.meta)
    key = records.index_key(*old.meta.key)
    with env.begin(write=True) as txn:
        txn.put(b"arena-id", b"arena-1/3")
        txn.put(layout.digest, layout.record, db=env.open_db(b"layouts", txn=txn))
        txn.put(
            (7).to_bytes(8, "big"),
            len(key).to_bytes(2, "little") + key + raw,
            db=env.open_db(b"blocks", txn=txn),
        )
    env.close()
    index = ArenaIndex(tmp_path / "idx", "arena-1")
    assert [(p.meta, p.position) for p in index.scan()] == [(old.meta, 1)]
    index.put([Placed(meta(1), 2 * PAGE, 1, 0)])  # after the old record, in commit order
    index.delete([old.meta.key])
    index.close()
    assert [p.meta.key for p in ArenaIndex(tmp_path / "idx", "arena-1").scan()] == [meta(1).key]


# ---- state: recovery, placement, leases
@pytest.fixture
def tier(tmp_path: Path) -> MemoryTier:
    return open_memory_tier(
        tmp_path / "shm", tmp_path / "data", 64 * PAGE, "run", lease_seconds=5.0, write_behind_bytes=1 << 20
    )


def test_a_blocks_pieces_are_its_rows_of_the_extent_and_lie_where_a_client_finds_them(
    tier: MemoryTier,
) -> None:
    """blocks_pieces() (what write-behind writes from) makes each block's rows, several
    blocks of one extent together; they match the whole extent's rows and the layer-major
    layout clients read (kvstore.arena_format), whichever extent each block is in."""
    extents = {5 * PAGE: 7, 20 * PAGE: 3}
    blocks = [Placed(meta(i), extent, n, position) for i, (extent, n, position) in enumerate(
        [(5 * PAGE, 7, 0), (5 * PAGE, 7, 3), (5 * PAGE, 7, 6), (20 * PAGE, 3, 1), (5 * PAGE, 7, 2)]
    )]  # fmt: skip
    starts = fmt.layer_starts([spec.nbytes for spec in LAYERS])
    for placed, pieces in zip(blocks, tier.blocks_pieces(blocks), strict=True):
        extent, n, position = placed.extent, extents[placed.extent], placed.position
        assert pieces.iov.tolist() == tier.extent_rows(LAYERS, extent, n)[position].tolist()
        for layer, spec in enumerate(LAYERS):
            at = tier.file.address + extent + starts[layer] * n + position * spec.nbytes
            assert pieces.iov[layer].tolist() == [at, spec.nbytes]


def test_recover_claims_extents_and_drops_overlaps(tier: MemoryTier) -> None:
    nbytes = fmt.extent_bytes(4000, 2)
    good = [Placed(meta(0), PAGE, 2, 0), Placed(meta(1), PAGE, 2, 1)]
    overlapping = Placed(meta(2), PAGE + PAGE, 1, 0)  # starts inside the first extent
    disagreeing = Placed(meta(3), PAGE, 3, 0)  # same extent, another block count
    kept = tier.recover(iter([*good, overlapping, disagreeing]))
    assert kept == good
    assert tier.allocator.free_bytes == tier.allocator.total - nbytes


def test_extent_is_freed_once_empty_and_unpinned(tier: MemoryTier) -> None:
    offset = tier.allocate(fmt.extent_bytes(4000, 2))
    assert offset is not None
    blocks = [Placed(meta(i), offset, 2, i) for i in range(2)]
    tier.place(blocks, time.time(), dirty=False)
    tier.pin_extents([offset], time.time())
    tier.unplace([blocks[0].meta.key, blocks[1].meta.key])
    assert offset in tier.extents  # pinned: the bytes stay
    tier.unpin_extents([offset])
    assert offset not in tier.extents and tier.allocator.free_bytes == tier.allocator.total


def test_pinned_bytes_are_loads_pins_not_a_write_behinds_hold(tier: MemoryTier) -> None:
    """stats' pinned_bytes (the kvstore_pinned_bytes gauge, the CLI's "pinned") counts the
    extents loads hold; write-behind's and a read's brief holds are not loads."""
    nbytes = fmt.extent_bytes(4000, 2)
    offset = tier.allocate(nbytes)
    assert offset is not None
    blocks = [Placed(meta(i), offset, 2, i) for i in range(2)]
    tier.place(blocks, time.time(), dirty=False)
    keys = [placed.meta.key for placed in blocks]
    with tier.holding(keys) as held:  # as write-behind reads a block out
        assert held == blocks and tier.extents[offset].pins == 1
        assert tier.stats()["pinned_bytes"] == 0
        pinned = tier.pin(b"", b"ns", keys, {}, time.time())
        assert pinned.pin_id and tier.stats()["pinned_bytes"] == nbytes
    assert tier.stats()["pinned_bytes"] == nbytes  # the load's pin outlives the hold
    assert tier.release_pin(pinned.pin_id, b"") is not None
    assert tier.stats()["pinned_bytes"] == 0 and tier.extents[offset].pins == 0


def test_dirty_blocks_hold_their_extent_and_the_queue_is_bounded(tier: MemoryTier) -> None:
    tier.write_behind_limit = 4000  # one block
    offset = tier.allocate(fmt.extent_bytes(4000, 2))
    assert offset is not None
    blocks = [Placed(meta(i), offset, 2, i) for i in range(2)]
    tier.place(blocks, time.time(), dirty=True)
    assert list(tier.dirty) == [blocks[0].meta.key]
    assert tier.memory_only == {blocks[1].meta.key}
    assert tier.counters.write_behind_dropped == 1
    assert tier.extents[offset].waiting == 1  # block 0 waits for write-behind: the extent may not leave
    tier.written_behind([blocks[0].meta.key])
    assert tier.extents[offset].waiting == 0 and not tier.extents[offset].pins  # now it may


def _full_of_one_block_extents(tier: MemoryTier, last_use: dict[int, float]) -> list[int]:
    """The whole arena as resident one-block extents, clean (evictable), each last used
    at last_use.get(i, 100 + i): extent i is block meta(i)."""
    each = fmt.extent_bytes(4000, 1)
    count = tier.allocator.free_bytes // each
    offsets = tier.hold_block_extents(4000, count, 0.0)
    assert tier.allocator.free_bytes < each
    for i, at in enumerate(offsets):
        tier.place([Placed(meta(i), at, 1, 0)], last_use.get(i, 100.0 + i), dirty=False)
    tier.unpin_extents(offsets)
    return offsets


def test_a_promotion_into_a_full_arena_evicts_the_least_recently_used_blocks_it_needs_only(
    tier: MemoryTier,
) -> None:
    """Room for two blocks where the least recently used two are far apart: those two are
    evicted (not everything between them, for one range) and the blocks go where they were."""
    offsets = _full_of_one_block_extents(tier, {0: 1.0, 5: 2.0})
    got = tier.hold_block_extents(4000, 2, 500.0)
    assert got == [offsets[0], offsets[5]]
    assert tier.counters.memory_evictions == 2
    assert meta(0).key not in tier.resident and meta(5).key not in tier.resident
    assert all(meta(i).key in tier.resident for i in range(len(offsets)) if i not in (0, 5))
    assert all(tier.extents[at].pins == 1 for at in got)  # held by the promotion


def test_eviction_takes_the_least_recently_used_after_many_uses_and_not_a_held_extent(
    tier: MemoryTier,
) -> None:
    """After thousands of uses (the tier's ages of them compacted on the way), eviction
    still takes the least recently used extents; a held one is passed over, and is the
    first to go once it is let go."""
    offsets = _full_of_one_block_extents(tier, {})
    last = {i: 100.0 + i for i in range(len(offsets))}
    rng, t = random.Random(3), 1000.0
    for _ in range(3000):
        i, t = rng.randrange(len(offsets)), t + 1
        with tier.lock:
            tier.pin_extents([offsets[i]], t)
            tier.unpin_extents([offsets[i]])
        last[i] = t
    oldest = sorted(last, key=last.__getitem__)
    with tier.lock:  # held, as of its last use: the least recently used, and may not leave
        tier.pin_extents([offsets[oldest[0]]], last[oldest[0]])
    got = tier.hold_block_extents(4000, 2, t + 1)
    assert sorted(got) == sorted(offsets[i] for i in oldest[1:3])
    assert meta(oldest[0]).key in tier.resident
    with tier.lock:
        tier.unpin_extents([offsets[oldest[0]]])
    assert tier.hold_block_extents(4000, 1, t + 2) == [offsets[oldest[0]]]
    assert tier.counters.memory_evictions == 3


def test_a_promotion_takes_several_free_ranges_when_none_holds_it_all(tier: MemoryTier) -> None:
    """Free space in ranges of two blocks, a promotion of five: three ranges, the largest
    first, nothing evicted (the rest is pinned anyway); too many blocks for the free
    space is NoRoom, and nothing is taken."""
    each = fmt.extent_bytes(4000, 1)
    count = tier.allocator.free_bytes // each
    offsets = tier.hold_block_extents(4000, count, 0.0)
    holes = [at for i, at in enumerate(offsets) if i % 4 in (0, 1)]
    tier.unpin_extents(holes)  # empty and unpinned: freed, two blocks' room in each
    assert tier.allocator.largest == 2 * each
    got = tier.hold_block_extents(4000, 5, 1.0)
    assert len(set(got)) == 5 and set(got) <= set(holes)
    assert sum(1 for a, b in zip(got, got[1:], strict=False) if b == a + each) >= 2  # pairs side by side
    assert tier.counters.memory_evictions == 0
    free = tier.allocator.free_bytes
    with pytest.raises(NoRoom):
        tier.hold_block_extents(4000, free // each + 1, 2.0)
    assert tier.allocator.free_bytes == free


def test_expired_leases_give_their_space_back(tier: MemoryTier) -> None:
    now = time.monotonic()
    nbytes = fmt.extent_bytes(4000, 1)
    offset = tier.allocate(nbytes)
    assert offset is not None
    tier.reservations[1] = Reservation(
        1, b"", b"ns", b"", [b"h" * 32], [b""], [0], 0, LAYERS, offset, nbytes, now - 1
    )
    kept = tier.allocate(nbytes)
    assert kept is not None
    tier.place([Placed(meta(9), kept, 1, 0)], time.time(), dirty=False)
    tier.pin_extents([kept], time.time())
    tier.pins[2] = Pin(2, b"", b"ns", [kept], now - 1)
    tier.reservations[3] = Reservation(3, b"", b"ns", b"", [b"i" * 32], [b""], [0], 0, LAYERS, 0, 0, now + 60)
    assert tier.expire(now) == 2
    assert set(tier.reservations) == {3} and not tier.pins
    assert tier.extents[kept].pins == 0
    assert tier.allocator.free_bytes == tier.allocator.total - nbytes
    assert tier.counters.leases_expired == 2


def test_leases_belong_to_their_tenant(tier: MemoryTier) -> None:
    tier.reservations[5] = Reservation(5, b"t1/", b"ns", b"", [], [], [], 0, LAYERS, PAGE, PAGE, 1e18)
    assert tier.take_reservation(5, b"t2/") is None
    assert tier.take_reservation(5, b"t1/") is not None

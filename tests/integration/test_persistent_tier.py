"""The persistent tier's files under a real daemon: damage on disk, and the capacity bound.

Daemon processes (restarts, and the test reads and changes the store's files beside
it), both backends: LMDB as the index with payloads in segment files
(<data_dir>/lmdb/segments/seg-*), or one safetensors file per block (<data_dir>/blocks).

- A byte flipped in a stored payload, or a payload cut short (a segment file truncated
  in the middle of an extent, a block file truncated), is a miss: a read returns the
  good prefix before it and says why it stopped, never wrong bytes, the daemon keeps
  serving, and after a restart still no wrong bytes.
- Under churn (puts of several times the capacity, blocks of many sizes) the store's
  files on disk stay within --capacity (LMDB: segments and index together, from
  SMALL_CAPACITY up), and bytes_used never exceeds it.
- A restart with a smaller --capacity keeps the newest blocks and the files shrink to
  the new bound.

These tests found five bugs, fixed since: a segment cut under a mapping (a SIGBUS; the
daemon reads segments, never maps them now), reads past a mapping made short, a lookup
that kept counting an unreadable block, puts refused under churn (the store's budget is
the persistent tier's payload capacity now), and files kept past a smaller capacity
(LmdbBackend.relocate).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import pytest
import torch
from support.daemon import Daemon

from kvstore.layouts import block_path
from kvstore_client import KVStoreClient, errors
from kvstore_server.tiers.lmdb import SMALL_CAPACITY, index_reserve

from .helpers import NS, assert_same, both_backends, chain, rows

MiB = 1 << 20


# ---- the store's files ---------------------------------------------------------------------
def tier_root(daemon: Daemon) -> Path:
    return daemon.data_dir / ("lmdb" if daemon.backend == "lmdb" else "blocks")


def disk_usage(root: Path) -> tuple[int, int]:
    """(bytes the filesystem holds for every file under `root`, number of files)."""
    used = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            used += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            files += 1
    return used, files


def marker(tag: str, block: int, layer: int) -> bytes:
    return hashlib.sha256(f"persistent-tier {tag} {block} {layer}".encode()).digest()[:16]


LAYER_BYTES = 4 * 4096  # page multiples: the LMDB backend writes them direct


def recognisable(tag: str, n: int, num_layers: int = 2) -> dict[str, torch.Tensor]:
    """Each block's bytes of each layer are a marker of its own, repeated: findable on disk."""
    out = {}
    for layer in range(num_layers):
        raw = b"".join(marker(tag, b, layer) * (LAYER_BYTES // 16) for b in range(n))
        out[f"layer.{layer}"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(n, LAYER_BYTES)
    return out


def payload_files(daemon: Daemon, block_hash: bytes) -> list[Path]:
    if daemon.backend == "lmdb":
        return sorted((daemon.data_dir / "lmdb" / "segments").glob("seg-*"))
    return [block_path(daemon.data_dir / "blocks", NS.encode(), block_hash)]


def find_payload(daemon: Daemon, block_hash: bytes, needle: bytes) -> tuple[Path, int]:
    """The file and offset of the one stored copy of `needle` (the first of its repeats)."""
    found = []
    for path in payload_files(daemon, block_hash):
        content = path.read_bytes()
        at = content.find(needle)
        while at >= 0:
            if at < len(needle) or content[at - len(needle) : at] != needle:
                found.append((path, at))
            at = content.find(needle, at + len(needle))
    assert len(found) == 1, found
    return found[0]


def flip_byte(daemon: Daemon, tag: str, hashes: list[bytes], block: int, layer: int) -> None:
    path, at = find_payload(daemon, hashes[block], marker(tag, block, layer))
    with open(path, "r+b") as f:
        f.seek(at + 5)
        byte = f.read(1)
        f.seek(at + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def cut_in_block(daemon: Daemon, tag: str, hashes: list[bytes], block: int) -> Path:
    """Truncate the file holding `block`'s payload in the middle of it (its second layer)."""
    path, at = find_payload(daemon, hashes[block], marker(tag, block, 1))
    os.truncate(path, at + 1000)
    return path


def read_through_the_arena(address: str, hashes: list[bytes]) -> dict[str, torch.Tensor] | None:
    """A select through the arena (a promotion, verified by the client); None when the
    client caught bad bytes (the daemon is told and drops the block)."""
    with KVStoreClient(address, timeout=30) as kv:
        assert kv.arena_available()
        try:
            return kv.select(NS, hashes)
        except errors.LocalDataCorrupt:
            return None


# ---- damage on disk --------------------------------------------------------------------------
@both_backends
def test_a_flipped_byte_on_disk_is_a_miss_before_and_after_a_restart(make_daemon) -> None:
    d = make_daemon(capacity="64MiB")
    a, b, c = (chain(f"flip-{x}", 3) for x in "abc")
    data = {name: recognisable(name, 3) for name in ("a", "b", "c")}
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        for hashes, name in ((a, "a"), (b, "b"), (c, "c")):
            kv.put(NS, hashes, data[name])
        flip_byte(d, "a", a, block=1, layer=0)
        flip_byte(d, "b", b, block=2, layer=1)  # found only after the restart

        got = kv.select(NS, a)
        assert_same(got, rows(data["a"], 0, 1))
        assert got.stop_reason == "checksum_failed"
        assert kv.lookup(NS, a) == 1  # dropped: no longer promised
        assert kv.stats()["checksum_failures"] == 1
        assert kv.health() == "SERVING"
    assert "checksum mismatch" in d.log() and a[1].hex() in d.log()

    d.kill()
    d.start()
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        again = kv.select(NS, a)
        assert_same(again, rows(data["a"], 0, 1))
        assert again.stop_reason == "not_stored"
        through_arena = read_through_the_arena(d.address, b)  # promoted, then verified
        if through_arena is not None:
            assert_same(through_arena, rows(data["b"], 0, 2))
        got = kv.select(NS, b)
        assert_same(got, rows(data["b"], 0, 2))
        assert got.stop_reason in ("checksum_failed", "not_stored")
        assert kv.lookup(NS, b) == 2
        assert kv.stats()["checksum_failures"] >= 1
        assert_same(kv.select(NS, c), data["c"])  # untouched


@both_backends
def test_a_payload_cut_short_on_disk_is_a_miss_before_and_after_a_restart(make_daemon) -> None:
    d = make_daemon(capacity="64MiB")
    before, cut, later = chain("cut-before", 2), chain("cut", 4), chain("cut-later", 2)
    before_data, data, later_data = (
        recognisable("before", 2),
        recognisable("cut", 4),
        recognisable("later", 2),
    )
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        for hashes, layers in ((before, before_data), (cut, data), (later, later_data)):
            kv.put(NS, hashes, layers)  # LMDB: one segment, in this order
        cut_in_block(d, "cut", cut, block=2)

        got = kv.select(NS, cut)
        assert_same(got, rows(data, 0, 2))  # the good prefix, never the cut bytes
        assert got.stop_reason in ("evicted", "checksum_failed")
        # the block no tier could read left the store: a lookup stops counting it
        got = kv.select(NS, cut)
        assert_same(got, rows(data, 0, 2))
        assert got.stop_reason == "not_stored" and kv.lookup(NS, cut) == 2
        assert_same(kv.select(NS, before), before_data)  # wholly before the cut
        if d.backend == "disk":
            assert_same(kv.select(NS, later), later_data)  # a file of its own
        else:
            assert kv.select(NS, later) == {}  # wholly after the cut in the segment
        through_arena = read_through_the_arena(d.address, cut)
        if through_arena is not None:
            assert_same(through_arena, rows(data, 0, 2))
        assert kv.health() == "SERVING"
    assert d.proc is not None and d.proc.poll() is None

    d.kill()
    d.start()
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        got = kv.select(NS, cut)
        assert_same(got, rows(data, 0, 2))
        assert got.stop_reason in ("evicted", "checksum_failed", "not_stored")
        through_arena = read_through_the_arena(d.address, cut)
        if through_arena is not None:
            assert_same(through_arena, rows(data, 0, 2))
        assert_same(kv.select(NS, before), before_data)
        if d.backend == "lmdb":
            # records whose extents lie beyond the end of the segment are dropped at start
            assert "its extent is not valid; dropped" in d.log()
            assert kv.lookup(NS, cut) == 2 and kv.lookup(NS, later) == 0


def test_a_segment_cut_after_it_was_read_is_a_miss_not_a_crash(make_daemon) -> None:
    d = make_daemon(capacity="64MiB")
    cut, data = chain("cut-mapped", 4), recognisable("mapped", 4)
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        kv.put(NS, cut, data)
        assert_same(kv.select(NS, cut), data)  # the daemon maps the segment
        cut_in_block(d, "mapped", cut, block=2)

        got = kv.select(NS, cut)
        assert_same(got, rows(data, 0, 2))
        assert got.stop_reason in ("evicted", "checksum_failed")
        assert kv.health() == "SERVING"
    assert d.proc is not None and d.proc.poll() is None


@pytest.mark.parametrize(
    "backend",
    [
        "lmdb",
        "disk",
    ],
)
def test_puts_after_a_cut_was_found_read_back(make_daemon) -> None:
    d = make_daemon(capacity="64MiB")
    cut, data = chain("cut-then-put", 4), recognisable("then-put", 4)
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        kv.put(NS, cut, data)
        cut_in_block(d, "then-put", cut, block=2)
        assert kv.select(NS, cut).num_blocks == 2  # the cut is found

        fresh, fresh_data = chain("after-the-cut", 3), recognisable("after-the-cut", 3)
        assert kv.put(NS, fresh, fresh_data).blocks_written == 3
        assert kv.lookup(NS, fresh) == 3
        assert_same(kv.select(NS, fresh), fresh_data)


@both_backends
def test_lookup_stops_counting_a_block_found_cut_short(make_daemon) -> None:
    d = make_daemon(capacity="64MiB")
    cut, data = chain("cut-lookup", 4), recognisable("lookup", 4)
    with KVStoreClient(d.address, timeout=30, arena=False) as kv:
        kv.put(NS, cut, data)
        cut_in_block(d, "lookup", cut, block=2)
        got = kv.select(NS, cut)
        assert_same(got, rows(data, 0, 2))
        assert kv.lookup(NS, cut) == 2


# ---- the capacity bound on disk --------------------------------------------------------------
# bytes per block (two layers): page multiples and odd sizes
CHURN_SIZES = (64 << 10, 256 << 10, 100_003, 1 << 20, 12_345, 40_960, 4096, 777_777)
CHURN_CHAIN_BYTES = 4 * MiB


@functools.cache
def random_bytes() -> torch.Tensor:
    """8 MiB of random bytes: the churn's blocks are views of it at offsets of their own."""
    return torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))


def churn_chain(index: int) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    """Chain `index` of the churn: its hashes and layers (views of random_bytes at offsets
    of its own, so every chain's bytes differ)."""
    base = random_bytes()
    size = CHURN_SIZES[index % len(CHURN_SIZES)]
    n = max(1, min(16, CHURN_CHAIN_BYTES // size))
    layers = {}
    for layer, nbytes in enumerate((size // 2, size - size // 2)):
        at = (index * 7919 + layer * 104_729) % (len(base) - n * nbytes)
        layers[f"layer.{layer}"] = base[at : at + n * nbytes].view(n, nbytes)
    return chain(f"churn-{index}", n), layers


def assert_within_capacity(d: Daemon, kv: KVStoreClient, capacity: int) -> None:
    stats = kv.stats()
    assert stats["bytes_used"] <= stats["capacity_bytes"] == capacity
    used, files = disk_usage(tier_root(d))
    if d.backend == "lmdb":
        assert used <= capacity, (used, capacity)  # segments, index and headroom together
    else:
        # one file per stored block (the evicted ones are gone): a payload, a header, and the
        # filesystem's rounding; the capacity bounds payloads only
        assert files == stats["blocks"]
        assert used <= stats["bytes_used"] + files * 8192, (used, stats["bytes_used"], files)


@pytest.mark.parametrize(
    "backend",
    [
        "lmdb",
        "disk",
    ],
)
def test_the_files_stay_within_the_capacity_under_churn(make_daemon) -> None:
    capacity = SMALL_CAPACITY  # from here up the bound covers the index too
    assert index_reserve(capacity) > 0
    d = make_daemon(capacity=str(capacity), memory_size="16MiB")
    written = index = 0
    accepted: list[int] = []
    refused: list[tuple[int, str]] = []
    with KVStoreClient(d.address, timeout=60, arena=False) as kv:
        while written < 3 * capacity:
            hashes, layers = churn_chain(index)
            try:
                result = kv.put(NS, hashes, layers)
            except errors.CapacityExceeded as exc:  # reported at the end: the bound is checked first
                refused.append((index, str(exc)))
                assert kv.lookup(NS, hashes) == 0  # none of a refused put is stored
            else:
                assert result.blocks_written == len(hashes)
                assert kv.lookup(NS, hashes) == len(hashes)  # the newest put is always whole
                accepted.append(index)
            written += sum(t.numel() for t in layers.values())
            index += 1
            if index % 25 == 0:
                assert_within_capacity(d, kv, capacity)
        assert_within_capacity(d, kv, capacity)
        assert kv.stats()["evictions"] > 0
        for recent in accepted[-4:]:  # the newest chains read back bit-exact
            hashes, layers = churn_chain(recent)
            got = kv.select(NS, hashes)
            assert got.num_blocks == len(hashes)
            assert_same(got, layers)
        assert kv.stats()["checksum_failures"] == 0
    if refused:
        pytest.fail(
            f"{len(refused)} of {index} puts refused under churn, the first (chain {refused[0][0]}): "
            f"{refused[0][1]}"
        )


@pytest.mark.parametrize(
    "backend",
    [
        "lmdb",
        "disk",
    ],
)
def test_a_restart_with_a_smaller_capacity_keeps_the_newest_blocks_and_shrinks_the_files(
    make_daemon,
) -> None:
    # below SMALL_CAPACITY the LMDB backend bounds its payloads (the segment files) only
    big, small = 128 * MiB, 48 * MiB
    assert index_reserve(big) == index_reserve(small) == 0
    d = make_daemon(capacity=str(big), memory_size="16MiB")
    block = 1 * MiB  # two layers of 512 KiB
    chains = [chain(f"shrink-{i}", 4) for i in range(28)]  # 112 MiB: all fit

    def layers_of(i: int) -> dict[str, torch.Tensor]:
        base, nbytes = random_bytes(), block // 2
        starts = [(i * 7919 + k * 104_729) % (len(base) - 4 * nbytes) for k in range(2)]
        return {f"layer.{k}": base[at : at + 4 * nbytes].view(4, nbytes) for k, at in enumerate(starts)}

    with KVStoreClient(d.address, timeout=60, arena=False) as kv:
        for i, hashes in enumerate(chains):
            assert kv.put(NS, hashes, layers_of(i)).blocks_written == 4
        assert kv.stats()["evictions"] == 0
    payloads = tier_root(d) / "segments" if d.backend == "lmdb" else tier_root(d)
    before, _ = disk_usage(payloads)
    assert before >= 112 * MiB

    d.stop()
    d.capacity = str(small)
    d.start()
    kept = small // (4 * block)  # whole chains: 12
    with KVStoreClient(d.address, timeout=60, arena=False) as kv:
        stats = kv.stats()
        assert stats["capacity_bytes"] == small and stats["bytes_used"] <= small
        assert stats["blocks"] == kept * 4
        lengths = [kv.lookup(NS, hashes) for hashes in chains]
        assert lengths == [0] * (len(chains) - kept) + [4] * kept  # the newest stay
        for i in range(len(chains) - kept, len(chains)):
            assert_same(kv.select(NS, chains[i]), layers_of(i))
        after, files = disk_usage(payloads)
        assert after < before
        if d.backend == "lmdb":
            assert after <= small, (
                f"{after / MiB:.0f} MiB of segment files for a capacity of {small // MiB} MiB"
            )
        else:  # the evicted blocks' files are gone; the capacity bounds payloads, not headers
            assert files == stats["blocks"]
            assert after <= stats["bytes_used"] + files * 8192

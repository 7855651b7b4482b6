"""The memory tier against a real daemon: reserve/commit/abort, leases, pins, write-behind,
promotion, recovery after SIGKILL, corruption, tenancy. Clients map the real arena file."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from support.daemon import eventually, settled
from support.inproc import InProcServer
from support.ports import free_port

from kvstore import arena_format as fmt
from kvstore.blocks import WSUM32, wsum32
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import Chain, KVStoreClient, LayerSpec, _control, errors
from kvstore_client.arena.load import Pinned
from kvstore_server.auth import tenant_prefix
from kvstore_server.tiers.chain import Promotion

from .helpers import NS, assert_same, both_backends, chain, make_layers, rows
from .test_metrics import calls, scrape


def specs(layers: dict[str, torch.Tensor]) -> list[LayerSpec]:
    return [LayerSpec.of(name, t) for name, t in layers.items()]


def save(kv: KVStoreClient, hashes: list[bytes], layers: dict[str, torch.Tensor], parent: bytes = b"") -> int:
    """Save through the arena (reserve, write, commit); the blocks written."""
    res = kv.reserve(NS, hashes, specs(layers), parent_hash=parent)
    assert res is not None, "the arena is not in use"
    if not res.blocks:
        return 0
    for i, (name, tensor) in enumerate(layers.items()):
        res.layer(i).copy_(tensor[res.blocks])
        assert res.layer(name).shape == (len(res.blocks), *tensor.shape[1:])
    return int(res.commit().blocks_written)


def read_out(pinned: Pinned, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pin's bytes of each of `layers`, every block, as one tensor a layer."""
    return {name: torch.cat([view for _, view in pinned.pieces(i)]) for i, name in enumerate(layers)}


@pytest.fixture
def arena_kv(server: InProcServer):
    with KVStoreClient(server.address, timeout=20.0, arena=True) as client:
        assert client.arena_available()
        yield client


@pytest.fixture
def grpc_kv(server: InProcServer):
    with KVStoreClient(server.address, timeout=20.0, arena=False) as client:
        yield client


def test_a_save_through_the_arena_is_visible_everywhere_bit_exact(
    arena_kv: KVStoreClient, grpc_kv: KVStoreClient
) -> None:
    hashes, layers = chain("save", 6), make_layers(6)
    assert save(arena_kv, hashes, layers) == 6
    assert grpc_kv.lookup(NS, hashes) == 6
    assert_same(grpc_kv.select(NS, hashes), layers)  # over gRPC: the daemon reads the arena
    stream = arena_kv.get_stream(NS, hashes)
    assert stream.via == "arena"
    assert_same(stream.read_all(), layers)
    stats = grpc_kv.stats()
    assert stats["memory_blocks"] == 6 and stats["commits"] == 1
    # the load's Release goes out in the background (Pinned.finish)
    eventually(lambda: grpc_kv.stats()["pinned_bytes"] == 0)


def test_a_load_through_the_arena_says_why_it_stops(arena_kv: KVStoreClient) -> None:
    hashes = chain("arena-layer-sets", 3)
    both = make_layers(3, num_layers=2, seed=26)
    assert save(arena_kv, hashes[:1], rows(both, 0, 1)) == 1
    assert save(arena_kv, hashes[1:2], {"layer.0": both["layer.0"][1:2].contiguous()}, parent=hashes[0]) == 1

    assert arena_kv.lookup(NS, hashes) == 2
    stream = arena_kv.get_stream(NS, hashes)  # what select reads: a pin
    assert (stream.via, stream.num_blocks, stream.stop_reason) == ("arena", 1, "layer_set_differs")
    assert_same(stream.read_all(), rows(both, 0, 1))
    got = arena_kv.select(NS, hashes)
    assert_same(got, rows(both, 0, 1))
    assert (got.num_blocks, got.stop_reason) == (1, "layer_set_differs")
    short = arena_kv.select(NS, [hashes[0], hashes[2]])
    assert (short.num_blocks, short.stop_reason) == (1, "not_stored")


def test_reserve_skips_stored_blocks_and_commit_reports_them(arena_kv: KVStoreClient) -> None:
    hashes, layers = chain("skip", 5), make_layers(5)
    assert save(arena_kv, hashes[:2], rows(layers, 0, 2)) == 2
    res = arena_kv.reserve(NS, hashes, specs(layers))
    assert res is not None and res.blocks == [2, 3, 4]
    for i, tensor in enumerate(layers.values()):
        res.layer(i).copy_(tensor[res.blocks])
    result = res.commit()
    assert (result.blocks_written, result.blocks_skipped) == (3, 2)
    assert_same(arena_kv.select(NS, hashes), layers)
    everything = arena_kv.reserve(NS, hashes, specs(layers))
    assert everything is not None and everything.blocks == []  # nothing to write, no lease


def test_put_stream_and_insert_use_the_arena(arena_kv: KVStoreClient, grpc_kv: KVStoreClient) -> None:
    hashes, layers = chain("stream", 4), make_layers(4, num_layers=3)
    with arena_kv.put_stream(NS, hashes, specs(layers)) as stream:
        for name, tensor in layers.items():
            stream.write_layer(name, tensor)
        assert stream.commit().blocks_written == 4
    more, extra = chain("insert", 3), make_layers(3, num_layers=3, seed=1)
    assert arena_kv.insert(NS, more, extra).result().blocks_written == 3
    assert grpc_kv.stats()["commits"] == 2 and grpc_kv.stats()["puts"] == 2
    assert_same(grpc_kv.select(NS, hashes), layers)
    assert_same(grpc_kv.select(NS, more), extra)


def test_abort_leaves_nothing_and_gives_the_space_back(arena_kv: KVStoreClient) -> None:
    hashes, layers = chain("abort", 3), make_layers(3)
    res = arena_kv.reserve(NS, hashes, specs(layers))
    assert res is not None
    assert arena_kv.stats()["reserved_bytes"] > 0
    res.layer(0).copy_(layers["layer.0"])
    res.abort()
    stats = arena_kv.stats()
    assert (stats["reserved_bytes"], stats["memory_used_bytes"], stats["aborts"]) == (0, 0, 1)
    assert arena_kv.lookup(NS, hashes) == 0
    with pytest.raises(errors.BlockNotFound, match="no reservation"):
        res.commit()


def test_a_commit_with_the_wrong_number_of_checksums_is_refused(arena_kv: KVStoreClient) -> None:
    hashes, layers = chain("sums", 2), make_layers(2)
    res = arena_kv.reserve(NS, hashes, specs(layers))
    assert res is not None
    with pytest.raises(errors.InvalidRequest, match="checksums"):
        res.commit([1, 2, 3])
    assert arena_kv.lookup(NS, hashes) == 0
    assert res.commit() is not None  # the reservation is still there: a correct commit works


def test_an_uncommitted_reservation_is_reclaimed_after_its_lease(make_server) -> None:
    d = make_server(lease_seconds=0.5)
    with KVStoreClient(d.address, arena=True) as kv:
        hashes, layers = chain("lease", 3), make_layers(3)
        res = kv.reserve(NS, hashes, specs(layers))
        assert res is not None and res.lease_seconds == 0.5
        eventually(lambda: kv.stats()["leases_expired"] == 1)
        stats = kv.stats()
        assert (stats["reserved_bytes"], stats["memory_used_bytes"]) == (0, 0)
        with pytest.raises(errors.BlockNotFound):
            res.commit()
        assert kv.lookup(NS, hashes) == 0


def test_a_client_killed_mid_save_leaves_nothing_visible_and_no_space_lost(make_server) -> None:
    d = make_server(lease_seconds=1.0)
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from integration.helpers import NS, chain, make_layers
        from kvstore_client import KVStoreClient, LayerSpec
        kv = KVStoreClient({d.address!r}, arena=True)
        layers = make_layers(4)
        res = kv.reserve(NS, chain("killed", 4), [LayerSpec.of(n, t) for n, t in layers.items()])
        res.layer(0).copy_(layers["layer.0"])
        print("reserved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and "reserved" in proc.stdout, proc.stderr
    with KVStoreClient(d.address, arena=True) as kv:
        assert kv.lookup(NS, chain("killed", 4)) == 0
        eventually(lambda: kv.stats()["memory_used_bytes"] == 0)
        assert kv.stats()["leases_expired"] == 1


def test_finish_ends_a_held_pin_in_the_background_and_reports_a_lapsed_one(make_server) -> None:
    d = make_server(lease_seconds=1.0)
    hashes, layers = chain("finish", 2), make_layers(2)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 2
        held = kv.pin(NS, hashes)
        assert held is not None and held.held()
        assert held.finish()  # no wait for the daemon's answer...
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)  # ...which ends the pin all the same
        lapsed = kv.pin(NS, hashes)
        assert lapsed is not None
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)  # its lease ran out at the daemon
        assert not lapsed.held()  # the client's deadline counts from before the Pin was sent
        assert not lapsed.finish()  # so it asks, and hears the pin was gone


def test_pins_hold_off_eviction_until_released_or_expired(make_server) -> None:
    # an arena of 16 pages (one is the header): room for two extents of 7 pages
    d = make_server(memory=16 * fmt.ALIGN, lease_seconds=1.5)
    layers = make_layers(7, num_layers=1, shape=(fmt.ALIGN,), dtype=torch.uint8)
    with KVStoreClient(d.address, arena=True) as kv:
        a, b, c = chain("pin-a", 7), chain("pin-b", 7), chain("pin-c", 7)
        assert save(kv, a, layers) == 7
        # the write-behind queue holds 8 pages (half the arena): a must be written behind
        # before b is committed, or most of b would stay in memory only
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
        assert save(kv, b, make_layers(7, num_layers=1, shape=(fmt.ALIGN,), dtype=torch.uint8, seed=2)) == 7
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)  # both may leave the arena now
        assert kv.stats()["write_behind_dropped"] == 0
        pinned = kv.pin(NS, a)
        assert pinned is not None and pinned.num_blocks == 7
        other = kv.pin(NS, b)
        assert other is not None
        with pytest.raises(errors.CapacityExceeded, match="pinned"):
            kv.reserve(NS, c, specs(layers))  # both extents are pinned: nothing may go
        assert other.release()
        assert save(kv, c, layers) == 7  # b's extent was evicted (b stays in the persistent tier)
        assert torch.equal(pinned.pieces(0)[0][1], layers["layer.0"])  # a's bytes untouched
        assert pinned.verify() is None
        assert kv.stats()["pinned_bytes"] > 0
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)  # a's lease ran out
        assert not pinned.release()  # too late: the bytes may have been reused
        assert kv.lookup(NS, b) == 7  # evicted from memory, still stored


@both_backends
def test_write_behind_reaches_the_persistent_tier_and_loads_promote(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    hashes, layers = chain("behind", 5), make_layers(5)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 5
        eventually(lambda: kv.stats()["written_behind"] == 5)
        arena_path = kv.arena_path
    assert arena_path is not None
    d.kill()
    arena_path.unlink()  # what a reboot does to /dev/shm
    d.start()
    with KVStoreClient(d.address, arena=True) as kv:
        stats = kv.stats()
        assert (stats["blocks"], stats["memory_blocks"]) == (5, 0)
        stream = kv.get_stream(NS, hashes)
        assert stream.via == "arena"
        assert_same(stream.read_all(), layers)
        stats = kv.stats()
        assert (stats["promotions"], stats["promoted_blocks"], stats["memory_blocks"]) == (1, 5, 5)
        assert stats["persistent_hit_blocks"] == 5


def _only_in_the_persistent_tier(d, hashes: list[bytes], layers: dict[str, torch.Tensor]) -> None:
    """Store `layers` through the arena, wait until written behind, then kill the daemon and
    remove its arena: after the restart, only the persistent tier holds them."""
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == len(hashes)
        eventually(lambda: kv.stats()["written_behind"] == len(hashes))
        arena_path = kv.arena_path
    assert arena_path is not None
    d.kill()
    arena_path.unlink()
    d.start()


@both_backends
def test_a_cold_pin_answers_before_its_blocks_are_read_and_reports_layers_as_they_land(make_daemon) -> None:
    """PinStream: the answer comes with no layer in place, then the leading layers by group
    (each block's first layers are read first, for every block), so a loader starts on
    the first layers while the rest is read; the bytes of a ready layer are final."""
    d = make_daemon()
    # 16 layers of 1 MiB per block: 16 MiB a block, read in 4 groups of 4 layers (4 MiB reads)
    hashes, layers = chain("stream", 2), make_layers(2, num_layers=16, shape=(4096, 128), dtype=torch.float16)
    _only_in_the_persistent_tier(d, hashes, layers)
    with KVStoreClient(d.address, arena=True) as kv:
        pinned = kv.pin(NS, hashes, stream=True)
        assert pinned is not None and pinned.num_blocks == 2
        assert pinned.ready_layers == 0  # nothing was in memory
        seen = []
        for layer in range(16):
            pinned.wait_layers(layer + 1)
            seen.append(pinned.ready_layers)
            assert pinned.verify([layer]) is None  # a ready layer is whole in every block
        assert sorted(set(seen)) == [4, 8, 12, 16]  # group by group, first layers first
        assert_same(read_out(pinned, layers), layers)
        pinned.release()
        again = kv.pin(NS, hashes, stream=True)  # now in memory: all there at once
        assert again is not None and again.ready_layers == 16
        again.release()
        stats = kv.stats()
        assert (stats["promoted_blocks"], stats["promoted_bytes"]) == (2, 2 * 16 * 1024 * 1024)
        assert stats["persistent_read_rate"] > 0


@both_backends
def test_a_lookup_that_prefetches_reads_the_cold_prefix_into_memory_before_any_pin(make_daemon) -> None:
    """Lookup with prefetch (the scheduler side's, a step before its workers load): the
    prefix's blocks that only the persistent tier holds are read into the memory tier
    without a pin and without the lookup waiting for them; the pin after them finds them
    all in memory and promotes nothing itself. A probe lookup may not prefetch."""
    d = make_daemon()
    hashes, layers = chain("prefetch", 4), make_layers(4, num_layers=4, shape=(256, 128), dtype=torch.float16)
    _only_in_the_persistent_tier(d, hashes, layers)
    with KVStoreClient(d.address, arena=True) as kv:
        assert kv.stats()["memory_blocks"] == 0
        where = kv.where(NS, hashes[:3], lease_from=1, prefetch=True)
        assert (where.num_blocks, where.prefetching) == (3, 2)  # blocks [1, 3)
        eventually(lambda: kv.stats()["memory_blocks"] == 2)  # no pin asked for them
        stats = kv.stats()
        assert (stats["promoted_blocks"], stats["prefetched_blocks"], stats["pins"]) == (2, 2, 0)
        assert kv.where(NS, hashes[:3], lease_from=1, prefetch=True).prefetching == 0  # in memory now
        assert kv.where(NS, hashes, prefetch=True).prefetching == 2  # blocks 0 and 3
        eventually(lambda: kv.stats()["memory_blocks"] == 4)
        pinned = kv.pin(NS, hashes, stream=True)
        assert pinned is not None and pinned.num_blocks == 4 and pinned.ready_layers == 4  # all in memory
        assert_same(read_out(pinned, layers), layers)
        assert pinned.release()
        stats = kv.stats()
        assert (stats["promoted_blocks"], stats["prefetched_blocks"], stats["memory_hit_blocks"]) == (4, 4, 4)
        with pytest.raises(errors.InvalidRequest, match="probe"):
            kv._rpc.unary(
                kv._rpc.lookup,
                pb.LookupRequest(namespace=NS.encode(), block_hashes=hashes, probe=True, prefetch=True),
                10,
            )


@both_backends
def test_a_cold_pin_reports_blocks_read_whole_as_they_land(make_daemon) -> None:
    """Blocks up to 4 MiB are read whole, in tasks of a few MiB: PinStream reports them as
    they land (ready_blocks, about every 8 MiB), in order, after the blocks that were in
    memory, so a loader copies the first blocks while the daemon reads the rest; a ready
    block's every layer is final while the last layers of the others are not in yet
    (ready_layers 0)."""
    d = make_daemon()
    # 16 layers of 256 KiB: 4 MiB a block, one group, a task each; 6 blocks
    hashes, layers = chain("blocks", 6), make_layers(6, num_layers=16, shape=(1024, 128), dtype=torch.float16)
    _only_in_the_persistent_tier(d, hashes, layers)
    with KVStoreClient(d.address, arena=True) as kv:
        kv.pin(NS, hashes[:2]).release()  # the first two promoted: in memory now
        pinned = kv.pin(NS, hashes, stream=True)
        assert pinned is not None and pinned.num_blocks == 6
        assert (pinned.ready_layers, pinned.ready_blocks) == (0, 2)
        seen = []
        for count in range(1, 7):
            pinned.wait_blocks(count)
            seen.append((pinned.ready_layers, pinned.ready_blocks))
            for i, name in enumerate(layers):  # the ready blocks' bytes are final
                got = torch.cat([view for _, view in pinned.pieces(i)])[: pinned.ready_blocks]
                want = layers[name][: pinned.ready_blocks]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bits: NaNs too
        # in order, in chunks of the read (one block or a few, by backend), and no layer of
        # every block in place until the last block is
        blocks = [b for _, b in seen]
        assert blocks == sorted(blocks) and all(b >= count for count, b in enumerate(blocks, 1))
        assert any(2 < b < 6 for b in blocks) and seen[-1] == (16, 6)
        assert all(layer == (16 if b == 6 else 0) for layer, b in seen)
        pinned.release()


def test_a_loader_has_a_cold_pins_last_blocks_before_the_daemon_places_them(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon places the blocks a streamed Pin read (Promotion.finish) after its last
    report and before it ends the stream: the loader copies the last blocks meanwhile.
    Placement held here: the loader still has every block, bit-exact, before it is
    placed, and its finish does not wait for the stream's end (the connection closes
    instead). Where the end has come by then, the connection goes back to the pool."""
    s = make_server()
    first, second = chain("tail", 4), chain("tail-2", 4)
    layers = make_layers(4, num_layers=4, shape=(256, 128), dtype=torch.float16)
    with KVStoreClient(s.address, arena=True) as kv:
        assert save(kv, first, layers) == 4 and save(kv, second, layers) == 4
        eventually(lambda: kv.stats()["written_behind"] == 8)
    s.restart()  # every block written behind: the arena went with the clean stop
    order: list[str] = []
    placing = threading.Event()
    plain_finish = Promotion.finish

    def held(promotion: Promotion) -> object:
        placing.wait(5)
        order.append("placed")
        return plain_finish(promotion)

    monkeypatch.setattr(Promotion, "finish", held)
    monkeypatch.setattr(_control, "_FINISH_WAIT", 10.0)  # a loader that waited for the end: it shows
    with KVStoreClient(s.address, arena=True) as kv:
        assert kv.stats()["memory_blocks"] == 0  # only the persistent tier holds them
        pinned = kv.pin(NS, first, stream=True)
        assert pinned is not None and (pinned.num_blocks, pinned.ready_blocks) == (4, 0)
        pinned.wait_blocks(4)
        order.append("loader has every block")
        assert_same(read_out(pinned, layers), layers)
        pool = kv._rpc.control
        assert pool is not None
        stream = pinned._progress._conn  # type: ignore[union-attr]
        assert pinned.finish()  # the placement still held: the end has not come
        order.append("loader done")
        assert stream not in pool._idle
        placing.set()
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)
        assert kv.stats()["memory_blocks"] == 4

        pinned = kv.pin(NS, second, stream=True)  # placed at once (the event is set)
        assert pinned is not None
        pinned.wait_blocks(4)
        stream = pinned._progress._conn  # type: ignore[union-attr]
        assert select.select([stream.sock], [], [], 10)[0]  # the end has come (after the placement)
        assert pinned.release()
        assert stream in pool._idle  # read to its end: pooled (and the Release's, since)
        assert kv.stats()["memory_blocks"] == 8
    assert order == ["loader has every block", "loader done", "placed", "placed"]


def test_a_cold_pin_whose_read_fails_ends_incomplete_and_never_serves_the_bytes(make_daemon) -> None:
    """A segment cut short under a record: the stream ends before the layers are reported
    ready (LoadIncomplete); a plain load of the prefix then stops before the bad block."""
    d = make_daemon()
    hashes, layers = chain("cut", 2), make_layers(2, num_layers=16, shape=(256, 128), dtype=torch.float16)
    _only_in_the_persistent_tier(d, hashes, layers)
    [segment] = sorted((d.data_dir / "lmdb" / "segments").glob("seg-*"))
    os.truncate(segment, 1 << 20)  # the first block (1 MiB at offset 0) stays whole
    with KVStoreClient(d.address, arena=True) as kv:
        pinned = kv.pin(NS, hashes, stream=True)
        assert pinned is not None and pinned.num_blocks == 2
        with pytest.raises(errors.LoadIncomplete):
            pinned.wait_layers(16)
        assert pinned.ready_layers < 16
        pinned.release()
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)
        assert_same(kv.select(NS, hashes[:1]), rows(layers, 0, 1))


@both_backends
def test_committed_blocks_survive_a_daemon_sigkill_before_write_behind(make_daemon) -> None:
    # write_behind_bytes 1: nothing is queued behind, so the arena alone holds the blocks
    d = make_daemon(extra_args=["--write-behind-bytes", "1"])
    hashes, layers = chain("sigkill", 4), make_layers(4)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 4
        assert kv.stats()["write_behind_dropped"] == 4
    d.kill()
    d.start()
    with KVStoreClient(d.address, arena=True) as kv:
        assert kv.stats()["memory_blocks"] == 4 and kv.lookup(NS, hashes) == 4
        assert_same(kv.select(NS, hashes), layers)
    with KVStoreClient(d.address, arena=False) as kv:
        assert_same(kv.select(NS, hashes), layers)


@both_backends
def test_a_torn_reservation_is_not_recovered(make_daemon) -> None:
    d = make_daemon()
    hashes, layers = chain("torn", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as kv:
        res = kv.reserve(NS, hashes, specs(layers))
        assert res is not None
        res.layer(0).copy_(layers["layer.0"])
    d.kill()
    d.start()
    with KVStoreClient(d.address, arena=True) as kv:
        stats = kv.stats()
        assert (stats["blocks"], stats["memory_used_bytes"]) == (0, 0)


def test_a_flipped_byte_fails_the_load_and_the_daemon_drops_the_block(make_server) -> None:
    d = make_server(write_behind_bytes=1)  # only the arena has them
    hashes, layers = chain("flip", 4), make_layers(4)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 4
        pinned = kv.pin(NS, hashes)
        assert pinned is not None
        view = pinned.block_view(2, 1)
        view[5] ^= 0xFF  # any process that maps the arena can do this
        assert pinned.verify() == 2
        pinned.release()
        with pytest.raises(errors.LocalDataCorrupt, match="fails its checksum"):
            kv.get_stream(NS, hashes).read_all()
        assert kv.lookup(NS, hashes) == 2  # dropped: block 2 is recomputed by the next load
        assert kv.stats()["checksum_failures"] == 1
        assert_same(kv.select(NS, hashes), rows(layers, 0, 2))


def test_the_daemon_verifies_arena_bytes_before_serving_them_over_grpc(make_server) -> None:
    d = make_server(write_behind_bytes=1)
    hashes, layers = chain("flip-grpc", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as kv, KVStoreClient(d.address, arena=False) as remote:
        assert save(kv, hashes, layers) == 3
        pinned = kv.pin(NS, hashes)
        assert pinned is not None
        pinned.block_view(1, 0)[0] ^= 1
        pinned.release()
        assert_same(remote.select(NS, hashes), rows(layers, 0, 1))
        assert remote.lookup(NS, hashes) == 1


def test_a_daemon_without_a_memory_tier_is_used_over_grpc(make_server) -> None:
    d = make_server(memory=0)
    hashes, layers = chain("nomem", 2), make_layers(2)
    with KVStoreClient(d.address, arena=True) as kv:
        assert not kv.arena_available()
        assert kv.reserve(NS, hashes, specs(layers)) is None
        kv.put(NS, hashes, layers)
        stream = kv.get_stream(NS, hashes)
        assert stream.via == "grpc"
        assert_same(stream.read_all(), layers)
        assert "memory_blocks" not in kv.stats() or kv.stats()["memory_blocks"] == 0


def test_the_arena_file_is_private_to_the_daemons_user(arena_kv: KVStoreClient) -> None:
    path = arena_kv.arena_path
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert fmt.Header.unpack(path.read_bytes()[: fmt.HEADER_BYTES]).size == path.stat().st_size


def mappings(path: Path) -> int:
    """How many mappings of `path` this process has (removed file or not)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().removesuffix(" (deleted)").endswith(str(path)))


def _reachable(kv: KVStoreClient) -> bool:
    try:
        return kv.health() == "SERVING"
    except errors.StoreUnavailable:
        return False


def test_clients_share_one_mapping_and_the_last_to_let_go_unmaps_it(make_daemon) -> None:
    port = free_port()
    d = make_daemon(extra_args=["--listen", f"127.0.0.1:{port}"])  # restarts keep the address
    hashes, layers = chain("unmap", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as a, KVStoreClient(d.address, arena=True) as b:
        assert save(a, hashes, layers) == 3
        assert_same(b.select(NS, hashes), layers)
        path = a.arena_path
        assert path is not None and b.arena_path == path
        assert mappings(path) == 1  # one per process
        a.close()
        assert mappings(path) == 1  # b still uses it
        d.restart()  # a new daemon run: the same file, a new run id
        eventually(lambda: _reachable(b))  # b's channel may be backing off from the old run
        assert_same(b.select(NS, hashes), layers)
        assert b.arena_path == path
        assert mappings(path) == 1  # b let go of the previous run's mapping
    assert mappings(path) == 0  # and closing b unmapped this run's


def test_after_a_clean_restart_a_client_maps_the_new_arena_and_reports_nothing_corrupt(make_daemon) -> None:
    """A clean stop removes the arena file and the next run makes a new one at the same
    path: a client still mapping the old file must see that (its header still names the
    old run), not read the new run's offsets from the old pages and call good blocks
    corrupt (the daemon would drop them)."""
    d = make_daemon(extra_args=["--listen", f"127.0.0.1:{free_port()}"])  # restarts keep the address
    hashes, layers = chain("new-file", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 3
        old = kv.arena_mapping()
        assert old is not None
        d.restart()
        eventually(lambda: _reachable(kv))
        assert_same(kv.select(NS, hashes), layers)
        assert kv.arena_mapping() is not old
        stats = kv.stats()
        assert stats["checksum_failures"] == 0
        assert kv.lookup(NS, hashes) == 3  # nothing dropped


def test_tenants_keep_the_arena_off_unless_asked(make_server, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[tokens]]\ntoken = "secret-a-0123456789abcdef"\ntenant = "a"\nrole = "writer"\n')
    os.chmod(tokens, 0o600)
    off = make_server("off", token_file=tokens)
    with KVStoreClient(off.address, token="secret-a-0123456789abcdef", arena=True) as kv:
        assert not kv.arena_available()
        with pytest.raises(errors.NotOffered, match="tenants"):
            kv.arena_access()
    on = make_server("on", token_file=tokens, memory_clients=True)
    with KVStoreClient(on.address, token="secret-a-0123456789abcdef", arena=True) as kv:
        hashes, layers = chain("tenant", 2), make_layers(2)
        assert save(kv, hashes, layers) == 2
        assert_same(kv.select(NS, hashes), layers)
        assert kv.arena_access().namespace_prefix == tenant_prefix("a")


@both_backends
def test_a_save_checksummed_on_a_gpu_is_verified_and_written_behind_with_its_sums(make_daemon) -> None:
    """What the connector commits from CUDA: wsum32 sums (a GPU computes them on the gathered
    blocks); every reader verifies them, and the persistent tier keeps them, so a load of a
    promoted block is verified on the GPU again (not with xxh3 on the host)."""
    d = make_daemon()
    hashes, layers = chain("wsum", 4), make_layers(4)
    with KVStoreClient(d.address) as kv:
        res = kv.reserve(NS, hashes, specs(layers))
        assert res is not None
        for i, tensor in enumerate(layers.values()):
            res.layer(i).copy_(tensor)
        sums = [
            wsum32(p) for block in range(4) for p in (res.layer_pieces(i)[block] for i in range(len(layers)))
        ]
        with pytest.raises(errors.InvalidRequest, match="checksum kind"):
            res.commit(sums, kind="crc7")
        assert res.commit(sums, kind=WSUM32).blocks_written == 4
        pinned = kv.pin(NS, hashes)
        assert pinned is not None and pinned.kinds == [WSUM32] * 4 and pinned.verify() is None
        pinned.release()
        assert_same(kv.select(NS, hashes), layers)  # verified with wsum32 on this path
        eventually(lambda: kv.stats()["written_behind"] == 4)
        path = kv.arena_path
    with KVStoreClient(d.address, arena=False) as remote:
        assert_same(remote.select(NS, hashes), layers)  # the daemon verifies them too
    d.kill()
    assert path is not None
    path.unlink()  # only the persistent tier's copy is left: its records say wsum32
    d.start()
    with KVStoreClient(d.address) as kv:
        pinned = kv.pin(NS, hashes)  # promoted from the persistent tier
        assert pinned is not None and pinned.kinds == [WSUM32] * 4 and pinned.verify() is None
        pinned.release()
        assert_same(kv.select(NS, hashes), layers)


def test_reserve_and_commit_many_answer_each_as_one_call_would_in_one_round_trip(make_server) -> None:
    """A step's saves reserved together: each chain gets its own reservation, or its own
    refusal (a cycle, a save over max_put_bytes), and a refused chain reserves nothing
    and stops no other; a chain stored already needs no blocks."""
    d = make_server(max_put_bytes="16KiB", metrics_port=0)
    layers = make_layers(2)  # 2 layers of 2 x 4 x 8 float16: 256 bytes a block
    stored, fresh, cyclic = chain("many-stored", 2), chain("many-fresh", 3), chain("many-cycle", 2)
    big = chain("many-big", 80)  # 20 KiB
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, stored, {n: t[:2] for n, t in layers.items()}) == 2
        before = scrape(d.metrics_url)
        answers = kv.reserve_many(
            NS,
            [Chain(fresh), Chain(cyclic, parent_hash=cyclic[1]), Chain(big), Chain(stored)],
            specs(layers),
        )
        after = scrape(d.metrics_url)
        assert answers is not None and len(answers) == 4
        assert calls(after, "ReserveMany") - calls(before, "ReserveMany") == 1
        assert calls(after, "Reserve") == calls(before, "Reserve")
        first, cycle, too_big, none_needed = answers
        assert isinstance(cycle, errors.InvalidRequest) and "no cycles" in str(cycle)
        assert isinstance(too_big, errors.CapacityExceeded) and "max_put_bytes" in str(too_big)
        assert not isinstance(none_needed, Exception) and none_needed.blocks == []
        assert not isinstance(first, Exception) and first.blocks == [0, 1, 2]
        source = make_layers(3, seed=4)
        for i, name in enumerate(layers):
            first.layer(i).copy_(source[name])
        # committed together: the reservation, one with too few checksums, one never made
        other = kv.reserve_many(NS, [Chain(chain("many-other", 1))], specs(layers))
        assert other is not None and not isinstance(other[0], Exception)
        gone = kv.reserve(NS, chain("many-gone", 1), specs(layers))
        assert gone is not None
        gone.abort()
        gone.done = False  # committed anyway below: the daemon no longer holds it
        before = scrape(d.metrics_url)
        committed, short, unknown = kv.commit_many(
            [(first, None, "xxh3"), (other[0], [1], "xxh3"), (gone, None, "xxh3")]
        )
        assert calls(scrape(d.metrics_url), "CommitMany") - calls(before, "CommitMany") == 1
        assert not isinstance(committed, Exception) and committed.blocks_written == 3
        assert isinstance(short, errors.InvalidRequest) and "checksums" in str(short)
        other[0].abort()  # a refused commit's reservation is the client's to give back
        assert isinstance(unknown, errors.BlockNotFound) and "no reservation" in str(unknown)
        assert kv.lookup(NS, fresh) == 3 and kv.lookup(NS, cyclic) == 0 and kv.lookup(NS, big) == 0
        assert_same(kv.select(NS, fresh), source)
        assert kv.stats()["reserved_bytes"] == 0  # nothing held for the refused chains or commits
        with pytest.raises(errors.InvalidRequest, match="chains; the limit"):
            kv.reserve_many(NS, [Chain([h]) for h in chain("many-limit", 1025)], specs(layers))


def test_reserve_and_commit_many_against_a_daemon_without_them_go_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client newer than its daemon (one without ReserveMany, CommitMany and PinMany:
    UNIMPLEMENTED) still gets one answer per chain and per commit, from a Reserve, a
    Commit or a Pin each."""
    import grpc

    import kvstore_server.main as daemon_main
    from kvstore.service import SERVICE_NAME
    from kvstore_server.rpc import generic_handler

    def older(servicer):  # the daemon's handlers without ReserveMany
        handlers = {
            name: handler
            for name, handler in generic_handler(servicer)._method_handlers.items()
            if not name.endswith(("/ReserveMany", "/CommitMany", "/PinMany"))
        }
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME, {n.rsplit("/", 1)[1]: h for n, h in handlers.items()}
        )

    monkeypatch.setattr(daemon_main, "generic_handler", older)
    server = InProcServer(tmp_path / "old", settings={"metrics_port": 0}).start()
    try:
        layers = make_layers(2)
        a, b = chain("old-a", 2), chain("old-b", 1)
        with KVStoreClient(server.address, arena=True) as kv:
            before = scrape(server.metrics_url)
            answers = kv.reserve_many(NS, [Chain(a), Chain(b, parent_hash=b[0])], specs(layers))
            after = scrape(server.metrics_url)
            assert answers is not None
            assert calls(after, "Reserve") - calls(before, "Reserve") == 1  # the good chain
            first, second = answers
            assert isinstance(second, errors.InvalidRequest)
            assert not isinstance(first, Exception) and first.blocks == [0, 1]
            for i, name in enumerate(layers):
                first.layer(i).copy_(layers[name])
            (result,) = kv.commit_many([(first, None, "xxh3")])  # a Commit of each
            assert not isinstance(result, Exception) and result.blocks_written == 2
            assert calls(scrape(server.metrics_url), "Commit") == 1
            assert_same(kv.select(NS, a), layers)
            pins = kv.pin_many(NS, [a, [b"short"]])  # a Pin each
            assert pins is not None and isinstance(pins[1], errors.InvalidRequest)
            assert not isinstance(pins[0], Exception) and pins[0].num_blocks == 2
            pins[0].release()
    finally:
        server.stop()


@both_backends
def test_pin_many_pins_each_chain_promoting_the_cold_ones_and_refuses_a_bad_one_alone(make_daemon) -> None:
    """A step's loads pinned together: a chain in memory, one only the persistent tier
    holds (promoted before the answer: all its layers in place), a miss, and a malformed
    chain refused on its own; each pin holds and releases like a Pin."""
    d = make_daemon()
    hashes, layers = chain("many-pins", 6), make_layers(6, seed=5)
    _only_in_the_persistent_tier(d, hashes[:3], rows(layers, 0, 3))
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes[3:], rows(layers, 3, 6), parent=hashes[2]) == 3
        settled(kv)
        pins = kv.pin_many(NS, [hashes[3:], hashes[:3], chain("many-pins-miss", 2), [b"not a hash"]])
        assert pins is not None and len(pins) == 4
        hot, cold, miss, bad = pins
        assert isinstance(bad, errors.InvalidRequest)
        assert not isinstance(miss, Exception) and miss.num_blocks == 0
        for pinned, first in ((hot, 3), (cold, 0)):
            assert not isinstance(pinned, Exception) and pinned.num_blocks == 3
            assert pinned.ready_layers == len(layers)  # in place: no stream to wait on
            assert pinned.verify() is None
            for i, name in enumerate(layers):
                got = torch.cat([view for _, view in pinned.pieces(i)])
                assert torch.equal(got.view(torch.int16), layers[name][first : first + 3].view(torch.int16))
        assert kv.stats()["pinned_bytes"] > 0
        for pinned in (hot, cold, miss):
            assert not isinstance(pinned, Exception)
            pinned.release()
        assert kv.stats()["pinned_bytes"] == 0


# ---- leases taken at lookup: the load's pin, made by the lookup before it
def test_a_lookup_leases_what_it_found_in_memory_for_another_process_to_load(make_daemon) -> None:
    """The scheduler side looks up and leases; a worker (another client) loads from the
    lease without a Pin of its own; each of the two holders releases its share, and the
    lease ends with the last. Blocks only the persistent tier holds are not leased (a
    lookup never waits for a promotion) and the lease says why it stops."""
    d = make_daemon()
    hashes, layers = chain("leased", 6), make_layers(6, seed=9)
    _only_in_the_persistent_tier(d, hashes[4:], rows(layers, 4, 6))  # hashes[4:] hang off hashes[3]
    with KVStoreClient(d.address, arena=False) as asker, KVStoreClient(d.address, arena=True) as loader:
        assert save(loader, hashes[:4], rows(layers, 0, 4)) == 4
        settled(loader)
        before = loader.stats()
        where = asker.where(NS, hashes, lease_from=1, lease_holders=2)
        assert where.num_blocks == 6 and where.tiers == bytes([0, 0, 0, 0, 1, 1])
        lease = where.lease
        assert lease is not None and lease.num_blocks == 3 and len([p for p in lease.pins if p.pin_id]) == 1
        assert lease.pins[0].stop_reason == pb.STOP_REASON_NOT_IN_MEMORY
        assert loader.stats()["memory_used_bytes"] == before["memory_used_bytes"]  # nothing promoted
        pinned = loader.leased(lease, NS)
        assert pinned is not None and pinned.held() and pinned.num_blocks == 3
        assert pinned.verify() is None
        for i, name in enumerate(layers):
            got = torch.cat([view for _, view in pinned.pieces(i)])
            assert torch.equal(got.view(torch.int16), layers[name][1:4].view(torch.int16))
        assert loader.stats()["pins"] == before["pins"] + 1  # the lease was the only pin
        assert loader.stats()["memory_hit_blocks"] == before["memory_hit_blocks"]  # nothing served yet
        assert pinned.release()  # one holder's share...
        assert loader.stats()["pinned_bytes"] > 0  # ...the other's still holds it
        assert loader.stats()["memory_hit_blocks"] == before["memory_hit_blocks"] + 3  # served once
        second = loader.leased(lease, NS)
        assert second is not None and second.release()
        assert loader.stats()["pinned_bytes"] == 0
        assert loader.stats()["memory_hit_blocks"] == before["memory_hit_blocks"] + 3  # counted once
        assert not loader.leased(lease, NS).release()  # ended: a third release finds nothing


def test_a_lease_given_back_unused_ends_for_every_holder(make_server) -> None:
    d = make_server()
    hashes, layers = chain("lease-back", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 3
        where = kv.where([NS, NS], hashes, lease_from=0, lease_holders=4)
        lease = where.lease
        assert lease is not None and len([p for p in lease.pins if p.pin_id]) == 2 and lease.num_blocks == 3
        assert kv.stats()["pinned_bytes"] > 0
        hits = kv.stats()["memory_hit_blocks"]
        kv.release_lease(lease)  # in the background, for all four holders of both pins
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)
        assert kv.stats()["memory_hit_blocks"] == hits  # a lease given back served nothing
        assert kv.lookup(NS, hashes) == 3  # a lease ending leaves the blocks stored
        assert kv.where(NS, hashes, lease_from=3).lease is None  # nothing past the prefix to lease
        assert kv.where(NS, chain("lease-none", 2), lease_from=0).lease is None  # a miss leases nothing


def test_leased_blocks_are_not_evicted_before_the_load_and_a_dead_askers_lease_expires(make_server) -> None:
    """Between the lookup and the load, memory pressure evicts other blocks, never leased
    ones; the asker is then SIGKILLed before it hands the lease on: the lease runs out and
    nothing stays pinned."""
    d = make_server(memory=16 * fmt.ALIGN, lease_seconds=1.5)  # room for two extents of 7 pages
    layers = make_layers(7, num_layers=1, shape=(fmt.ALIGN,), dtype=torch.uint8)
    a, b, c = chain("lease-a", 7), chain("lease-b", 7), chain("lease-c", 7)
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from integration.helpers import NS, chain
        from kvstore_client import KVStoreClient
        kv = KVStoreClient({d.address!r}, arena=False)
        lease = kv.where(NS, chain("lease-a", 7), lease_from=0).lease
        print("leased", lease.num_blocks, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, a, layers) == 7
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
        assert save(kv, b, make_layers(7, num_layers=1, shape=(fmt.ALIGN,), dtype=torch.uint8, seed=2)) == 7
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)  # both may leave the arena now
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL and "leased 7" in proc.stdout, proc.stderr
        assert save(kv, c, layers) == 7  # room made by evicting b: a is leased
        assert kv.where(NS, a).tiers == bytes(7)  # a is still in memory...
        assert kv.where(NS, b).tiers == bytes([1]) * 7  # ...b is not
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)  # the dead asker's lease ran out
        assert kv.stats()["leases_expired"] >= 1
        pinned = kv.pin(NS, a)
        assert pinned is not None and pinned.verify() is None
        assert torch.equal(pinned.pieces(0)[0][1], layers["layer.0"])
        assert pinned.release()


def test_a_lease_too_large_to_answer_is_not_taken(make_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore import wire

    d = make_server()
    hashes, layers = chain("lease-large", 3), make_layers(3)
    with KVStoreClient(d.address, arena=True) as kv:
        assert save(kv, hashes, layers) == 3
        settled(kv)
        monkeypatch.setattr(wire, "MAX_LEASE_ANSWER_BYTES", 64)  # the in-process server's limit
        where = kv.where(NS, hashes, lease_from=0, lease_holders=2)
        assert where.num_blocks == 3 and where.lease is None  # the lookup answers all the same
        assert kv.stats()["pinned_bytes"] == 0  # and holds nothing


# ---- a layout as one bytes field (kvstore.v1.Layout)
def _layout_of(layers: dict[str, torch.Tensor]) -> bytes:
    return pb.Layout(
        layers=[pb.LayerSpec(name=s.name, dtype=s.dtype, shape=s.shape) for s in specs(layers)]
    ).SerializeToString()


def test_a_layout_as_bytes_is_read_as_its_layers_are_and_pins_answer_it_where_asked(
    arena_kv: KVStoreClient,
) -> None:
    """The client reserves with the layout as bytes (the daemon offers it) and asks pins
    and leases for it; the same blocks saved and pinned as layers answer the same."""
    assert arena_kv.arena_access().layouts
    hashes, layers = chain("layout", 4), make_layers(4)
    assert save(arena_kv, hashes, layers) == 4
    assert_same(arena_kv.select(NS, hashes), layers)  # pinned with want_layout, read by its bytes
    pin = arena_kv._rpc.arena["Pin"]
    as_bytes = pin(pb.PinRequest(namespace=NS.encode(), block_hashes=hashes, want_layout=True), timeout=10)
    as_specs = pin(pb.PinRequest(namespace=NS.encode(), block_hashes=hashes), timeout=10)
    assert as_bytes.num_blocks == as_specs.num_blocks == 4
    assert as_bytes.layout == _layout_of(layers) and not as_bytes.layers
    assert not as_specs.layout and pb.Layout(layers=as_specs.layers).SerializeToString() == _layout_of(layers)
    for answer in (as_bytes, as_specs):
        arena_kv._rpc.arena["Release"](pb.ReleaseRequest(pin_id=answer.pin_id), timeout=10)
    where = arena_kv.where(NS, hashes, lease_from=0)
    assert where.lease is not None and where.lease.pins[0].layout == _layout_of(layers)
    pinned = arena_kv.leased(where.lease, NS)
    assert pinned is not None and pinned.num_blocks == 4 and [s.name for s in pinned.layers] == list(layers)
    assert pinned.release()
    eventually(lambda: arena_kv.stats()["pinned_bytes"] == 0)


def test_a_reserves_layout_is_checked_as_its_layers_are(arena_kv: KVStoreClient) -> None:
    reserve = arena_kv._rpc.arena["Reserve"]
    layers = make_layers(1)
    good = pb.ReserveRequest(
        namespace=NS.encode(), block_hashes=chain("checked", 1), layout=_layout_of(layers)
    )
    bad = {
        "layers or layout, not both": pb.ReserveRequest(
            namespace=NS.encode(),
            block_hashes=chain("both", 1),
            layout=_layout_of(layers),
            layers=[pb.LayerSpec(name="a", dtype="float16", shape=[4])],
        ),  # fmt: skip
        "not a serialized Layout": pb.ReserveRequest(
            namespace=NS.encode(), block_hashes=chain("garbage", 1), layout=b"\xff\xff\xff"
        ),
        "unsupported dtype": pb.ReserveRequest(
            namespace=NS.encode(),
            block_hashes=chain("dtype", 1),
            layout=pb.Layout(
                layers=[pb.LayerSpec(name="a", dtype="complex7", shape=[4])]
            ).SerializeToString(),
        ),  # fmt: skip
        "layer name must be": pb.ReserveRequest(  # one LayerSpec, all of it empty
            namespace=NS.encode(),
            block_hashes=chain("empty", 1),
            layout=pb.Layout(layers=[pb.LayerSpec()]).SerializeToString(),
        ),
    }
    for why, request in bad.items():
        with pytest.raises(errors.InvalidRequest, match=why):
            reserve(request, timeout=10)
    answer = reserve(good, timeout=10)  # and a refusal cached nothing: the good one is served
    assert answer.reservation_id and list(answer.blocks) == [0]
    arena_kv._rpc.arena["Abort"](pb.AbortRequest(reservation_id=answer.reservation_id), timeout=10)
    assert arena_kv.stats()["reserved_bytes"] == 0


def test_a_daemon_that_reads_no_layout_bytes_gets_layers(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon before layouts (ArenaAccess without `layouts`; its Pin answers carry
    `layers` only): the client reserves with layers and reads the answers' layers."""
    from kvstore_server.rpc import servicer

    offered = servicer.Servicer.ArenaAccess

    def older(self, request, context):  # type: ignore[no-untyped-def]
        resp = offered(self, request, context)
        resp.layouts = False
        return resp

    given: list[bool] = []
    checked = servicer.check_layout
    monkeypatch.setattr(servicer.Servicer, "ArenaAccess", older)
    monkeypatch.setattr(
        servicer, "check_layout", lambda specs, layout: given.append(bool(layout)) or checked(specs, layout)
    )
    plain = servicer._pin_message
    monkeypatch.setattr(servicer, "_pin_message", lambda pin, layout=False: plain(pin, False))
    server = make_server()  # its handlers bound after the patches
    with KVStoreClient(server.address, timeout=20.0, arena=True) as kv:
        hashes, layers = chain("older", 3), make_layers(3)
        assert save(kv, hashes, layers) == 3
        assert_same(kv.select(NS, hashes), layers)
    assert given == [False]


def _held_at_the_first_start(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Hold the first promotion's start (finding where its blocks lie: milliseconds for
    real) until `go`; `held` once it is held, `entered` once a later load enters
    promote_start meanwhile."""
    from kvstore_server.tiers.chain import TierChain

    held, go, entered = threading.Event(), threading.Event(), threading.Event()
    start, begin = TierChain._start, TierChain.promote_start

    def held_start(self, memory, cold, now):  # type: ignore[no-untyped-def]
        if not held.is_set():
            held.set()
            assert go.wait(20)
        return start(self, memory, cold, now)

    def entering(self, keys, now):  # type: ignore[no-untyped-def]
        if held.is_set() and not go.is_set():
            entered.set()
        return begin(self, keys, now)

    monkeypatch.setattr(TierChain, "_start", held_start)
    monkeypatch.setattr(TierChain, "promote_start", entering)
    return held, go, entered


def _pin_all(kv: KVStoreClient, hashes: list[bytes], layers: dict[str, torch.Tensor]) -> None:
    pinned = kv.pin(NS, hashes, stream=True)
    assert pinned is not None and pinned.num_blocks == len(hashes)
    pinned.wait_layers(len(layers))
    assert_same(read_out(pinned, layers), layers)
    assert pinned.release()


@pytest.mark.parametrize("first", ["prefetch", "pin"])
def test_a_load_that_comes_while_a_promotion_of_its_blocks_starts_joins_its_reads(
    server: InProcServer, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    """Two loads of the same cold blocks at once (two TP ranks' pins of one prompt, or a
    Lookup's prefetch and the pin after it): the second waits until the first's reads are
    under way, then joins them: the blocks are read once."""
    hashes, layers = chain("join", 3), make_layers(3)
    with KVStoreClient(server.address, arena=False) as grpc_kv:
        grpc_kv.put(NS, hashes, layers)  # a Put: in the persistent tier only
    held, go, entered = _held_at_the_first_start(monkeypatch)
    failed: list[BaseException] = []

    def load(kv: KVStoreClient) -> None:
        try:
            _pin_all(kv, hashes, layers)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            failed.append(exc)

    with KVStoreClient(server.address, timeout=20.0, arena=True) as kv:
        loaders = []
        if first == "prefetch":
            assert kv.where(NS, hashes, prefetch=True).prefetching == 3
        else:
            loaders.append(threading.Thread(target=load, args=(kv,)))
            loaders[-1].start()
        assert held.wait(20)
        # asked again while the first promotion starts: none to read that it does not
        assert kv.where(NS, hashes, prefetch=True).prefetching == 0
        loaders.append(threading.Thread(target=load, args=(kv,)))
        loaders[-1].start()
        assert entered.wait(20)  # the second load is in promote_start while the first starts
        go.set()
        for loader in loaders:
            loader.join(20)
        assert not failed and not any(loader.is_alive() for loader in loaders)
        # the loads that joined have their bytes once the reads are done; the promotion
        # that read them counts itself as it places them, on its own thread, maybe after
        eventually(lambda: kv.stats()["promotions"] >= 1)
        stats = kv.stats()
        assert (stats["promotions"], stats["promoted_blocks"]) == (1, 3)
        assert stats["prefetched_blocks"] == (3 if first == "prefetch" else 0)

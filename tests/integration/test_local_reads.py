"""The same-host fast path: clients read a running daemon's files, gRPC stays the control plane.

Daemon processes throughout (the reader must be another process: LMDB may be opened only
once per process), and every test on both backends: each has its own files and readers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.daemon import Daemon
from support.ports import free_port

from kvstore_client import KVStoreClient, errors

from .helpers import NS, assert_same, chain, make_layers, rows
from .test_corruption import stored_with_a_flipped_byte
from .test_security import token, token_file

STORE_ID = "STORE_ID"


@pytest.fixture(params=["lmdb", "disk"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every backend, for each test of this module that runs a daemon of the fixtures."""
    return str(request.param)


@pytest.fixture
def kv(daemon_kv: KVStoreClient) -> KVStoreClient:
    """Here `kv` is a client of the daemon process (over gRPC only)."""
    return daemon_kv


@pytest.fixture
def local(daemon: Daemon):
    with KVStoreClient(daemon.address, timeout=20.0, local_reads=True, arena=False) as client:
        yield client


def test_local_access_names_the_daemons_files(daemon: Daemon, kv: KVStoreClient, backend: str) -> None:
    access = kv.local_access()
    assert access.backend == backend
    assert Path(access.data_dir) == daemon.data_dir.resolve()
    assert (daemon.data_dir / STORE_ID).read_text() == access.store_id
    assert access.namespace_prefix == b""


def test_reads_come_from_the_files_and_equal_what_was_put(
    daemon: Daemon, kv: KVStoreClient, local: KVStoreClient
) -> None:
    hashes = chain("local-whole", 6)
    layers = make_layers(6, num_layers=3, seed=1)
    kv.put(NS, hashes, layers)
    before = kv.stats()["bytes_read"]

    stream = local.get_stream(NS, hashes)
    assert stream.local
    assert stream.num_blocks == 6
    assert_same(dict(stream), layers)
    assert local.local_data_dir == daemon.data_dir.resolve()
    # the daemon served no bytes: they came from its files
    assert kv.stats()["bytes_read"] == before


def test_partial_prefix_and_miss(kv: KVStoreClient, local: KVStoreClient) -> None:
    hashes = chain("local-partial", 5)
    layers = make_layers(5, seed=2)
    kv.put(NS, hashes[:3], rows(layers, 0, 3))

    got = local.select(NS, hashes)
    assert_same(got, rows(layers, 0, 3))
    miss = local.get_stream(NS, chain("local-never-stored", 2))
    assert miss.local and miss.num_blocks == 0
    assert dict(miss) == {}


def test_snapshot_outlives_an_eviction_during_the_read(kv: KVStoreClient, local: KVStoreClient) -> None:
    hashes = chain("local-snapshot", 4)
    layers = make_layers(4, seed=3)
    kv.put(NS, hashes, layers)
    stream = local.get_stream(NS, hashes)
    assert stream.local
    assert kv.evict(all=True).blocks_evicted == 4
    # new writes land meanwhile; the open read still sees the blocks it started with
    kv.put(NS, chain("local-snapshot-other", 3), make_layers(3, seed=4))
    assert_same(dict(stream), layers)
    assert local.lookup(NS, hashes) == 0
    assert local.get_stream(NS, hashes).num_blocks == 0


def test_cancel_ends_the_read_and_later_reads_work(kv: KVStoreClient, local: KVStoreClient) -> None:
    hashes = chain("local-cancel", 3)
    layers = make_layers(3, seed=5)
    kv.put(NS, hashes, layers)
    stream = local.get_stream(NS, hashes)
    chunks = stream.chunks()
    next(chunks)
    stream.cancel()
    with pytest.raises(errors.StoreTimeout):
        list(chunks)
    again = local.get_stream(NS, hashes)
    assert again.local
    assert_same(dict(again), layers)


def test_daemon_without_local_reads_is_read_over_grpc(make_daemon) -> None:
    d = make_daemon(extra_args=["--no-local-reads"])
    hashes = chain("local-off", 2)
    layers = make_layers(2, seed=6)
    with KVStoreClient(d.address, local_reads=True, arena=False) as kv:
        with pytest.raises(errors.NotOffered, match="local_reads = false"):
            kv.local_access()
        kv.put(NS, hashes, layers)
        stream = kv.get_stream(NS, hashes)
        assert not stream.local
        assert_same(dict(stream), layers)
        assert kv.local_data_dir is None


def test_a_client_that_sees_other_files_uses_grpc(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    elsewhere = make_daemon("elsewhere")  # a directory with another daemon run's STORE_ID
    hashes = chain("local-elsewhere", 2)
    layers = make_layers(2, seed=7)
    for wrong in (elsewhere.data_dir, tmp_path / "missing"):
        with KVStoreClient(d.address, local_reads=True, local_data_dir=wrong, arena=False) as kv:
            kv.put(NS, hashes, layers)
            stream = kv.get_stream(NS, hashes)
            assert not stream.local
            assert_same(dict(stream), layers)


def test_local_data_dir_override_reads_the_same_files(make_daemon, tmp_path: Path) -> None:
    d = make_daemon()
    mounted = tmp_path / "mounted-here"
    mounted.symlink_to(d.data_dir)  # the daemon's volume, seen at another path
    hashes = chain("local-mounted", 2)
    layers = make_layers(2, seed=8)
    with KVStoreClient(d.address, local_reads=True, local_data_dir=mounted, arena=False) as kv:
        kv.put(NS, hashes, layers)
        stream = kv.get_stream(NS, hashes)
        assert stream.local
        assert kv.local_data_dir == mounted
        assert_same(dict(stream), layers)


def test_corrupt_bytes_end_the_stream_and_reach_the_daemon(
    daemon: Daemon, kv: KVStoreClient, local: KVStoreClient, backend: str
) -> None:
    hashes, layers = stored_with_a_flipped_byte(daemon, kv, backend, "local-corrupt", 1, 1)

    stream = local.get_stream(NS, hashes)
    assert stream.local and stream.num_blocks == 3
    placed = []
    with pytest.raises(errors.LocalDataCorrupt, match=hashes[1].hex()):
        for chunk in stream.chunks():
            placed.append((chunk.layer_index, chunk.first_block))
    # layer 0 of every block and layer 1 of block 0 passed their checksums; then it stopped
    assert placed == [(0, 0), (0, 1), (0, 2), (1, 0)]
    # the daemon was told before the error was raised: it verified, counted and removed the block
    assert kv.stats()["checksum_failures"] == 1
    assert local.lookup(NS, hashes) == 1
    again = local.get_stream(NS, hashes)
    assert again.local and again.num_blocks == 1
    assert_same(dict(again), rows(layers, 0, 1))


def test_select_falls_back_to_the_daemon_on_corrupt_bytes(
    daemon: Daemon, kv: KVStoreClient, local: KVStoreClient, backend: str
) -> None:
    hashes, layers = stored_with_a_flipped_byte(daemon, kv, backend, "local-corrupt-select", 2, 0)
    assert_same(local.select(NS, hashes), rows(layers, 0, 2))
    assert kv.stats()["checksum_failures"] == 1


def test_a_restarted_daemon_is_renegotiated(tmp_path: Path, backend: str) -> None:
    first = Daemon(tmp_path / "data", backend=backend).start()
    hashes = chain("local-restart", 4)
    layers = make_layers(4, seed=9)
    try:
        with KVStoreClient(first.address, local_reads=True, arena=False) as kv:
            kv.put(NS, hashes[:2], rows(layers, 0, 2))
            assert kv.get_stream(NS, hashes).num_blocks == 2
            old_id = (first.data_dir / STORE_ID).read_text()
    finally:
        first.stop()
    second = Daemon(tmp_path / "data", backend=backend).start()
    try:
        with KVStoreClient(second.address, local_reads=True, arena=False) as kv:
            assert kv.get_stream(NS, hashes).num_blocks == 2
            kv.put(NS, hashes[2:], rows(layers, 2, 4), parent_hash=hashes[1])
            stream = kv.get_stream(NS, hashes)
            assert stream.local
            assert_same(dict(stream), layers)
            assert (second.data_dir / STORE_ID).read_text() != old_id
    finally:
        second.stop()


def test_one_client_follows_its_daemon_across_a_restart(tmp_path: Path) -> None:
    port = free_port()
    d = Daemon(tmp_path / "data", extra_args=["--listen", f"127.0.0.1:{port}"]).start()
    hashes = chain("local-follow", 3)
    layers = make_layers(3, seed=10)
    try:
        with KVStoreClient(d.address, local_reads=True, arena=False) as kv:
            kv.put(NS, hashes[:2], rows(layers, 0, 2))
            assert kv.get_stream(NS, hashes).local
            d.stop()
            d.start()  # same address and directory, a new daemon run (new STORE_ID)
            kv.put(NS, hashes[2:], rows(layers, 2, 3), parent_hash=hashes[1])
            # the old reader is retired on the changed STORE_ID and the new run negotiated
            stream = kv.get_stream(NS, hashes)
            assert stream.local
            assert_same(dict(stream), layers)
    finally:
        d.stop()


def test_lmdb_reads_need_the_daemons_pid_namespace(tmp_path: Path) -> None:
    # LMDB tracks readers by PID: a reader the daemon cannot see could have its slot
    # cleared as stale. Run the daemon in a PID namespace of its own (root needed).
    # (as PID 1 there it ignores SIGTERM: it is stopped with SIGKILL, passed on by unshare)
    wrap = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL"]
    probe = subprocess.run([*wrap, "readlink", "/proc/self/ns/pid"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")
    d = Daemon(tmp_path / "data", wrap=wrap).start()
    hashes = chain("local-pidns", 2)
    layers = make_layers(2, seed=14)
    try:
        with KVStoreClient(d.address, local_reads=True, arena=False) as kv:
            theirs = kv.local_access().pid_namespace
            assert theirs.startswith("pid:[") and theirs != os.readlink("/proc/self/ns/pid")
            kv.put(NS, hashes, layers)
            assert kv.lookup(NS, hashes) == 2
            stream = kv.get_stream(NS, hashes)
            assert not stream.local
            assert_same(dict(stream), layers)
            assert kv.local_data_dir is None
    finally:
        d.kill()


def test_local_access_reports_the_daemons_pid_namespace(kv: KVStoreClient) -> None:
    assert kv.local_access().pid_namespace == os.readlink("/proc/self/ns/pid")


def test_a_restart_without_local_reads_stops_the_old_readers(tmp_path: Path) -> None:
    port = free_port()
    listen = ["--listen", f"127.0.0.1:{port}"]
    d = Daemon(tmp_path / "data", extra_args=listen).start()
    hashes = chain("local-withdrawn", 2)
    layers = make_layers(2, seed=17)
    try:
        with KVStoreClient(d.address, local_reads=True, arena=False) as kv:
            kv.put(NS, hashes, layers)
            assert kv.get_stream(NS, hashes).local
            d.stop()
            d.extra_args = [*listen, "--no-local-reads"]
            d.start()
            assert not (d.data_dir / STORE_ID).exists()
            stream = kv.get_stream(NS, hashes)
            assert not stream.local
            assert_same(dict(stream), layers)
    finally:
        d.stop()


@pytest.fixture
def tenants(tmp_path: Path, backend: str):
    """Daemons with tokens: one with the default (no local reads), one opted in."""
    path = token_file(tmp_path / "tokens.toml")
    default = Daemon(tmp_path / "default", backend=backend, extra_args=["--token-file", str(path)]).start()
    opted = Daemon(
        tmp_path / "opted", backend=backend, extra_args=["--token-file", str(path), "--local-reads"]
    ).start()
    yield default, opted
    default.stop()
    opted.stop()


def test_tenants_keep_local_reads_off_unless_asked(tenants) -> None:
    default, opted = tenants
    hashes = chain("local-tenants", 2)
    layers = make_layers(2, seed=12)
    with KVStoreClient(default.address, token=token("a-writer"), local_reads=True, arena=False) as kv:
        with pytest.raises(errors.NotOffered, match="tenants"):
            kv.local_access()
        kv.put(NS, hashes, layers)
        assert not kv.get_stream(NS, hashes).local
    with (
        KVStoreClient(opted.address, token=token("a-writer"), local_reads=True, arena=False) as a,
        KVStoreClient(opted.address, token=token("b-writer"), local_reads=True, arena=False) as b,
    ):
        assert a.local_access().namespace_prefix == b"\x00team-a\x00"
        a.put(NS, hashes, layers)
        mine = a.get_stream(NS, hashes)
        assert mine.local
        assert_same(dict(mine), layers)
        # the same namespace name of another tenant is another stored namespace
        theirs = b.get_stream(NS, hashes)
        assert theirs.local and theirs.num_blocks == 0


def test_local_reads_land_in_caller_buffers(kv: KVStoreClient, local: KVStoreClient) -> None:
    hashes = chain("local-allocate", 3)
    layers = make_layers(3, seed=13)
    kv.put(NS, hashes, layers)
    given = []

    def allocate(spec, n):
        t = torch.empty((n, *spec.shape), dtype=layers[spec.name].dtype)
        given.append(t)
        return t

    out = dict(local.get_stream(NS, hashes, allocate=allocate))
    assert [t.data_ptr() for t in out.values()] == [t.data_ptr() for t in given]
    assert_same(out, layers)


@pytest.mark.parametrize(
    ("namespace", "hashes"),
    [("", [b"\x01" * 32]), ("n" * 257, [b"\x01" * 32]), (NS, [b"\x01" * 31])],
    ids=["empty-namespace", "long-namespace", "short-hash"],
)
def test_bad_input_gets_the_daemons_answer_on_the_local_path(
    local: KVStoreClient, namespace: str, hashes: list[bytes]
) -> None:
    assert local.lookup(NS, chain("local-negotiate", 1)) == 0  # the fast path is on
    assert local.local_data_dir is not None
    with pytest.raises(errors.InvalidRequest):
        local.lookup(namespace, hashes)
    with pytest.raises(errors.InvalidRequest):
        local.get_stream(namespace, hashes)


def test_local_lookups_reach_the_daemon_in_the_background(daemon: Daemon, kv: KVStoreClient) -> None:
    hashes = chain("local-touch", 4)
    kv.put(NS, hashes[:3], make_layers(3, seed=15))
    before = kv.stats()
    touched = kv.describe(NS, hashes[2]).block.last_access_at
    with KVStoreClient(daemon.address, local_reads=True, arena=False) as local:
        assert [local.lookup(NS, hashes) for _ in range(3)] == [3, 3, 3]
        assert local.local_data_dir is not None
    # close() sent the queued Lookups: the daemon counted them and refreshed recency
    after = kv.stats()
    assert after["lookups"] - before["lookups"] == 3
    assert after["hit_blocks"] - before["hit_blocks"] == 9
    assert after["miss_blocks"] - before["miss_blocks"] == 3
    assert kv.describe(NS, hashes[2]).block.last_access_at > touched


def test_local_lookups_and_reads_go_on_while_the_daemon_stalls(daemon: Daemon, kv: KVStoreClient) -> None:
    hashes = chain("local-stall", 2)
    layers = make_layers(2, seed=16)
    kv.put(NS, hashes, layers)
    local = KVStoreClient(daemon.address, timeout=1.0, local_reads=True, arena=False)
    assert local.lookup(NS, hashes) == 2  # negotiated
    daemon.pause()
    try:
        assert [local.lookup(NS, hashes) for _ in range(5)] == [2] * 5
        assert_same(local.select(NS, hashes), layers)
        local.close()  # gives the stalled daemon's background Lookups one deadline, not five
    finally:
        daemon.resume()

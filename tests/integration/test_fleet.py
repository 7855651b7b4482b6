"""Two daemons standing for two hosts (own data dirs, ports and arenas; nothing shared
but a real Redis Cluster): what one stores, the other serves as fleet hits, with no
gRPC between them."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
import urllib.request

import pytest
from support.daemon import Daemon, eventually
from support.redis_cluster import Cluster

from kvstore_cli.main import main as cli_main
from kvstore_client import KVStoreClient, errors

from .helpers import NS, assert_same, both_backends, chain, make_layers
from .test_memory_tier import save


def fleet_args(cluster: Cluster, prefix: str) -> list[str]:
    return ["--fleet", cluster.url, "--fleet-prefix", prefix]


@pytest.fixture
def hosts(make_daemon, cluster: Cluster) -> tuple[Daemon, Daemon]:
    prefix = f"t-{secrets.token_hex(4)}/"  # this test's own keys in the shared cluster
    a = make_daemon("host-a", extra_args=fleet_args(cluster, prefix))
    b = make_daemon("host-b", extra_args=[*fleet_args(cluster, prefix), "--metrics-port", "0"])
    return a, b


def copied_to_fleet(kv: KVStoreClient, n: int) -> None:
    eventually(lambda: kv.stats()["fleet_blocks_written"] + kv.stats()["fleet_skipped"] >= n)
    assert kv.stats()["fleet_backlog_blocks"] == 0 and kv.stats()["fleet_dropped"] == 0


@both_backends
def test_a_put_on_one_host_is_a_bit_exact_fleet_hit_on_another(hosts, backend: str, capsys) -> None:
    a, b = hosts
    hashes, layers = chain("fleet-put", 6), make_layers(6)
    with KVStoreClient(a.address, arena=False) as on_a:
        on_a.put(NS, hashes, layers)
        copied_to_fleet(on_a, 6)
    with KVStoreClient(b.address, arena=False, local_reads=True) as on_b:
        assert on_b.stats()["blocks"] == 0
        assert on_b.lookup(NS, hashes) == 6  # local files have none: the daemon asks the fleet
        assert_same(on_b.select(NS, hashes), layers)
        stats = on_b.stats()
        assert (stats["fleet_hit_blocks"], stats["fleet_promoted_blocks"], stats["blocks"]) == (6, 6, 6)
        assert_same(on_b.select(NS, hashes), layers)  # now from B's own tiers
        assert on_b.stats()["fleet_hit_blocks"] == 6
        metrics = urllib.request.urlopen(b.metrics_url + "/metrics", timeout=10).read().decode()
        assert "kvstore_fleet_hit_blocks_total 6.0" in metrics and "kvstore_fleet_up 1.0" in metrics
        copied_to_fleet(on_b, 0)
        assert on_b.stats()["fleet_blocks_written"] == 0  # what came from the fleet is not sent back
    assert cli_main(["--address", b.address, "stats"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"fleet hits\s+6 blocks", shown) and re.search(r"fleet promoted\s+6 blocks", shown)


def test_an_arena_save_on_one_host_is_an_arena_load_on_another(hosts) -> None:
    a, b = hosts
    hashes, layers = chain("fleet-arena", 4), make_layers(4)
    with KVStoreClient(a.address, arena=True) as on_a:
        assert save(on_a, hashes, layers) == 4
        copied_to_fleet(on_a, 4)
    with KVStoreClient(b.address, arena=True) as on_b:
        stream = on_b.get_stream(NS, hashes)
        assert stream.via == "arena"
        assert_same(stream.read_all(), layers)
        stats = on_b.stats()
        # straight into B's arena (no Put to its persistent tier on the request path, no
        # promotion from it), then written behind
        assert (stats["fleet_promoted_blocks"], stats["promoted_blocks"], stats["memory_blocks"]) == (4, 0, 4)
        eventually(lambda: on_b.stats()["written_behind"] == 4)
        assert on_b.stats()["fleet_blocks_written"] == 0  # not sent back to the fleet


def test_the_fleet_continues_a_prefix_the_local_tiers_stop_short_of(hosts) -> None:
    a, b = hosts
    hashes, layers = chain("fleet-rest", 5), make_layers(5)
    with KVStoreClient(a.address, arena=False) as on_a:
        on_a.put(NS, hashes, layers)
        copied_to_fleet(on_a, 5)
    with KVStoreClient(b.address, arena=False) as on_b:
        first = {name: t[:2] for name, t in layers.items()}
        on_b.put(NS, hashes[:2], first)
        assert on_b.lookup(NS, hashes) == 5
        assert_same(on_b.select(NS, hashes), layers)
        assert on_b.stats()["fleet_promoted_blocks"] == 3


def test_without_the_fleet_the_local_tiers_keep_serving(make_daemon, tmp_path) -> None:
    from support.ports import free_port
    from support.redis_cluster import Node

    node = Node(free_port(), tmp_path / "redis", cluster=False).start()
    d = make_daemon(extra_args=["--fleet", f"redis://127.0.0.1:{node.port}"])
    hashes, layers = chain("fleet-down", 3), make_layers(3)
    try:
        with KVStoreClient(d.address, arena=False) as kv:
            kv.put(NS, hashes[:2], {name: t[:2] for name, t in layers.items()})
            node.stop()
            assert kv.lookup(NS, hashes) == 2  # the fleet's part is a miss, not an error
            assert_same(kv.select(NS, hashes[:2]), {name: t[:2] for name, t in layers.items()})
            kv.put(NS, hashes[2:], {name: t[2:] for name, t in layers.items()}, parent_hash=hashes[1])
            eventually(lambda: kv.stats()["fleet_dropped"] >= 1)
            assert kv.stats()["fleet_up"] == 0
        assert d.log().count("does not answer") == 1
    finally:
        node.stop()


def test_evict_fleet_removes_a_namespace_from_every_host_and_only_that(hosts, capsys) -> None:
    a, b = hosts
    hashes, layers = chain("fleet-evict", 3), make_layers(3)
    other = chain("fleet-keep", 2)
    with KVStoreClient(a.address, arena=False) as on_a:
        on_a.put(NS, hashes, layers)
        on_a.put("other-ns", other, {name: t[:2] for name, t in layers.items()})
        copied_to_fleet(on_a, 5)
    assert cli_main(["--address", a.address, "evict", "--namespace", NS, "--fleet"]) == 0
    assert "removed 3 objects from the fleet" in capsys.readouterr().out
    with KVStoreClient(b.address, arena=False) as on_b:
        assert on_b.lookup(NS, hashes) == 0  # gone from the fleet, not only from host A
        assert on_b.lookup("other-ns", other) == 2
    assert cli_main(["--address", a.address, "evict", "--block", hashes[0].hex(), "--namespace", NS,
                     "--fleet"]) == 2  # fmt: skip
    assert "--fleet goes with --namespace or --all" in capsys.readouterr().err


def test_evict_fleet_without_a_fleet_is_refused_before_anything_is_evicted(make_server) -> None:
    s = make_server()
    hashes, layers = chain("no-fleet", 2), make_layers(2)
    with KVStoreClient(s.address, arena=False) as kv:
        kv.put(NS, hashes, layers)
        with pytest.raises(errors.KVStoreError, match="without a fleet tier") as raised:
            kv.evict(namespace=NS, fleet=True)
        assert raised.value.code == "FAILED_PRECONDITION"
        assert kv.lookup(NS, hashes) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fleet", "http://127.0.0.1:6379"], "the scheme must be one of"),
        (["--fleet", "redis://a:1,b:2"], "one HOST:PORT"),
        (["--fleet", "redis://127.0.0.1:1", "--fleet-password-file", "/nonexistent/pw"], "/nonexistent/pw"),
    ],
)
def test_a_bad_fleet_setting_is_refused_at_start(tmp_path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server", "--data-dir", str(tmp_path / "data"), "--memory", "0", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr

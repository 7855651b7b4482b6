"""The fleet tier against a real 3-master Redis Cluster (tests/support/redis_cluster.py):
one object per block spread over the nodes, prefixes, verification, deployments and
namespaces apart, and a Redis that goes away and comes back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemon import eventually
from support.pki import make_pki
from support.ports import free_port
from support.redis_cluster import Cluster, Node

from kvstore.blocks import BlockKey, BlockMeta, LayerSpec, StorageError, StoredBlock, checksum
from kvstore_server.tiers.base import BlockWrite
from kvstore_server.tiers.fleet import SETTLE_S, FleetSettings, FleetTier, encode, object_key

LAYERS = (LayerSpec("k", "bfloat16", (2, 16, 8), 512), LayerSpec("v", "bfloat16", (2, 16, 8), 512))
NS = b"tenant\x00model-a"


def block(i: int, ns: bytes = NS, tag: bytes = b"chain") -> BlockWrite:
    data = [bytes([(i * 7 + k * 3 + j) % 251 for j in range(spec.nbytes)]) for k, spec in enumerate(LAYERS)]
    meta = BlockMeta(ns, tag.ljust(31, b".") + bytes([i]), (tag.ljust(31, b".") + bytes([i - 1])) if i else b"",
                     LAYERS, tuple(checksum(d) for d in data), 1_700_000_000.0)  # fmt: skip
    return BlockWrite(meta, data)


def wrote(tier: FleetTier, writes: list[BlockWrite]) -> bool:
    """The tier's write as yes or no (it raises StorageError when the fleet refused it)."""
    try:
        tier.write(writes)
    except StorageError:
        return False
    return True


def read(tier: FleetTier, keys: list[BlockKey]) -> list[StoredBlock | None]:
    with tier.read(keys) as blocks:
        return blocks


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[FleetTier]:
    cluster.flush()
    tier = FleetTier(FleetSettings(cluster.url, prefix=b"test/"))
    try:
        yield tier
    finally:
        tier.close()


def test_blocks_round_trip_bit_exact_one_object_each_spread_over_the_masters(
    fleet: FleetTier, cluster: Cluster
) -> None:
    writes = [block(i) for i in range(24)]
    assert wrote(fleet, writes)
    keys = [w.meta.key for w in writes]
    assert fleet.stored_prefix(keys) == 24
    got = read(fleet, keys)
    for w, b in zip(writes, got, strict=True):
        assert b is not None and b.meta == w.meta
        assert [bytes(v) for v in b.layers] == [bytes(d) for d in w.layers]
    sizes = [node.client().dbsize() for node in cluster.nodes]
    assert sum(sizes) == 24 and sum(1 for n in sizes if n) >= 2  # no hash tags: the chain spreads
    stats = fleet.stats()
    assert (stats["fleet_blocks_written"], stats["fleet_hit_blocks"]) == (24, 24)
    assert stats["fleet_bytes_fetched"] == sum(len(encode(w)) for w in writes)


def test_the_prefix_ends_at_the_first_block_the_fleet_lacks(fleet: FleetTier) -> None:
    writes = [block(i) for i in range(5)]
    assert wrote(fleet, [writes[0], writes[1], writes[3], writes[4]])
    keys = [w.meta.key for w in writes]
    assert fleet.stored_prefix(keys) == 2
    assert [b is not None for b in read(fleet, keys)] == [True, True, False, True, True]
    assert fleet.stored_prefix(keys[2:]) == 0 and read(fleet, []) == []


def test_a_corrupt_or_misplaced_object_is_a_miss_never_bytes(fleet: FleetTier, caplog) -> None:
    a, b, c = block(0), block(1), block(2)
    assert wrote(fleet, [a, b, c])
    raw = fleet._client("data").get(object_key(fleet.prefix, a.meta.key))  # noqa: SLF001 - the real bytes
    flipped = bytearray(raw)
    flipped[-10] ^= 0x01
    fleet._client("data").set(object_key(fleet.prefix, a.meta.key), bytes(flipped))  # noqa: SLF001
    fleet._client("data").set(object_key(fleet.prefix, b.meta.key), raw)  # noqa: SLF001 - a's object under b's key
    fleet._client("data").set(object_key(fleet.prefix, c.meta.key), raw[:-1])  # noqa: SLF001 - cut short
    with caplog.at_level(logging.WARNING):
        assert read(fleet, [a.meta.key, b.meta.key, c.meta.key]) == [None, None, None]
    assert "fails its checksum" in caplog.text and "another block's" in caplog.text
    assert fleet.stats()["fleet_corrupt"] == 3


def test_deployments_and_namespaces_stay_apart_and_evict_alone(cluster: Cluster) -> None:
    cluster.flush()
    one = FleetTier(FleetSettings(cluster.url, prefix=b"one/"))
    two = FleetTier(FleetSettings(cluster.url, prefix=b"two/"))
    try:
        mine, other = [block(i) for i in range(3)], [block(i, ns=b"tenant\x00model-b") for i in range(3)]
        assert wrote(one, mine + other)
        assert two.stored_prefix([w.meta.key for w in mine]) == 0  # another deployment's prefix
        assert one.delete_matching(NS) == 3
        assert one.stored_prefix([w.meta.key for w in mine]) == 0
        assert one.stored_prefix([w.meta.key for w in other]) == 3
    finally:
        one.close()
        two.close()


def test_a_fleet_that_goes_away_is_misses_and_drops_then_comes_back(tmp_path: Path, caplog) -> None:
    node = Node(free_port(), tmp_path / "redis", cluster=False).start()
    now = [100.0]
    settings = FleetSettings(f"redis://127.0.0.1:{node.port}", lookup_timeout_s=0.2, timeout_s=0.5)
    fleet = FleetTier(settings, clock=lambda: now[0])
    try:
        writes = [block(i) for i in range(3)]
        keys = [w.meta.key for w in writes]
        assert wrote(fleet, writes) and fleet.stored_prefix(keys) == 3
        node.stop()
        with caplog.at_level(logging.WARNING):
            assert fleet.stored_prefix(keys) == 0
            assert read(fleet, keys) == [None, None, None]
            assert not wrote(fleet, writes)
        assert caplog.text.count("does not answer") == 1  # one warning per outage
        assert fleet.stats()["fleet_up"] == 0 and fleet.stats()["fleet_errors"] == 3
        node.start()  # the same port, empty (no persistence)
        with caplog.at_level(logging.WARNING):
            # answers right after a failure (a cluster with one node down answers the
            # calls that miss it) do not end the outage: it would flap, a line per call
            now[0] += SETTLE_S / 2
            assert wrote(fleet, writes)
            assert fleet.stats()["fleet_up"] == 0 and "is back after" not in caplog.text
            now[0] += SETTLE_S
            assert fleet.stored_prefix(keys) == 3
        assert caplog.text.count("is back after") == 1 and fleet.stats()["fleet_up"] == 1
    finally:
        fleet.close()
        node.stop()


def test_a_plain_redis_with_acl_user_and_password_file(tmp_path: Path) -> None:
    node = Node(free_port(), tmp_path / "redis", cluster=False).start()
    try:
        with node.client() as admin:
            admin.acl_setuser("kv", enabled=True, passwords=["+s3cret-pass"], keys=["fleet/*"],
                              commands=["+@all"])  # fmt: skip
        secret = tmp_path / "password"
        secret.write_text("s3cret-pass\n")
        url = f"redis://127.0.0.1:{node.port}"
        ok = FleetTier(FleetSettings(url, prefix=b"fleet/", user="kv", password_file=secret))
        try:
            assert wrote(ok, [block(0)]) and ok.stored_prefix([block(0).meta.key]) == 1
        finally:
            ok.close()
        secret.write_text("wrong\n")
        refused = FleetTier(FleetSettings(url, prefix=b"fleet/", user="kv", password_file=secret))
        try:
            assert refused.stored_prefix([block(0).meta.key]) == 0 and not wrote(refused, [block(1)])
            assert refused.stats()["fleet_up"] == 0
        finally:
            refused.close()
    finally:
        node.stop()


def test_a_tls_redis_is_reached_only_with_its_ca(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    tls = [f"tls-port {port}", "port 0", f"tls-cert-file {pki['server']}", f"tls-key-file {pki['server.key']}",
           f"tls-ca-cert-file {pki['ca']}", "tls-auth-clients no"]  # fmt: skip
    node = Node(port, tmp_path / "redis", cluster=False, settings=tls).start()
    try:
        trusted = FleetTier(FleetSettings(f"rediss://127.0.0.1:{port}", tls_ca=pki["ca"]))
        try:
            assert wrote(trusted, [block(0), block(1)])
            assert trusted.stored_prefix([block(0).meta.key, block(1).meta.key]) == 2
            got = read(trusted, [block(0).meta.key, block(1).meta.key])
            assert [[bytes(v) for v in g.layers] for g in got if g] == [
                list(block(0).layers),
                list(block(1).layers),
            ]
        finally:
            trusted.close()
        # a server certificate the client cannot verify, and plaintext to the TLS port: misses
        for url, ca in ((f"rediss://127.0.0.1:{port}", pki["other_ca"]), (f"redis://127.0.0.1:{port}", None)):
            refused = FleetTier(FleetSettings(url, tls_ca=ca, timeout_s=1.0))
            try:
                assert refused.stored_prefix([block(0).meta.key]) == 0 and not wrote(refused, [block(2)])
                assert refused.stats()["fleet_up"] == 0
            finally:
                refused.close()
    finally:
        node.stop()


def test_a_redis_evicting_under_maxmemory_only_ever_makes_whole_blocks_missing(tmp_path: Path) -> None:
    node = Node(free_port(), tmp_path / "redis", cluster=False,
                settings=["maxmemory 2mb", "maxmemory-policy allkeys-lru"]).start()  # fmt: skip
    fleet = FleetTier(FleetSettings(f"redis://127.0.0.1:{node.port}"))
    try:
        writes = [block(i % 256, tag=b"lru%d" % (i // 256)) for i in range(3000)]  # ~3.5 MB of objects
        for at in range(0, len(writes), 100):
            assert wrote(fleet, writes[at : at + 100])
        got = read(fleet, [w.meta.key for w in writes])
        kept = [(w, b) for w, b in zip(writes, got, strict=True) if b is not None]
        assert 0 < len(kept) < len(writes)  # Redis evicted some
        for w, b in kept:  # and every block still there is whole, verified
            assert [bytes(v) for v in b.layers] == [bytes(d) for d in w.layers]
        assert fleet.stats()["fleet_corrupt"] == 0
    finally:
        fleet.close()
        node.stop()


def test_a_master_killed_fails_over_and_its_blocks_are_served_again(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "ha", masters=3, replicas=1).start()
    fleet = FleetTier(FleetSettings(cluster.url, prefix=b"ha/", lookup_timeout_s=0.2, timeout_s=1.0))
    try:
        writes = [block(i) for i in range(30)]
        keys = [w.meta.key for w in writes]
        assert wrote(fleet, writes)
        replicas = [n for n in cluster.nodes if n.client().info("replication")["role"] == "slave"]
        eventually(lambda: sum(r.client().dbsize() for r in replicas) == 30)  # replicated
        victim = next(n for n in cluster.nodes if n not in replicas)
        victim.stop()
        # meanwhile: misses or a shorter prefix, within the deadline (no hang, no raise)
        assert fleet.stored_prefix(keys) <= 30
        assert len(read(fleet, keys)) == 30
        eventually(cluster.healthy, deadline_s=30.0)  # a replica took over its slots
        eventually(lambda: fleet.stored_prefix(keys) == 30, deadline_s=30.0)
        got = read(fleet, keys)
        assert all(b is not None and [bytes(v) for v in b.layers] == [bytes(d) for d in w.layers]
                   for w, b in zip(writes, got, strict=True))  # fmt: skip
    finally:
        fleet.close()
        cluster.stop()

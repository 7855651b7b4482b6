"""The byte budget: eviction of least-recently-used chain tails, and puts that cannot fit.

In-process servers, on both backends (each backend accounts for its own bytes)."""

from __future__ import annotations

from kvstore_client import KVStoreClient, errors

from .helpers import NS, all_blocks, assert_same, block_bytes, both_backends, chain, make_layers, rows

pytestmark = both_backends

BLOCK = block_bytes(make_layers(1))  # 256 bytes: two float16 [2, 4, 8] layers


def test_capacity_evicts_the_oldest_chain_tails_first(make_server) -> None:
    capacity = 22 * BLOCK  # not a multiple of the 4-block chains: one chain ends up trimmed
    d = make_server(capacity=str(capacity))
    chains = [chain(f"cap-{i}", 4) for i in range(10)]
    data = [make_layers(4, seed=100 + i) for i in range(10)]

    with KVStoreClient(d.address) as kv:
        evicted = 0
        for hashes, layers in zip(chains, data, strict=True):
            result = kv.put(NS, hashes, layers)
            assert result.blocks_written == 4
            evicted += result.blocks_evicted
            stats = kv.stats()
            assert stats["capacity_bytes"] == capacity
            assert stats["bytes_used"] <= stats["capacity_bytes"]
            assert kv.lookup(NS, hashes) == 4  # the newest put is always whole

        stats = kv.stats()
        assert stats["bytes_used"] == capacity  # filled up to the budget, not below it
        assert stats["blocks"] == 22
        assert stats["evictions"] == evicted == 40 - 22

        stored = {info.block_hash for info in all_blocks(kv, NS)}
        assert len(stored) == stats["blocks"]
        lengths = [kv.lookup(NS, hashes) for hashes in chains]
        assert lengths == sorted(lengths)  # an older chain is never longer than a newer one
        assert lengths[0] == 0 and lengths[-1] == 4
        assert any(0 < n < 4 for n in lengths)  # a chain cut back to a shorter prefix
        for hashes, layers, n in zip(chains, data, lengths, strict=True):
            # no holes: what survives of a chain is exactly its first n blocks
            assert stored & set(hashes) == set(hashes[:n])
            got = kv.select(NS, hashes)
            if n:
                assert_same(got, rows(layers, 0, n))
            else:
                assert got == {}


def test_lookup_refreshes_a_chain_against_eviction(make_server) -> None:
    d = make_server(capacity=str(12 * BLOCK))
    a, b, c, e = (chain(f"lru-{x}", 4) for x in "abce")
    layers = make_layers(4, seed=30)
    with KVStoreClient(d.address) as kv:
        for hashes in (a, b, c):
            kv.put(NS, hashes, layers)
        assert kv.stats()["bytes_used"] == 12 * BLOCK
        assert kv.lookup(NS, a) == 4  # a is now the most recently used

        assert kv.put(NS, e, layers).blocks_evicted == 4
        # b, the least recently used, went; a survived although it is older
        assert [kv.lookup(NS, h) for h in (a, b, c, e)] == [4, 0, 4, 4]


def test_put_larger_than_capacity_is_refused(make_server) -> None:
    d = make_server(capacity=str(12 * BLOCK))
    with KVStoreClient(d.address) as kv:
        kept = chain("cap-kept", 4)
        layers = make_layers(13, seed=31)
        kv.put(NS, kept, rows(layers, 0, 4))
        before = kv.stats()

        too_big = chain("cap-too-big", 13)
        try:
            kv.put(NS, too_big, layers)
        except errors.CapacityExceeded as exc:
            assert exc.code == "RESOURCE_EXHAUSTED"
        else:
            raise AssertionError("a put larger than the whole store was accepted")

        after = kv.stats()
        assert kv.lookup(NS, too_big) == 0
        assert (after["blocks"], after["bytes_used"], after["evictions"]) == (
            before["blocks"],
            before["bytes_used"],
            before["evictions"],
        )
        assert_same(kv.select(NS, kept), rows(layers, 0, 4))
        # exactly the capacity still fits, by evicting the older chain
        fits = kv.put(NS, too_big[:12], rows(layers, 0, 12))
        assert (fits.blocks_written, fits.blocks_evicted) == (12, 4)
        assert kv.stats()["bytes_used"] == 12 * BLOCK


def test_restart_with_a_smaller_capacity_evicts_at_start(make_server) -> None:
    big = make_server("store", capacity="1MiB")
    chains = [chain(f"shrink-{i}", 3) for i in range(4)]
    layers = make_layers(3, seed=32)
    with KVStoreClient(big.address) as kv:
        for hashes in chains:
            kv.put(NS, hashes, layers)
    big.stop()

    small = make_server("store", capacity=str(7 * BLOCK))
    with KVStoreClient(small.address) as kv:
        stats = kv.stats()
        assert stats["bytes_used"] <= 7 * BLOCK
        assert stats["blocks"] == 7  # 12 stored, as many as fit kept
        lengths = [kv.lookup(NS, hashes) for hashes in chains]
        assert sum(lengths) == 7
        assert lengths == sorted(lengths)  # the oldest chains went first
        stored = {info.block_hash for info in all_blocks(kv)}
        for hashes, n in zip(chains, lengths, strict=True):
            assert stored & set(hashes) == set(hashes[:n])
            if n:
                assert_same(kv.select(NS, hashes), rows(layers, 0, n))
    assert "evicted 5 blocks to fit the configured capacity" in small.log()

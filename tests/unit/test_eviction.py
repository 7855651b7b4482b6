"""kvstore_server.eviction: policies over a PrefixIndex."""

from __future__ import annotations

import random

import pytest
from kvunit import NS, NS2, chain, h

from kvstore_server import eviction
from kvstore_server.index import PrefixIndex

SIZE = 100


def build(chains: dict[str, int], ns: bytes = NS, index: PrefixIndex | None = None) -> PrefixIndex:
    index = index or PrefixIndex()
    for name, n in chains.items():
        parent = b""
        for block_hash in chain(name, n):
            index.add(ns, block_hash, parent, SIZE, 1.0)
            parent = block_hash
    return index


def assert_prefix_closed(index: PrefixIndex) -> None:
    """Every stored block's parent is stored too: everything is reachable as a prefix."""
    for key in index.keys():
        entry = index.get(*key)
        assert entry is not None
        if entry.parent:
            assert index.get(key[0], entry.parent) is not None, "a block outlived its parent"


def random_forest(rng: random.Random, n: int) -> PrefixIndex:
    index = PrefixIndex()
    stored: list[tuple[bytes, bytes]] = []
    for i in range(n):
        ns = rng.choice([NS, NS2])
        candidates = [k for k in stored if k[0] == ns]
        parent = rng.choice(candidates)[1] if candidates and rng.random() < 0.8 else b""
        block_hash = h(f"rand{i}")
        index.add(ns, block_hash, parent, rng.randint(1, 50), float(rng.randint(0, 1000)))
        stored.append((ns, block_hash))
    for ns, block_hash in rng.sample(stored, n // 3):
        index.touch(ns, [block_hash], now=float(rng.randint(1000, 2000)))
    return index


def test_down_to_keeps_bytes_under_target_and_evicts_tails_first() -> None:
    index = build({"a": 5, "b": 3})
    victims = eviction.down_to(index, 4 * SIZE)
    assert index.bytes_used <= 4 * SIZE
    assert index.bytes_used == 4 * SIZE, "no more than needed is evicted"
    assert len(victims) == 4
    assert all(index.get(*v) is None for v in victims)
    assert_prefix_closed(index)


def test_down_to_takes_the_least_recently_used_chain() -> None:
    index = build({"a": 3, "b": 3})
    index.touch(NS, chain("a", 3), now=10.0)
    victims = eviction.down_to(index, 3 * SIZE)
    assert victims == [(NS, x) for x in reversed(chain("b", 3))]
    assert index.prefix_len(NS, chain("a", 3)) == 3


def test_down_to_noop_when_under_target() -> None:
    index = build({"a": 3})
    assert eviction.down_to(index, 3 * SIZE) == []
    assert eviction.down_to(index, 10**9) == []
    assert index.num_blocks == 3


def test_down_to_zero_empties() -> None:
    index = build({"a": 3, "b": 2})
    assert len(eviction.down_to(index, 0)) == 5
    assert index.num_blocks == 0 and index.bytes_used == 0


@pytest.mark.parametrize("seed", range(8))
def test_down_to_random_forests_stay_prefix_closed(seed: int) -> None:
    rng = random.Random(seed)
    index = random_forest(rng, 60)
    total = index.bytes_used
    for target in (total * 3 // 4, total // 2, total // 5, 0):
        sizes = {key: index.get(*key).size for key in index.keys()}
        victims = eviction.down_to(index, target)
        assert index.bytes_used <= target
        assert_prefix_closed(index)
        assert len(set(victims)) == len(victims)
        assert index.bytes_used == sum(sizes.values()) - sum(sizes[v] for v in victims)
        # no more than needed: without the last victim the target was not yet met
        if victims:
            assert index.bytes_used + sizes[victims[-1]] > target
    assert index.num_blocks == 0


def test_make_room_fits_incoming_and_respects_protect() -> None:
    index = build({"a": 3, "b": 3})
    index.touch(NS, chain("b", 3), now=10.0)  # b is more recent; a would go first...
    protect = {(NS, chain("a", 3)[2])}  # ...but the tail of a is what the put extends
    victims = eviction.make_room(index, incoming=2 * SIZE, capacity=6 * SIZE, protect=protect)
    assert index.bytes_used + 2 * SIZE <= 6 * SIZE
    assert victims == [(NS, chain("b", 3)[2]), (NS, chain("b", 3)[1])]
    assert index.prefix_len(NS, chain("a", 3)) == 3


def test_make_room_gives_up_when_only_protected_blocks_remain() -> None:
    index = build({"a": 3})
    victims = eviction.make_room(index, SIZE, 3 * SIZE, {(NS, chain("a", 3)[2])})
    assert victims == []
    assert index.bytes_used == 3 * SIZE


def test_subtree_evicts_block_and_descendants_only() -> None:
    index = build({"a": 4})
    a = chain("a", 4)
    index.add(NS, h("side"), a[1], SIZE, 1.0)
    index.add(NS, h("other-root"), b"", SIZE, 1.0)
    victims = eviction.subtree(index, NS, a[1])
    assert set(victims) == {(NS, a[1]), (NS, a[2]), (NS, a[3]), (NS, h("side"))}
    assert victims[-1] == (NS, a[1]), "the block itself goes last, after what hangs below it"
    assert index.prefix_len(NS, a) == 1
    assert index.get(NS, h("other-root")) is not None
    assert_prefix_closed(index)


def test_subtree_of_unknown_block() -> None:
    index = build({"a": 2})
    assert eviction.subtree(index, NS, h("unknown")) == []
    assert eviction.subtree(index, NS2, chain("a", 2)[0]) == []
    assert index.num_blocks == 2


def test_older_than_takes_old_blocks_and_what_hangs_below() -> None:
    index = build({"a": 3, "b": 2})
    a, b = chain("a", 3), chain("b", 2)
    index.touch(NS, a[:2], now=100.0)  # a[2] stays at 1.0
    index.touch(NS, b, now=100.0)
    index.touch(NS, [b[0]], now=5.0)  # b[0] is old, b[1] is new but hangs below it
    victims = eviction.older_than(index, cutoff=50.0)
    assert set(victims) == {(NS, a[2]), (NS, b[0]), (NS, b[1])}
    assert len(victims) == len(set(victims))
    assert index.prefix_len(NS, a) == 2
    assert_prefix_closed(index)


def test_older_than_cutoff_is_strict() -> None:
    index = build({"a": 1})
    assert eviction.older_than(index, cutoff=1.0) == []
    assert eviction.older_than(index, cutoff=1.5) == [(NS, chain("a", 1)[0])]


def test_namespace_evicts_one_or_all() -> None:
    index = build({"a": 2})
    build({"a": 2, "c": 1}, ns=NS2, index=index)
    victims = eviction.namespace(index, NS2)
    assert sorted(victims) == sorted([(NS2, x) for x in chain("a", 2) + chain("c", 1)])
    assert index.namespaces() == [NS]
    assert index.bytes_used == 2 * SIZE
    assert eviction.namespace(index, b"absent") == []
    assert len(eviction.namespace(index, None)) == 2
    assert index.num_blocks == 0 and index.bytes_used == 0


def test_subtree_and_older_than_terminate_on_cyclic_links() -> None:
    index = PrefixIndex()
    a, b, c = h("a"), h("b"), h("c")
    index.add(NS, b, a, SIZE, 1.0)
    index.add(NS, c, b, SIZE, 1.0)
    index.add(NS, a, c, SIZE, 1.0)  # a -> b -> c -> a
    assert sorted(eviction.subtree(index, NS, a)) == sorted([(NS, a), (NS, b), (NS, c)])
    assert index.num_blocks == 0 and index.bytes_used == 0
    index.add(NS, b, a, SIZE, 1.0)
    index.add(NS, a, b, SIZE, 1.0)
    assert len(eviction.older_than(index, cutoff=2.0)) == 2
    assert index.num_blocks == 0

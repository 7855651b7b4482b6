"""kvstore_server.index.PrefixIndex."""

from __future__ import annotations

from kvunit import NS, NS2, chain, h

from kvstore_server.index import PrefixIndex


def add_chain(
    index: PrefixIndex, hashes: list[bytes], ns: bytes = NS, size: int = 10, t: float = 1.0
) -> None:
    parent = b""
    for block_hash in hashes:
        assert index.add(ns, block_hash, parent, size, t)
        parent = block_hash


def leaves(index: PrefixIndex) -> list[tuple[bytes, bytes]]:
    """The chain tails, least recently used first: the order eviction takes them in."""
    return list(index._leaves)


def test_add_get_and_accounting() -> None:
    index = PrefixIndex()
    a = chain("a", 3)
    add_chain(index, a, size=7, t=5.0)
    assert index.num_blocks == 3
    assert index.bytes_used == 21
    entry = index.get(NS, a[1])
    assert entry is not None
    assert (entry.parent, entry.size, entry.created_at, entry.last_access) == (a[0], 7, 5.0, 5.0)
    assert index.get(NS, h("nope")) is None
    assert index.get(NS2, a[0]) is None
    assert not index.add(NS, a[1], a[0], 99, 9.0), "re-adding a stored block must be refused"
    assert index.bytes_used == 21
    assert index.get(NS, a[1]).size == 7


def test_prefix_len() -> None:
    index = PrefixIndex()
    a = chain("a", 4)
    add_chain(index, a[:3])
    assert index.prefix_len(NS, a) == 3
    assert index.prefix_len(NS, a[:2]) == 2
    assert index.prefix_len(NS, []) == 0
    assert index.prefix_len(NS, [h("x")] + a) == 0
    assert index.prefix_len(NS2, a) == 0
    # a stored block after a gap does not count
    index.add(NS, a[3], a[2], 10, 1.0)
    index.remove(NS, a[1])
    assert index.prefix_len(NS, a) == 1


def test_namespaces_are_separate() -> None:
    index = PrefixIndex()
    a = chain("a", 2)
    add_chain(index, a, ns=NS)
    add_chain(index, a, ns=NS2)
    assert index.num_blocks == 4
    assert sorted(index.namespaces()) == sorted([NS, NS2])
    assert sorted(index.keys(NS2)) == sorted((NS2, x) for x in a)
    assert len(list(index.keys())) == 4
    index.remove(NS, a[1])
    index.remove(NS, a[0])
    assert index.namespaces() == [NS2], "an emptied namespace disappears"
    assert index.prefix_len(NS2, a) == 2


def test_child_added_before_parent_links_up() -> None:
    # scan order is arbitrary: children may be loaded before their parents
    index = PrefixIndex()
    a = chain("a", 3)
    index.add(NS, a[2], a[1], 10, 1.0)
    index.add(NS, a[1], a[0], 10, 1.0)
    index.add(NS, a[0], b"", 10, 1.0)
    assert index.num_children(NS, a[0]) == 1
    assert index.num_children(NS, a[1]) == 1
    assert index.num_children(NS, a[2]) == 0
    assert leaves(index) == [(NS, a[2])], "only the chain tail is an eviction candidate"
    assert index.descendants(NS, a[0]) == [(NS, a[2]), (NS, a[1])]


def test_leaves_in_lru_order_and_touch_moves_to_back() -> None:
    index = PrefixIndex()
    a, b, c = chain("a", 2), chain("b", 2), chain("c", 1)
    add_chain(index, a)
    add_chain(index, b)
    add_chain(index, c)
    assert leaves(index) == [(NS, a[1]), (NS, b[1]), (NS, c[0])]
    index.touch(NS, a, now=50.0)
    assert leaves(index) == [(NS, b[1]), (NS, c[0]), (NS, a[1])]
    assert index.get(NS, a[0]).last_access == 50.0
    assert index.get(NS, a[1]).last_access == 50.0
    # touching an inner block updates its time but it is no candidate
    index.touch(NS, b[:1], now=60.0)
    assert index.get(NS, b[0]).last_access == 60.0
    assert leaves(index) == [(NS, b[1]), (NS, c[0]), (NS, a[1])]
    # unknown hashes and namespaces are ignored
    index.touch(NS, [h("unknown")], now=70.0)
    index.touch(NS2, a, now=70.0)
    assert index.get(NS, a[0]).last_access == 50.0


def test_eviction_order_is_lru_and_skips_protected() -> None:
    index = PrefixIndex()
    a, b = chain("a", 2), chain("b", 2)
    add_chain(index, a)
    add_chain(index, b)
    order = index.eviction_order({(NS, a[1])})
    first = next(order)
    assert first == (NS, b[1])
    index.remove(*first)
    # b[0] became the tail of its chain and is next; a[1] stays protected
    second = next(order)
    assert second == (NS, b[0])
    index.remove(*second)
    assert list(order) == [], "only protected leaves are left: nothing to yield"
    assert index.prefix_len(NS, a) == 2


def test_eviction_order_drains_everything_when_removed_as_yielded() -> None:
    index = PrefixIndex()
    a, b = chain("a", 3), chain("b", 2)
    add_chain(index, a)
    add_chain(index, b[:1], size=10)
    index.add(NS, b[1], b[0], 10, 1.0)
    index.add(NS, h("branch"), a[0], 10, 1.0)  # a[0] has two children
    seen = []
    for key in index.eviction_order():
        # every candidate is a leaf: nothing stored hangs below it
        assert index.num_children(*key) == 0
        index.remove(*key)
        seen.append(key)
    assert len(seen) == 6
    assert index.num_blocks == 0
    assert index.bytes_used == 0


def test_removing_a_middle_block_pushes_orphans_to_the_front() -> None:
    index = PrefixIndex()
    a = chain("a", 4)
    x = chain("x", 1)
    add_chain(index, x)
    add_chain(index, a)
    index.touch(NS, a, now=100.0)  # chain a is the most recently used
    assert leaves(index) == [(NS, x[0]), (NS, a[3])]
    removed = index.remove(NS, a[1])
    assert removed is not None and removed.parent == a[0]
    assert index.prefix_len(NS, a) == 1
    # a[2..3] can no longer be reached as a prefix: its tail goes first,
    # then a[0] (a fresh tail of the trimmed chain), and only then x
    order = leaves(index)
    assert order[0] == (NS, a[3])
    assert order.index((NS, a[0])) < order.index((NS, x[0]))
    # evicting the orphan's tail makes its parent (also an orphan) next in line
    index.remove(NS, a[3])
    assert leaves(index)[0] == (NS, a[2])


def test_remove_unknown_returns_none() -> None:
    index = PrefixIndex()
    add_chain(index, chain("a", 1))
    assert index.remove(NS, h("unknown")) is None
    assert index.remove(NS2, h("unknown")) is None
    assert index.num_blocks == 1


def test_remove_leaf_makes_parent_a_leaf_again() -> None:
    index = PrefixIndex()
    a = chain("a", 3)
    add_chain(index, a)
    index.remove(NS, a[2])
    assert leaves(index) == [(NS, a[1])]
    assert index.num_children(NS, a[1]) == 0
    # a parent with another child stays an inner block
    index.add(NS, h("b1"), a[0], 10, 1.0)
    index.remove(NS, a[1])
    assert (NS, a[0]) not in leaves(index)
    assert index.num_children(NS, a[0]) == 1


def test_descendants_deepest_first() -> None:
    #        r
    #      /   \
    #     a1    b1
    #     |     |
    #     a2    b2
    #     |
    #     a3
    index = PrefixIndex()
    r = h("r")
    index.add(NS, r, b"", 1, 1.0)
    add = [("a1", r), ("a2", h("a1")), ("a3", h("a2")), ("b1", r), ("b2", h("b1"))]
    for name, parent in add:
        index.add(NS, h(name), parent, 1, 1.0)
    desc = index.descendants(NS, r)
    assert sorted(desc) == sorted((NS, h(n)) for n, _ in add)
    pos = {key[1]: i for i, key in enumerate(desc)}
    for name, parent in add:
        if parent != r:
            assert pos[h(name)] < pos[parent], f"{name} must come before its parent"
    assert index.descendants(NS, h("a2")) == [(NS, h("a3"))]
    assert index.descendants(NS, h("a3")) == []
    # removing in that order is always removing a leaf
    for key in desc:
        assert index.num_children(*key) == 0
        index.remove(*key)
    assert index.num_blocks == 1


def test_sort_leaves_orders_by_last_access() -> None:
    index = PrefixIndex()
    index.add(NS, h("new"), b"", 1, 30.0)
    index.add(NS, h("old"), b"", 1, 10.0)
    index.add(NS, h("mid"), b"", 1, 20.0)
    index.sort_leaves()
    assert leaves(index) == [(NS, h("old")), (NS, h("mid")), (NS, h("new"))]
    assert next(index.eviction_order()) == (NS, h("old"))


def test_parent_links_that_form_a_cycle_do_not_hang() -> None:
    # Parents are client-supplied: put [b] under a, then [a] under b.
    index = PrefixIndex()
    a, b = h("a"), h("b")
    index.add(NS, b, a, 10, 1.0)
    index.add(NS, a, b, 10, 1.0)
    assert index.descendants(NS, a) == [(NS, b)]
    assert index.descendants(NS, b) == [(NS, a)]
    index.remove(NS, a)  # removal walks the descendants too
    assert index.num_blocks == 1
    assert index.descendants(NS, b) == []
    # a block claiming itself as parent
    index.add(NS, h("self"), h("self"), 10, 1.0)
    assert index.descendants(NS, h("self")) == []
    assert index.remove(NS, h("self")) is not None


def test_add_chain_indexes_as_adding_each_block_does() -> None:
    """add_chain (a put's blocks at once) leaves the index as add() one by one does: the
    blocks stored already are skipped, a stored parent stops being a tail, a block whose
    child came first (a scan's order) is no tail, and the tails keep add()'s order."""
    a, b = chain("a", 6), chain("b", 2)

    def build(at_once: bool) -> tuple[PrefixIndex, int]:
        index = PrefixIndex()
        add_chain(index, a[:2])  # a[1]: a tail the put extends
        index.add(NS, a[5], a[4], 10, 1.0)  # a child indexed before its parent
        add_chain(index, b)
        blocks, parents = [a[1], a[2], a[3], a[4]], [a[0], a[1], a[2], a[3]]
        if at_once:
            return index, index.add_chain(NS, blocks, parents, 10, 2.0, 4)
        return index, sum(index.add(NS, x, p, 10, 2.0, 4) for x, p in zip(blocks, parents, strict=True))

    one_by_one, added = build(at_once=False)
    together, added_together = build(at_once=True)
    assert added == added_together == 3
    assert leaves(together) == leaves(one_by_one) == [(NS, a[5]), (NS, b[1])]
    assert (
        (together.num_blocks, together.bytes_used)
        == (one_by_one.num_blocks, one_by_one.bytes_used)
        == (8, 80)
    )
    assert together.get(NS, a[3]).num_layers == 4 and together.get(NS, a[1]).created_at == 1.0

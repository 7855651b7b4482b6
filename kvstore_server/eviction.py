"""Capacity accounting and eviction policy.

Policy: least-recently-used chain tails first. Only leaves (blocks with no
stored child) are candidates, so every surviving block is still reachable as a
prefix; when a tail goes, its parent becomes a tail and is next in line for that
chain. Blocks cut off from their chain root (their ancestor was consumed by
DropSelect or failed its checksum) go before anything else.

Each function removes its victims from the index and returns them; the caller
deletes them from the backend in the same commit.
"""

from __future__ import annotations

from kvstore_server.index import PrefixIndex
from kvstore_server.tiers import BlockKey


def make_room(index: PrefixIndex, incoming: int, capacity: int, protect: set[BlockKey]) -> list[BlockKey]:
    """Evict tails until `incoming` more bytes fit in `capacity`."""
    return down_to(index, capacity - incoming, protect)


def evictable_bytes(index: PrefixIndex, protect: set[BlockKey]) -> int:
    """Bytes that evicting with `protect` could free: all but the protected blocks and
    their ancestors (a block with a protected descendant never becomes a tail)."""
    kept = 0
    seen: set[BlockKey] = set()
    for key in protect:
        while key not in seen:
            seen.add(key)
            entry = index.get(*key)
            if entry is None:
                break
            kept += entry.size
            if not entry.parent:
                break
            key = (key[0], entry.parent)
    return index.bytes_used - kept


def down_to(index: PrefixIndex, target: int, protect: set[BlockKey] | None = None) -> list[BlockKey]:
    """Evict tails until at most `target` bytes are used (or nothing evictable is left)."""
    victims: list[BlockKey] = []
    for key in index.eviction_order(protect or set()):
        if index.bytes_used <= target:
            break
        index.remove(*key)
        victims.append(key)
    return victims


def subtree(index: PrefixIndex, namespace: bytes, block_hash: bytes) -> list[BlockKey]:
    """Evict a block and everything stored below it."""
    keys = index.descendants(namespace, block_hash)
    if index.get(namespace, block_hash) is not None:
        keys.append((namespace, block_hash))
    for key in keys:
        index.remove(*key)
    return keys


def older_than(index: PrefixIndex, cutoff: float, tenant: bytes = b"") -> list[BlockKey]:
    """Evict blocks last used before `cutoff` (unix seconds), with what hangs below them.

    Only `tenant`'s namespaces (those starting with its bytes) are considered.
    """
    old = [
        key
        for key in index.keys(prefix=tenant)
        if (entry := index.get(*key)) is not None and entry.last_access < cutoff
    ]
    victims: list[BlockKey] = []
    for key in old:
        victims.extend(subtree(index, *key))
    return victims


def namespace(index: PrefixIndex, ns: bytes | None, tenant: bytes = b"") -> list[BlockKey]:
    """Evict every block of one namespace, or of all of `tenant`'s when `ns` is None."""
    keys = list(index.keys(ns, tenant))
    # Newest first: children go before their parents, so no removal has
    # descendants left to walk (root-first is quadratic in chain length).
    keys.reverse()
    for key in keys:
        index.remove(*key)
    return keys

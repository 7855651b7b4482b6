"""The block-hash prefix index: what is stored, chained how, used when.

In memory, rebuilt from the backend's metadata at start. Answers Lookup
without touching storage, and keeps what eviction needs: sizes, parent/child
links and the least-recently-used order of chain tails (leaves).

Not thread-safe: `Store` holds its lock around every call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import msgspec

from kvstore_server.tiers import BlockKey


class Entry(msgspec.Struct, gc=False):  # type: ignore[call-arg]
    """A stored block in the index. A msgspec Struct outside the cyclic collector's reach
    (it refers to no container): a commit makes one per block, and as tracked objects they
    set off the collections that add_chain then paid for (indexing chains of 14 blocks into
    a growing index: 35-40 us a chain on average on the 2-core VM, 28-32 as Structs)."""

    parent: bytes
    size: int
    num_layers: int
    created_at: float
    last_access: float


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[bytes, dict[bytes, Entry]] = {}
        # children by parent key, whether or not the parent is stored: a block
        # scanned before its parent at start still links up.
        self._children: dict[BlockKey, set[bytes]] = {}
        # stored blocks without stored children, least recently used first
        self._leaves: OrderedDict[BlockKey, None] = OrderedDict()
        self.bytes_used = 0
        self.num_blocks = 0

    # ---- queries
    def get(self, namespace: bytes, block_hash: bytes) -> Entry | None:
        blocks = self._blocks.get(namespace)
        return blocks.get(block_hash) if blocks else None

    def prefix_len(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        blocks = self._blocks.get(namespace)
        if not blocks:
            return 0
        for i, block_hash in enumerate(hashes):
            if block_hash not in blocks:
                return i
        return len(hashes)

    def num_children(self, namespace: bytes, block_hash: bytes) -> int:
        return len(self._children.get((namespace, block_hash), ()))

    def namespaces(self) -> list[bytes]:
        return list(self._blocks)

    def hashes(self, namespace: bytes) -> list[bytes]:
        """A copy of one namespace's stored block hashes, in no order."""
        return list(self._blocks.get(namespace, ()))

    def keys(self, namespace: bytes | None = None, prefix: bytes = b"") -> Iterator[BlockKey]:
        """Keys of one namespace, or of every namespace starting with `prefix`."""
        spaces = (
            [namespace] if namespace is not None else [ns for ns in self._blocks if ns.startswith(prefix)]
        )
        for ns in spaces:
            for block_hash in self._blocks.get(ns, ()):
                yield (ns, block_hash)

    def descendants(self, namespace: bytes, block_hash: bytes) -> list[BlockKey]:
        """Stored descendants of a block, deepest first (a safe removal order)."""
        out: list[BlockKey] = []
        stack = [block_hash]
        # Parents are whatever clients claimed, so the links may form a cycle.
        seen = {block_hash}
        while stack:
            for child in self._children.get((namespace, stack.pop()), ()):
                if child not in seen and self.get(namespace, child) is not None:
                    seen.add(child)
                    out.append((namespace, child))
                    stack.append(child)
        out.reverse()
        return out

    def eviction_order(self, protect: set[BlockKey] = frozenset()) -> Iterator[BlockKey]:  # type: ignore[assignment]
        """Leaves, least recently used first. Safe to remove each key as it is yielded."""
        while True:
            for key in self._leaves:
                if key not in protect:
                    break
            else:
                return
            yield key

    # ---- updates
    def add(
        self,
        namespace: bytes,
        block_hash: bytes,
        parent: bytes,
        size: int,
        created_at: float,
        num_layers: int = 0,
    ) -> bool:
        """Index one block; False when it is indexed already."""
        return self.add_chain(namespace, (block_hash,), (parent,), size, created_at, num_layers) == 1

    def add_chain(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        size: int,
        created_at: float,
        num_layers: int = 0,
    ) -> int:
        """Index each block of a put, parents before children (a block is a leaf until one of
        its children is indexed; a child indexed first, as a scan may, keeps it from being
        one); how many were not indexed yet. One call per put: a commit of 128 blocks spent
        0.25 ms in a call per block on the 2-core VM."""
        blocks = self._blocks.setdefault(namespace, {})
        children, leaves = self._children, self._leaves
        added = 0
        for block_hash, parent in zip(hashes, parents, strict=True):
            if block_hash in blocks:
                continue
            blocks[block_hash] = Entry(parent, size, num_layers, created_at, created_at)
            added += 1
            if parent:
                siblings = children.get((namespace, parent))
                if siblings is None:
                    children[(namespace, parent)] = {block_hash}
                else:
                    siblings.add(block_hash)
                leaves.pop((namespace, parent), None)
            key = (namespace, block_hash)
            if key not in children or not children[key]:
                leaves[key] = None
        self.bytes_used += size * added
        self.num_blocks += added
        return added

    def remove(self, namespace: bytes, block_hash: bytes) -> Entry | None:
        blocks = self._blocks.get(namespace)
        entry = blocks.pop(block_hash, None) if blocks is not None else None
        if entry is None:
            return None
        if not blocks:
            del self._blocks[namespace]
        self.bytes_used -= entry.size
        self.num_blocks -= 1
        key = (namespace, block_hash)
        self._leaves.pop(key, None)
        if entry.parent:
            parent_key = (namespace, entry.parent)
            siblings = self._children.get(parent_key)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self._children[parent_key]
                    if self.get(*parent_key) is not None:
                        # the parent is now a chain tail: trim this chain next
                        self._leaves[parent_key] = None
                        self._leaves.move_to_end(parent_key, last=False)
        if self._children.get(key):
            # What hung below this block can no longer be reached as a prefix:
            # let eviction take it first.
            for orphan in self.descendants(namespace, block_hash):
                if orphan in self._leaves:
                    self._leaves.move_to_end(orphan, last=False)
        return entry

    def touch(self, namespace: bytes, hashes: Sequence[bytes], now: float | None = None) -> None:
        blocks = self._blocks.get(namespace)
        if not blocks:
            return
        now = time.time() if now is None else now
        for block_hash in hashes:
            entry = blocks.get(block_hash)
            if entry is None:
                continue
            entry.last_access = now
            key = (namespace, block_hash)
            if key in self._leaves:
                self._leaves.move_to_end(key)

    def sort_leaves(self) -> None:
        """Order leaves by last access; after a bulk load at start."""
        order = sorted(self._leaves, key=lambda key: self._blocks[key[0]][key[1]].last_access)
        self._leaves = OrderedDict.fromkeys(order)

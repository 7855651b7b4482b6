"""The store: a backend plus the prefix index, capacity and the hand-off wait.

`Store` is what the gRPC servicer calls, from many worker threads at once. It
takes validated Python values and raises the errors below; translating them to
gRPC status codes is the servicer's job.

Locks: `_lock` guards the index and counters and is held only for in-memory
work. `_commit_lock` serialises everything that changes the backend (puts,
evictions, drop-selects), so the index and the backend change together.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from kvstore_server import eviction
from kvstore_server.index import Entry, PrefixIndex
from kvstore_server.tiers import (
    Backend,
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    StorageError,
    StorageFullError,
    StoredBlock,
    checksum,
)

log = logging.getLogger(__name__)


class StoreError(Exception):
    """Base of the errors the store raises to the servicer."""


class InvalidChain(StoreError):
    """The put would link blocks into a cycle (parents are what clients claim)."""


class CapacityError(StoreError):
    """The request cannot fit in the store's byte budget."""


class NotFoundError(StoreError):
    """The named block is not stored."""


class WaitTimeout(StoreError):
    """DropSelect's wait ran out before the whole prefix was stored."""


class ShuttingDown(StoreError):
    """The store is closing; the call should be retried elsewhere or later."""


@dataclass
class Counters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    puts: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    checksum_failures: int = 0


@dataclass(frozen=True, slots=True)
class PutResult:
    blocks_written: int
    blocks_skipped: int
    bytes_written: int
    blocks_evicted: int


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A stored prefix being read: `blocks` are valid inside the context only."""

    layers: tuple[LayerSpec, ...]
    blocks: list[StoredBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    namespace: bytes
    block_hash: bytes
    entry: Entry
    num_children: int


Listener = Callable[[str, bytes, Sequence[bytes], Sequence[bytes]], None]
"""Called as listener(kind, namespace, hashes, parents) with kind "stored" or "removed",
under the store's lock, in commit order."""


class Store:
    def __init__(self, backend: Backend, capacity_bytes: int) -> None:
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self.counters = Counters()
        self.started_at = time.time()
        self._index = PrefixIndex()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._commit_lock = threading.Lock()
        self._draining = False  # DropSelect waiters give up
        self._closed = False  # no more writes
        self._listeners: list[Listener] = []
        self._eviction_helps = True  # see _write
        for meta in backend.scan():
            self._index.add(
                meta.namespace,
                meta.block_hash,
                meta.parent_hash,
                meta.size,
                meta.created_at,
                len(meta.layers),
            )
        self._index.sort_leaves()
        if self._index.bytes_used > capacity_bytes:
            with self._commit_lock, self._lock:
                victims = eviction.down_to(self._index, capacity_bytes)
            self._reconcile(victims)
            log.info("evicted %d blocks to fit the configured capacity", len(victims))
        log.info(
            "loaded %d blocks (%d bytes) in %d namespaces from the %s backend",
            self._index.num_blocks,
            self._index.bytes_used,
            len(self._index.namespaces()),
            backend.name,
        )

    # ---- serving path
    def lookup(self, namespace: bytes, hashes: Sequence[bytes]) -> int:
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
            self._index.touch(namespace, hashes[:n])
            self.counters.lookups += 1
            self.counters.hit_blocks += n
            self.counters.miss_blocks += len(hashes) - n
        return n

    def put(
        self,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        data: Sequence[Sequence[memoryview]],
        checksums: Sequence[Sequence[int]] | None = None,
        joined: Sequence[memoryview] | None = None,
    ) -> PutResult:
        """Store blocks; data[layer][block] is one block's bytes of one layer.

        `checksums[layer][block]` may come precomputed (the servicer sums each
        chunk as it arrives, outside the commit lock); else they are computed here.
        `joined[block]`, when given, is that block's layers back to back (see BlockWrite).
        """
        block_bytes = sum(layer.nbytes for layer in layers)
        chain = {(namespace, h) for h in hashes}
        if parent_hash:
            chain.add((namespace, parent_hash))
        with self._commit_lock:
            with self._lock:
                if self._closed:
                    raise ShuttingDown("the store is closed")
                fresh = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
                if fresh and parent_hash:
                    self._check_acyclic(namespace, parent_hash, hashes)
                incoming = block_bytes * len(fresh)
                if incoming > self.capacity_bytes:
                    raise CapacityError(
                        f"put of {incoming} bytes exceeds the store's capacity of {self.capacity_bytes} bytes"
                    )
                victims = eviction.make_room(self._index, incoming, self.capacity_bytes, chain)
                self._emit_removed(victims)
                self.counters.evictions += len(victims)
                fits = self._index.bytes_used + incoming <= self.capacity_bytes
            if not fits:
                self._reconcile(victims)
                raise CapacityError("not enough evictable data to make room for this put")
            now = time.time()
            writes = [
                BlockWrite(
                    BlockMeta(
                        namespace=namespace,
                        block_hash=hashes[i],
                        parent_hash=hashes[i - 1] if i else parent_hash,
                        layers=tuple(layers),
                        checksums=tuple(
                            checksums[k][i] if checksums is not None else checksum(data[k][i])
                            for k in range(len(layers))
                        ),
                        created_at=now,
                    ),
                    [data[k][i] for k in range(len(layers))],
                    joined[i] if joined is not None else None,
                )
                for i in fresh
            ]
            extra = self._write(writes, victims, chain)
            with self._lock:
                for w in writes:
                    m = w.meta
                    self._index.add(namespace, m.block_hash, m.parent_hash, block_bytes, now, len(layers))
                self.counters.puts += 1
                self.counters.blocks_written += len(writes)
                self.counters.bytes_written += incoming
                if writes:
                    for listener in self._listeners:
                        listener(
                            "stored",
                            namespace,
                            [w.meta.block_hash for w in writes],
                            [w.meta.parent_hash for w in writes],
                        )
                self._changed.notify_all()
        return PutResult(len(writes), len(hashes) - len(writes), incoming, len(victims) + len(extra))

    def _check_acyclic(self, namespace: bytes, parent_hash: bytes, hashes: Sequence[bytes]) -> None:
        # Within a put the chain is linear (hashes are unique); a cycle needs an
        # ancestor of the parent to be one of the new blocks.
        new = set(hashes)
        seen: set[bytes] = set()
        ancestor: bytes = parent_hash
        while ancestor and ancestor not in seen:
            if ancestor in new:
                raise InvalidChain("the put's blocks are ancestors of its parent: parents would form a cycle")
            seen.add(ancestor)
            entry = self._index.get(namespace, ancestor)
            if entry is None:
                return
            ancestor = entry.parent

    def _write(
        self, writes: list[BlockWrite], victims: list[BlockKey], protect: set[BlockKey]
    ) -> list[BlockKey]:
        """Write and delete `victims`; return what else had to be evicted.

        When the backend is full below the byte budget (the filesystem, or LMDB's
        map), eviction gets one chance: as many more bytes as the put brings (and
        one block), and only if that much is evictable. If the write still fails,
        eviction evidently does not help (another process holds the space, a reader
        pins LMDB's pages): later full writes fail at once, without evicting, until
        a write succeeds. So a full disk never empties the store for puts that fail.
        """
        try:
            self.backend.write(writes, victims)
            self._eviction_helps = True
            return []
        except StorageFullError as exc:
            full = exc
        except StorageError:
            self._reconcile(victims)
            raise
        if not writes:  # only the victims' deletion failed: nothing needs room
            self._reconcile(victims)
            return []
        incoming = sum(w.meta.size for w in writes)
        with self._lock:
            if not self._eviction_helps:
                reason = "the last eviction for room did not help; none is tried until a put succeeds"
            elif eviction.evictable_bytes(self._index, protect) < incoming:
                reason = f"evicting everything evictable would not free the {incoming} bytes it needs"
            else:
                reason = ""
                # NOTE: one block more than the put brings: LMDB stores a block in
                # contiguous pages, and the put's own small allocations split one
                # freed run; the disk backend just frees a little more than it needs.
                need = incoming + max(w.meta.size for w in writes)
                extra = eviction.down_to(self._index, self._index.bytes_used - need, protect)
                self._emit_removed(extra)
                self.counters.evictions += len(extra)
        if reason:
            self._reconcile(victims)
            raise CapacityError(f"no room for this put ({full}); {reason}") from full
        log.warning("%s; evicted %d more blocks to make room for a put", full, len(extra))
        try:
            self.backend.write(writes, victims + extra)
            return extra
        except StorageFullError as exc:
            self._eviction_helps = False
            self._reconcile(victims + extra)
            log.warning("no room after evicting %d blocks: full puts fail without eviction now", len(extra))
            raise CapacityError(f"no room for this put after evicting {len(extra)} blocks: {exc}") from exc
        except StorageError:
            self._reconcile(victims + extra)
            raise

    def _reconcile(self, victims: list[BlockKey]) -> None:
        """Delete from the backend what the index already dropped. A backend that cannot
        (a failing disk) is logged: the blocks are not served, and return at restart."""
        if not victims:
            return
        try:
            self.backend.delete(victims)
        except StorageError as exc:
            log.error("could not delete %d evicted blocks; they return at restart: %s", len(victims), exc)

    @contextmanager
    def read(self, namespace: bytes, hashes: Sequence[bytes]) -> Iterator[ReadResult]:
        """The stored prefix of `hashes`, verified; a bad or vanished block ends it."""
        with self._lock:
            n = self._index.prefix_len(namespace, hashes)
            self._index.touch(namespace, hashes[:n])
        keys = [(namespace, h) for h in hashes[:n]]
        with self.backend.read(keys) as blocks:
            result = self._verified_prefix(blocks, keys)
            yield result
        self._count_read(result)

    @contextmanager
    def take(
        self, namespace: bytes, hashes: Sequence[bytes], wait_seconds: float, is_active: Callable[[], bool]
    ) -> Iterator[ReadResult]:
        """DropSelect: wait until the whole prefix is stored, then read and remove it."""
        deadline = time.monotonic() + wait_seconds
        keys = [(namespace, h) for h in hashes]
        with ExitStack() as stack:
            while True:
                self._wait_for_prefix(namespace, hashes, deadline, wait_seconds, is_active)
                with self._commit_lock:
                    with self._lock:
                        if self._index.prefix_len(namespace, hashes) != len(hashes):
                            continue  # another DropSelect or an eviction was first: wait again
                        for key in reversed(keys):  # tail first: nothing left below to walk
                            self._index.remove(*key)
                        self._emit_removed(keys)
                    blocks = stack.enter_context(self.backend.read(keys))
                    # The read snapshot keeps the bytes readable after this delete.
                    self._reconcile(keys)
                break
            result = self._verified_prefix(blocks, keys, remove_bad=False)
            yield result
        self._count_read(result)

    def _wait_for_prefix(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        deadline: float,
        wait_seconds: float,
        is_active: Callable[[], bool],
    ) -> None:
        while True:
            with self._changed:
                if self._draining:
                    raise ShuttingDown("the store is shutting down")
                if self._index.prefix_len(namespace, hashes) == len(hashes):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"prefix of {len(hashes)} blocks not stored within {wait_seconds:g}s")
                # Bounded waits: notice a cancelled caller within half a second.
                self._changed.wait(min(remaining, 0.5))
            if not is_active():
                raise WaitTimeout("caller went away")

    def _verified_prefix(
        self, blocks: list[StoredBlock | None], keys: list[BlockKey], remove_bad: bool = True
    ) -> ReadResult:
        good: list[StoredBlock] = []
        for block, key in zip(blocks, keys, strict=True):
            if block is None:
                break
            bad_layer = block.corrupt_layer()
            if bad_layer is not None:
                log.error(
                    "checksum mismatch in block %s layer %r: treating it as a miss and removing it",
                    key[1].hex(),
                    block.meta.layers[bad_layer].name,
                )
                with self._lock:
                    self.counters.checksum_failures += 1
                if remove_bad:
                    self._remove_corrupt(key)
                break
            if good and block.meta.layers != good[0].meta.layers:
                log.warning("block %s has another layer layout than its prefix; stopping there", key[1].hex())
                break
            good.append(block)
        return ReadResult(good[0].meta.layers if good else (), good)

    def _remove_corrupt(self, key: BlockKey) -> None:
        with self._commit_lock:
            with self._lock:
                if self._index.remove(*key) is not None:
                    self._emit_removed([key])
            # deleting inside a read snapshot is safe: the snapshot keeps its pages
            self._reconcile([key])

    def _count_read(self, result: ReadResult) -> None:
        with self._lock:
            self.counters.bytes_read += sum(layer.nbytes for layer in result.layers) * result.num_blocks

    # ---- operators
    def evict(self, select: Callable[[PrefixIndex], list[BlockKey]]) -> tuple[int, int]:
        """Evict what `select` picks (one of kvstore_server.eviction's functions)."""
        with self._commit_lock:
            with self._lock:
                before = self._index.bytes_used
                victims = select(self._index)
                freed = before - self._index.bytes_used
                self._emit_removed(victims)
                self.counters.evictions += len(victims)
            self._reconcile(victims)
        if victims:
            log.info("evicted %d blocks (%d bytes) on request", len(victims), freed)
        return len(victims), freed

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            return {
                "blocks": self._index.num_blocks,
                "bytes_used": self._index.bytes_used,
                "capacity_bytes": self.capacity_bytes,
                "namespaces": len(self._index.namespaces()),
                "backend": self.backend.name,
                "uptime_seconds": time.time() - self.started_at,
                **vars(self.counters),
            }

    def list_blocks(
        self, namespace: bytes | None, limit: int, after: BlockKey | None, prefix: bytes = b""
    ) -> tuple[list[BlockInfo], BlockKey | None]:
        """Blocks in (namespace, hash) order, after `after`; at most `limit`; and the key
        to continue after (None: that was the last page).

        `namespace` None: every namespace that starts with `prefix`. The lock is
        held only to copy one namespace's hashes at a time (C speed) and to read
        the page's entries: ordering a large store's keys (seconds for millions)
        never stalls lookups and puts. A block removed meanwhile is left out.
        """
        with self._lock:
            spaces = [namespace] if namespace is not None else self._index.namespaces()
        keys: list[BlockKey] = []
        for ns in sorted(s for s in spaces if s.startswith(prefix) and (after is None or s >= after[0])):
            with self._lock:
                hashes = self._index.hashes(ns)
            if after is not None and ns == after[0]:
                hashes = [h for h in hashes if h > after[1]]
            keys.extend((ns, h) for h in heapq.nsmallest(limit - len(keys), hashes))
            if len(keys) == limit:
                break
        with self._lock:
            infos = [self._info(k) for k in keys if self._index.get(*k) is not None]
        return infos, keys[-1] if len(keys) == limit else None

    def describe(self, namespace: bytes, block_hash: bytes) -> tuple[BlockInfo, BlockMeta]:
        with self._lock:
            if self._index.get(namespace, block_hash) is None:
                raise NotFoundError(f"block {block_hash.hex()} is not stored in this namespace")
            info = self._info((namespace, block_hash))
        with self.backend.read([(namespace, block_hash)]) as blocks:
            block = blocks[0]
            if block is None:
                raise NotFoundError(f"block {block_hash.hex()} vanished while being described")
            return info, block.meta

    def _info(self, key: BlockKey) -> BlockInfo:
        entry = self._index.get(*key)
        if entry is None:
            raise NotFoundError(key[1].hex())
        return BlockInfo(key[0], key[1], entry, self._index.num_children(*key))

    # ---- events and lifecycle
    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _emit_removed(self, keys: Sequence[BlockKey]) -> None:
        if not keys or not self._listeners:
            return
        by_ns: dict[bytes, list[bytes]] = {}
        for ns, h in keys:
            by_ns.setdefault(ns, []).append(h)
        for ns, hashes in by_ns.items():
            for listener in self._listeners:
                listener("removed", ns, hashes, [])

    def begin_shutdown(self) -> None:
        """Release DropSelect waiters (UNAVAILABLE); everything else keeps working."""
        with self._changed:
            self._draining = True
            self._changed.notify_all()

    def close(self) -> None:
        """Close the backend; called once, after the server stopped."""
        self.begin_shutdown()
        with self._commit_lock:
            with self._lock:
                self._closed = True
            self.backend.close()

"""The ways into the store, all ending in one admission (`Admitting._admit`).

    put          a gRPC Put: blocks written to the persistent tier
    reserve      an arena extent leased to a saver (tiers.arena: reservations are the
                 memory tier's), which writes it and then `commit`s (or `abort`s)
    put_part     one tensor-parallel rank's KV heads (kvstore_server.parts): assembled in
                 place in one arena extent, committed there once whole
    _into_arena  blocks the daemon holds (a fleet hit, a block whole in the heap) copied
                 into a fresh extent and committed like a save

`_admit` refuses a closed store, a cycle and what exceeds the capacity, makes room
by evicting (chain tails first), has the tier write the new blocks (`Place`), then
indexes and announces them.

NOTE: over 500 lines: the four ways in and the persistent tier's full-disk policy
(_write) share the admission and its room-making; split, each would reach into the
others' checks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import arena_format as fmt
from kvstore.blocks import CHECKSUMS, XXH3, PackedSums, PutResult
from kvstore.kv_events_media import MEMORY, PERSISTENT
from kvstore_server import eviction
from kvstore_server.errors import (
    CapacityError,
    InvalidChain,
    InvalidCommit,
    InvalidPart,
    LeaseNotFound,
    ShuttingDown,
)
from kvstore_server.ledger import Ledger
from kvstore_server.parts import PartError, PartsFull, Whole, block_major, layer_major
from kvstore_server.tiers import (
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    StorageError,
    StorageFullError,
    checksum,
)
from kvstore_server.tiers.arena import MemoryTier, NoRoom, Reservation

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admission:
    """Blocks on their way into the store, whichever way they came (Store._admit)."""

    what: str  # "put" or "commit", for messages
    namespace: bytes
    parent_hash: bytes  # the request's parent (of its first block)
    hashes: Sequence[bytes]  # in chain order
    parents: Sequence[bytes]  # each block's parent
    layers: tuple[LayerSpec, ...]
    tokens: Sequence[Sequence[int]] | None = None  # each block's token ids (KV events)
    skipped: int = 0  # blocks of the request found stored before (a reservation's)
    to_fleet: bool = True  # queue the new blocks for the fleet (not blocks that came from it)


Place = Callable[[list[int], list[BlockKey], set[BlockKey], float], "tuple[str, list[BlockKey]]"]
"""place(fresh, victims, protect, now): write blocks `fresh` (indices into the admission)
to their tier, created at `now`, and delete `victims` from every tier; returns the tier's
KV-events medium and the blocks it had to evict beyond the victims (already dropped)."""


def _block_tokens(token_ids: Sequence[int], blocks: int, indices: Sequence[int]) -> list[list[int]] | None:
    """The tokens of blocks `indices` of a put's `blocks` (None: the put gave none)."""
    if not token_ids:
        return None
    per = len(token_ids) // blocks
    return [list(token_ids[i * per : (i + 1) * per]) for i in indices]


def _chained(parent_hash: bytes, hashes: Sequence[bytes]) -> list[bytes]:
    """Each block's parent in a chain of `hashes` that continues `parent_hash`."""
    return [hashes[i - 1] if i else parent_hash for i in range(len(hashes))]


def _runs(whole: Sequence[Whole]) -> list[list[Whole]]:
    """Blocks made whole, split into runs that are chains (each block's parent is the one
    before it) lying in one place (an arena extent, or the heap) with one checksum kind:
    each run is one put."""
    runs: list[list[Whole]] = []
    for block in whole:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last.block_hash == block.parent
            and (last.extent, last.kind)
            == (
                block.extent,
                block.kind,
            )
        ):
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _sum(results: Sequence[PutResult], skipped: int = 0) -> PutResult:
    return PutResult(
        sum(r.blocks_written for r in results),
        skipped + sum(r.blocks_skipped for r in results),
        sum(r.bytes_written for r in results),
        sum(r.blocks_evicted for r in results),
    )


class Admitting(Ledger):
    """The ways in (see the module docstring); a layer of kvstore_server.store.Store."""

    def put(
        self,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        data: Sequence[Sequence[memoryview]],
        checksums: Sequence[Sequence[int]] | None = None,
        joined: Sequence[memoryview] | None = None,
        *,
        to_fleet: bool = True,
        token_ids: Sequence[int] = (),
        subset: tuple[int, ...] | None = None,
    ) -> PutResult:
        """Store blocks in the persistent tier; data[layer][block] is one block's bytes of one layer.

        `checksums[layer][block]` may come precomputed (the servicer sums each
        chunk as it arrives, outside the commit lock); else they are computed here.
        `joined[block]`, when given, is that block's layers back to back (see BlockWrite).
        `to_fleet`: queue the blocks written for the fleet (not for blocks that came from it).
        `subset`: a partial put of these layers of `layers` (data[k] is layer subset[k]):
        its blocks are stored once parts have covered all their layers (see put_part).
        """
        if subset is not None:
            return self.put_part(
                namespace, parent_hash, hashes, layers, subset, lambda k, i: data[k][i], token_ids=token_ids,
                sums=None if checksums is None else layer_major(checksums),
            )  # fmt: skip
        spec = tuple(layers)
        parents = _chained(parent_hash, hashes)
        tokens = _block_tokens(token_ids, len(hashes), range(len(hashes)))

        def place(
            fresh: list[int], victims: list[BlockKey], protect: set[BlockKey], now: float
        ) -> tuple[str, list[BlockKey]]:
            writes = [
                BlockWrite(
                    BlockMeta(
                        namespace,
                        hashes[i],
                        parents[i],
                        spec,
                        tuple(
                            checksums[k][i] if checksums is not None else checksum(data[k][i])
                            for k in range(len(spec))
                        ),
                        now,
                    ),  # fmt: skip
                    [data[k][i] for k in range(len(spec))],
                    joined[i] if joined is not None else None,
                )
                for i in fresh
            ]
            return PERSISTENT, self._write(writes, victims, protect)

        admission = Admission("put", namespace, parent_hash, hashes, parents, spec, tokens, to_fleet=to_fleet)
        with self._commit_lock:
            return self._admit(admission, place)

    def _admit(self, blocks: Admission, place: Place) -> PutResult:
        """The one way into the store (caller holds the commit lock): refuse a closed
        store, a cycle, what exceeds the capacity; make room by evicting (chain tails
        first, never the blocks' own chain); `place` the blocks the index lacks in their
        tier; index and announce them."""
        ns, hashes, spec = blocks.namespace, blocks.hashes, blocks.layers
        block_bytes = sum(layer.nbytes for layer in spec)
        chain = {(ns, h) for h in hashes} | ({(ns, blocks.parent_hash)} if blocks.parent_hash else set())
        self._drop_evicted()
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            fresh = [i for i, h in enumerate(hashes) if self._index.get(ns, h) is None]
            if fresh and blocks.parent_hash:
                self._check_acyclic(ns, blocks.parent_hash, hashes)
            incoming = block_bytes * len(fresh)
            if incoming > self.capacity_bytes:
                raise CapacityError(f"{blocks.what} of {incoming} bytes exceeds the store's capacity "
                                    f"of {self.capacity_bytes} bytes")  # fmt: skip
            victims = eviction.make_room(self._index, incoming, self.capacity_bytes, chain)
            self._emit_removed(victims)
            self.counters.evictions += len(victims)
            fits = self._index.bytes_used + incoming <= self.capacity_bytes
        if not fits:
            self.tiers.delete(victims)
            raise CapacityError(f"not enough evictable data to make room for this {blocks.what}")
        now = time.time()
        tier, extra = place(fresh, victims, chain, now)
        new_hashes, new_parents = [hashes[i] for i in fresh], [blocks.parents[i] for i in fresh]
        with self._lock:
            self._index.add_chain(ns, new_hashes, new_parents, block_bytes, now, len(spec))
            self.counters.puts += 1
            self.counters.blocks_written += len(fresh)
            self.counters.bytes_written += incoming
            if fresh:
                if blocks.to_fleet and self._fleet_writer is not None:
                    self._fleet_writer.add([(ns, h) for h in new_hashes], block_bytes)
                tokens = [blocks.tokens[i] for i in fresh] if blocks.tokens else None
                for listener in self._listeners:
                    listener("stored", ns, new_hashes, new_parents, tokens, tier)
            self._changed.notify_all()
        return PutResult(
            len(fresh), blocks.skipped + len(hashes) - len(fresh), incoming, len(victims) + len(extra)
        )

    def _admit_in_place(
        self,
        blocks: Admission,
        extent: int,
        extent_blocks: int,
        positions: Sequence[int],
        checksums: Sequence[Sequence[int]],
        kind: str,
        res: Reservation | None = None,
    ) -> PutResult:
        """_admit blocks whose bytes lie in an arena extent the caller holds (a reservation's,
        or a part group's), block i at positions[i], into the memory tier (committed there:
        resident, queued for write-behind). Caller holds the commit lock."""
        memory = self._tier()

        def place(
            fresh: list[int], victims: list[BlockKey], _: set[BlockKey], now: float
        ) -> tuple[str, list[BlockKey]]:
            self.tiers.delete(victims)
            metas = [
                (positions[i], BlockMeta(blocks.namespace, blocks.hashes[i], blocks.parents[i], blocks.layers,
                                         _kept(checksums[i]), now, kind), _packed(checksums[i]))
                for i in fresh
            ]  # fmt: skip
            memory.commit_blocks(extent, extent_blocks, metas, now, res)
            return MEMORY, []

        return self._admit(blocks, place)

    def _into_arena(
        self,
        namespace: bytes,
        layers: tuple[LayerSpec, ...],
        hashes: list[bytes],
        parents: list[bytes],
        data: Callable[[int, int], memoryview | bytes],
        checksums: Sequence[Sequence[int]],
        kind: str,
        tokens: list[list[int]] | None = None,
        *,
        to_fleet: bool = True,
    ) -> PutResult | None:
        """Blocks whose bytes the daemon holds (`data(block, layer)`) copied into a fresh
        extent and committed like a reservation. None when the arena has no room for them
        (nothing changed)."""
        memory = self._tier()
        with self._commit_lock:
            try:
                res = memory.reserve(tenant=b"", namespace=namespace, parent_hash=parents[0],
                                     hashes=hashes, parents=parents, layers=layers, token_ids=tokens,
                                     lease=False)  # fmt: skip
            except NoRoom as exc:
                log.debug("blocks go to the persistent tier: %s", exc)
                return None
            finally:
                self._drop_evicted()
            with memory.committing(res):
                memory.fill(res, data)
                admission = Admission("commit", namespace, parents[0], hashes, parents, layers, tokens,
                                      to_fleet=to_fleet)  # fmt: skip
                result = self._admit_in_place(admission, res.extent, len(hashes), range(len(hashes)),
                                              checksums, kind, res)  # fmt: skip
        if self._writer is not None:
            self._writer.wake()
        return result

    def put_part(
        self,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        subset: tuple[int, ...],
        data: Callable[[int, int], memoryview],
        *,
        token_ids: Sequence[int] = (),
        parents: Sequence[bytes] | None = None,
        sums: Any = None,
        kind: str = XXH3,
        runs: Callable[[int], memoryview] | None = None,
        lies_at: tuple[int, int] | None = None,
    ) -> PutResult:
        """Put layers `subset` of blocks `hashes` (`data(k, i)`: block i's layer subset[k];
        `sums[i][k]`: its checksum of `kind`, when the caller has them; `runs(k)`: layer
        subset[k] of every block, back to back, when the caller has that; `lies_at`: where
        block 0 was written in place in its part group's extent, see PartAssembler.add). `parents`: each
        block's parent, where they are not a chain from `parent_hash`.
        Blocks already stored are skipped; the others wait in `parts` (in place in the
        arena when it has room) until puts have covered all their layers, then are stored
        (the result counts those this part completed).
        Raises InvalidPart, or CapacityError when the parts held would exceed the bound."""
        if parents is None:
            parents = _chained(parent_hash, hashes)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            fresh = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
        tokens = _block_tokens(token_ids, len(hashes), fresh)
        with self._parts_lock:
            try:
                whole = self.parts.add(
                    namespace, hashes, parents, tuple(layers), subset, data, indices=fresh, tokens=tokens,
                    sums=sums, kind=kind, runs=runs, lies_at=lies_at,
                )  # fmt: skip
            except PartError as exc:
                raise InvalidPart(str(exc)) from exc
            except PartsFull as exc:
                raise CapacityError(str(exc)) from exc
        results = [self._store_whole(namespace, run) for run in _runs(whole)]
        return _sum(results, len(hashes) - len(fresh))

    def _store_whole(self, namespace: bytes, run: list[Whole]) -> PutResult:
        """Store a chain of blocks that parts made whole: committed where they lie when that
        is the arena, else copied into the arena when it has room (so the next Pin finds
        them there; write-behind persists them as any commit's), else put to the
        persistent tier."""
        first = run[0]
        hashes, parents = [w.block_hash for w in run], [w.parent for w in run]
        tokens = [w.tokens or [] for w in run] if all(w.tokens for w in run) else None
        sums = [w.checksums for w in run]
        if first.extent is not None:
            admission = Admission("commit", namespace, first.parent, hashes, parents, first.layers, tokens)
            try:
                with self._commit_lock:
                    return self._admit_in_place(admission, first.extent, first.extent_blocks,
                                                [w.position for w in run], sums, first.kind)  # fmt: skip
            finally:
                for _ in run:
                    self._let_go(first.extent)
                if self._writer is not None:
                    self._writer.wake()
        if self.memory is not None:
            into = self._into_arena(namespace, first.layers, hashes, parents, lambda i, k: run[i].layer(k),
                                    sums, XXH3, tokens)  # fmt: skip
            if into is not None:
                return into
        width = len(first.layers)
        return self.put(namespace, first.parent, hashes, first.layers,
                        [[w.layer(k) for w in run] for k in range(width)],
                        [[w.checksums[k] for w in run] for k in range(width)],
                        token_ids=[t for block in tokens for t in block] if tokens else ())  # fmt: skip

    def _hold_parts(self, layers: tuple[LayerSpec, ...], blocks: int) -> int | None:
        """An arena extent for `blocks` new blocks put in parts, held once per block (parts
        ArenaRoom); None when the arena has no room: they wait in the heap."""
        memory = self._tier()
        with self._commit_lock:
            try:
                return memory.hold_extent(fmt.extent_bytes(sum(s.nbytes for s in layers), blocks), blocks,
                                          time.time(), holds=blocks)  # fmt: skip
            except NoRoom as exc:
                log.debug("parts wait in the heap: %s", exc)
                return None
            finally:
                self._drop_evicted()

    def _let_go(self, extent: int) -> None:
        with self._lock:
            self._tier().unpin_extents([extent])

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
        """Write to the persistent tier and delete `victims` from every tier; return what
        else had to be evicted.

        When the backend is full below the byte budget (the filesystem, or LMDB's
        map), eviction gets one chance: as many more bytes as the put brings (and
        one block), and only if that much is evictable. If the write still fails,
        eviction evidently does not help (another process holds the space, a reader
        pins LMDB's pages): later full writes fail at once, without evicting, until
        a write succeeds. So a full disk never empties the store for puts that fail.
        """
        if self.memory is not None:
            self.memory.delete(victims)
        try:
            self.backend.write(writes, victims)
            self._eviction_helps = True
            return []
        except StorageFullError as exc:
            full = exc
        except StorageError:
            self.tiers.delete(victims)
            raise
        if not writes:  # only the victims' deletion failed: nothing needs room
            self.tiers.delete(victims)
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
            self.tiers.delete(victims)
            raise CapacityError(f"no room for this put ({full}); {reason}") from full
        log.warning("%s; evicted %d more blocks to make room for a put", full, len(extra))
        try:
            self.backend.write(writes, victims + extra)
            if self.memory is not None:
                self.memory.delete(extra)
            return extra
        except StorageFullError as exc:
            self._eviction_helps = False
            self.tiers.delete(victims + extra)
            log.warning("no room after evicting %d blocks: full puts fail without eviction now", len(extra))
            raise CapacityError(f"no room for this put after evicting {len(extra)} blocks: {exc}") from exc
        except StorageError:
            self.tiers.delete(victims + extra)
            raise

    def reserve(
        self,
        tenant: bytes,
        namespace: bytes,
        parent_hash: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[LayerSpec],
        *,
        token_ids: Sequence[int] = (),
        subset: tuple[int, ...] | None = None,
        in_place: bool = False,
    ) -> Reservation | None:
        """Reserve an extent for the blocks of `hashes` not stored yet (None: all are).
        The caller writes them, layer-major, then commits within the lease. `subset`: a
        partial save of these layers of `layers` (the extent holds only them; see put_part),
        or, with `in_place` where the blocks' parts can take it, their part group's extent
        (Reservation.extent_blocks: the caller writes its layers where they lie in it)."""
        memory = self._tier()
        full = tuple(layers)
        carried = full if subset is None else tuple(full[k] for k in subset)
        block_bytes = sum(layer.nbytes for layer in carried)
        with self._lock:
            if self._closed:
                raise ShuttingDown("the store is closed")
            memory.expire(time.monotonic())
            todo = [i for i, h in enumerate(hashes) if self._index.get(namespace, h) is None]
        if not todo:
            return None
        if block_bytes * len(todo) > self.capacity_bytes:
            raise CapacityError(f"save of {block_bytes * len(todo)} bytes exceeds the store's capacity of "
                                f"{self.capacity_bytes} bytes")  # fmt: skip
        nbytes = fmt.extent_bytes(block_bytes, len(todo))
        if nbytes > memory.allocator.total:
            raise CapacityError(
                f"a save of {nbytes} bytes does not fit the memory tier ({memory.allocator.total} bytes)"
            )
        parents = _chained(parent_hash, hashes)
        new_hashes, new_parents = [hashes[i] for i in todo], [parents[i] for i in todo]
        in_group = None
        if subset is not None and in_place:
            in_group = self._in_group(memory, namespace, new_hashes, new_parents, full, subset)
        with self._commit_lock:
            try:
                return memory.reserve(
                    tenant=tenant, namespace=namespace, parent_hash=parent_hash,
                    hashes=new_hashes, parents=new_parents, layers=carried,
                    request_index=todo, skipped=len(hashes) - len(todo),
                    token_ids=_block_tokens(token_ids, len(hashes), todo), subset=subset, full_layers=full,
                    in_group=in_group,
                )  # fmt: skip
            except NoRoom as exc:
                raise CapacityError(str(exc)) from exc
            finally:
                self._drop_evicted()

    def _in_group(
        self,
        memory: MemoryTier,
        namespace: bytes,
        hashes: list[bytes],
        parents: list[bytes],
        layers: tuple[LayerSpec, ...],
        subset: tuple[int, ...],
    ) -> tuple[int, int, int] | None:
        """Where a partial save can be written in place (PartAssembler.place_in_arena): its
        blocks' part group's (extent, blocks, first position), held once more for the
        reservation; None: it gets an extent of its own."""
        with self._parts_lock:
            at = self.parts.place_in_arena(namespace, hashes, parents, layers, subset)
            if at is not None:
                with self._lock:  # before the parts lock is let go: an expiry cannot free it now
                    memory.pin_extents([at[0]], time.time())
            return at

    def commit(
        self,
        tenant: bytes,
        reservation_id: int,
        checksums: Sequence[int],
        kind: str = XXH3,
        *,
        after_answer: Callable[[Callable[[], None]], bool] | None = None,
    ) -> PutResult:
        """Make a reservation's blocks visible, all or nothing; `checksums` block-major, of
        `kind` (kvstore.blocks.CHECKSUMS). A partial save's layers go to its blocks' parts.
        `after_answer` (a call's add_callback): write-behind is woken through it, once the
        answer is sent (False: at once). Woken before, its threads took the GIL from the
        call's last steps: on the 2-core VM a 30-block put's Commit took 1.18-1.41 ms at
        the client (p50), against 0.84-1.07 woken after."""
        memory = self._tier()
        if kind not in CHECKSUMS:
            raise InvalidCommit(f"unknown checksum kind {kind!r}; known: {', '.join(CHECKSUMS)}")
        with self._lock:
            res = memory.reservation(reservation_id, tenant)
            if res is None:
                raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")
            n, width = len(res.hashes), len(res.layers)
            if len(checksums) != n * width:
                raise InvalidCommit(f"a commit of {n} blocks of {width} layers needs {n * width} checksums, "
                                    f"not {len(checksums)}")  # fmt: skip
            memory.take_reservation(reservation_id, tenant)
        with memory.committing(res):
            if res.subset is not None:
                result = self._commit_part(memory, res, checksums, kind)
            else:
                sums = _per_block(checksums, n, width)
                admission = Admission("commit", res.namespace, res.parent_hash, res.hashes, res.parents,
                                      res.layers, res.token_ids, res.skipped)  # fmt: skip
                with self._commit_lock:
                    result = self._admit_in_place(admission, res.extent, n, range(n), sums, kind, res)
        with self._lock:
            memory.counters.commits += 1
        if self._writer is not None and (after_answer is None or not after_answer(self._writer.wake)):
            self._writer.wake()
        return result

    def _commit_part(
        self, memory: MemoryTier, res: Reservation, checksums: Sequence[int], kind: str
    ) -> PutResult:
        """A partial save's reservation: its layers, written in their blocks' one extent
        (in place) or copied into it, are added to the blocks' parts, and the blocks they
        complete are committed there."""
        n, width = len(res.hashes), len(res.layers)
        if res.extent_blocks:  # written in place: block i's layer subset[k] where it lies
            view = _group_view(memory.views(res.extent, res.full_layers, res.extent_blocks), res)
        else:
            view = memory.views(res.extent, res.layers, n)
        if kind == XXH3:  # what the client summed is what the arena holds (a torn write fails)
            for i in range(n):
                for k in range(width):
                    if checksum(view(i, k)) != checksums[i * width + k]:
                        raise InvalidCommit(
                            f"block {res.hashes[i].hex()} layer {res.layers[k].name!r}: the bytes "
                            "in the arena do not match the commit's checksum"
                        )
        tokens = [t for block in res.token_ids for t in block] if res.token_ids else ()
        if res.subset is None:
            raise ValueError("not a partial save's reservation")
        result = self.put_part(
            res.namespace, res.parent_hash, res.hashes, res.full_layers, res.subset, lambda k, i: view(i, k),
            token_ids=tokens, parents=res.parents,
            # the client's sums, of its kind (xxh3: verified above; wsum32, a GPU's: as a
            # whole commit's, verified by every reader)
            sums=block_major(checksums, n), kind=kind,
            # in place: nothing to copy; else a copy per layer, not per block
            runs=None if res.extent_blocks else memory.layer_runs(res.extent, res.layers, n),
            lies_at=(res.extent, res.position) if res.extent_blocks else None,
        )  # fmt: skip
        return _sum([result], res.skipped)

    def abort(self, tenant: bytes, reservation_id: int) -> None:
        if not self._tier().abort(reservation_id, tenant):
            raise LeaseNotFound(f"no reservation {reservation_id} (expired, committed or aborted)")


def _group_view(
    whole: Callable[[int, int], memoryview], res: Reservation
) -> Callable[[int, int], memoryview]:
    """view(block, k) of a reservation written in place: block i of the reservation is at
    res.position + i in its group's extent, layer k of the reservation is subset[k] there."""
    subset, first = res.subset or (), res.position
    return lambda i, k: whole(first + i, subset[k])


def _per_block(checksums: Sequence[int], n: int, width: int) -> list[Sequence[int]]:
    """Block-major checksums cut per block (packed ones stay packed)."""
    if isinstance(checksums, PackedSums):
        step = 8 * width
        return [PackedSums(checksums.packed[i * step : (i + 1) * step]) for i in range(n)]
    return [checksums[i * width : (i + 1) * width] for i in range(n)]


def _kept(sums: Sequence[int]) -> tuple[int, ...] | PackedSums:
    return sums if isinstance(sums, PackedSums) else tuple(sums)


def _packed(sums: Sequence[int]) -> bytes:
    """The packed form when it is at hand (b"": the index packs them)."""
    return sums.packed if isinstance(sums, PackedSums) else b""

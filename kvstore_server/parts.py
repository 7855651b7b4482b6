"""Blocks put in parts: each tensor-parallel rank puts its own KV heads of a block.

A block's layout is one list of layers for every engine (the connector stores
each KV head of each attention layer as a layer of its own, see
kvstore_connector.layout), so KV saved by an engine of one tensor parallelism
loads into one of another. A rank puts the subset of layers it holds; the block
becomes visible only when puts have covered every layer. Until then its parts
wait here, in memory the daemon bounds (`limit_bytes`), for at most
`timeout_s`: a rank that died, or was never started, leaves its block's other
parts to be dropped, never half a block visible.

Where the parts wait: in the memory tier when it has room (`ArenaRoom`: the new
blocks of a put get one arena extent, laid out as a commit's, and every part is
written into it, so the block made whole is committed there without another
copy), else in the daemon's heap (then stored like a put's blocks). A rank that
saves through the arena writes its layers straight into that extent
(`place_in_arena`, then `add(..., lies_at=...)`): no copy at all on the daemon.

Not thread-safe: the store calls it under a lock of its own (never the commit lock:
the blocks it makes whole are then stored, in the arena like a commit's or as a Put, which
takes that lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore import arena_format as fmt
from kvstore.blocks import (
    CHECKSUMS,
    XXH3,
    BlockKey,
    LayerSpec,
    PackedSums,
    checksum,
    per_layout,
    subset_indices,
)

log = logging.getLogger(__name__)


class PartError(ValueError):
    """A part that does not fit the block's parts already received (the caller's error)."""


class PartsFull(Exception):
    """The bytes held for incomplete blocks would exceed the daemon's bound."""


@dataclass(frozen=True, slots=True)
class ArenaRoom:
    """The memory tier, as parts land in it: `hold(layers, blocks)` holds a new extent for
    `blocks` blocks of `layers` once per block (None: no room, the heap takes them);
    `let_go(extent)` ends one block's hold (made whole and stored, or dropped)."""

    view: memoryview  # the arena
    hold: Callable[[tuple[LayerSpec, ...], int], int | None]
    let_go: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class _Shape:
    """A layout's per-layer sizes and starts (fmt.layer_starts), made once per layout."""

    sizes: list[int]
    starts: list[int]
    block_bytes: int


@dataclass(frozen=True, slots=True)
class _Rows:
    """Per block and layer, of the blocks that arrived together (one extent's), numpy
    arrays [blocks, layers] (a block of the per-head layout has 256 layers, a TP save
    brings 512 blocks of them: a Python value, even a numpy call, per block-layer or
    block was most of a commit's time): each layer's checksum, whether it is in, the kind
    of its checksum (an index of _KINDS, -1 not yet) and whether a reservation writes it."""

    sums: Any  # uint64
    have: Any  # bool
    kinds: Any  # int8
    claimed: Any  # bool


@dataclass
class _Block:
    """A block some of whose layers are in: row `row` of `rows`."""

    layers: tuple[LayerSpec, ...]
    shape: _Shape
    parent: bytes
    view: memoryview  # where the block lies: its own heap buffer, or the arena
    started: float
    rows: _Rows
    row: int
    tokens: list[int] | None = None
    extent: int | None = None  # in the arena: the extent, its blocks those of `rows`

    @property
    def extent_blocks(self) -> int:
        """How many blocks the extent holds (1: a heap buffer of its own)."""
        return int(self.rows.sums.shape[0]) if self.extent is not None else 1

    @property
    def position(self) -> int:
        """Its place in the extent: its row, as the extent holds the rows' blocks in order."""
        return self.row if self.extent is not None else 0

    def at(self, k: int) -> int:
        """Where layer k lies in `view` (an extent is layer-major; a heap buffer one block)."""
        base = self.extent or 0
        return base + self.extent_blocks * self.shape.starts[k] + self.position * self.shape.sizes[k]

    def layer(self, k: int) -> memoryview:
        start = self.at(k)
        return self.view[start : start + self.shape.sizes[k]]


_KINDS = tuple(CHECKSUMS)  # a checksum kind's code in _Block.kinds: its index here


@dataclass(frozen=True, slots=True)
class Whole:
    """A block whose parts are all in: ready to store like any put's block. `extent` not
    None: it lies in that arena extent, at `position`, held until let go (ArenaRoom)."""

    index: int  # in the put that completed it
    block_hash: bytes
    parent: bytes
    layers: tuple[LayerSpec, ...]
    checksums: Sequence[int]  # of `kind`, one per layer (packed)
    tokens: list[int] | None
    where: _Block
    kind: str = XXH3

    @property
    def extent(self) -> int | None:
        return self.where.extent

    @property
    def extent_blocks(self) -> int:
        return self.where.extent_blocks

    @property
    def position(self) -> int:
        return self.where.position

    def layer(self, k: int) -> memoryview:
        return self.where.layer(k)

    @property
    def data(self) -> bytes:
        """The block's layers back to back."""
        return b"".join(self.layer(k) for k in range(len(self.layers)))


def _one_kind(blocks: list[_Block]) -> list[tuple[PackedSums, str]]:
    """Whole blocks' checksums (blocks of one _Rows), each block's all of one kind: its
    parts' where they agree and it lies in the arena (committed there as a commit of that
    kind is); else xxh3, summed here for the layers whose parts brought another kind."""
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    rows = blocks[0].rows
    index = np.fromiter((b.row for b in blocks), np.intp, len(blocks))
    kinds, sums = rows.kinds[index], rows.sums[index].astype("<u8")
    uniform = (kinds == kinds[:, :1]).all(axis=1).tolist()
    first = kinds[:, 0].tolist()
    packed, width = sums.tobytes(), 8 * sums.shape[1]
    out: list[tuple[PackedSums, str]] = []
    for n, block in enumerate(blocks):
        if block.extent is not None and uniform[n]:
            out.append((PackedSums(packed[n * width : (n + 1) * width]), _KINDS[first[n]]))
            continue
        mine = sums[n].copy()
        for k in np.flatnonzero(kinds[n] != _KINDS.index(XXH3)).tolist():
            mine[k] = checksum(block.layer(k))
        out.append((PackedSums(mine.tobytes()), XXH3))
    return out


def check_subset(subset: Sequence[int], num_layers: int) -> tuple[int, ...] | None:
    """A put's or read's layer subset, validated: None for "all layers" (empty, or every
    index). Raises PartError for indices out of range or not strictly increasing."""
    if not subset:
        return None
    try:
        chosen = subset_indices(subset, num_layers)
    except ValueError as exc:
        raise PartError(str(exc)) from exc
    return None if len(chosen) == num_layers else tuple(chosen)


def block_major(checksums: Sequence[int], blocks: int) -> Any:
    """Checksums block-major (a commit's: PackedSums, or ints) as add()'s `sums`."""
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    if isinstance(checksums, PackedSums):
        return np.frombuffer(checksums.packed, "<u8").reshape(blocks, -1)
    return np.asarray(checksums, dtype=np.uint64).reshape(blocks, -1)


def layer_major(checksums: Sequence[Sequence[int]]) -> Any:
    """Checksums layer-major (a Put's: checksums[k][i]) as add()'s `sums`."""
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    return np.asarray(checksums, dtype=np.uint64).T


def _make_shape(layers: tuple[LayerSpec, ...]) -> _Shape:
    sizes = [layer.nbytes for layer in layers]
    return _Shape(sizes, fmt.layer_starts(sizes), sum(sizes))


def _indices(subset: Sequence[int]) -> Any:
    import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

    return np.asarray(subset, dtype=np.intp)


class PartAssembler:
    def __init__(
        self,
        limit_bytes: int,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        arena: ArenaRoom | None = None,
    ) -> None:
        self.arena = arena
        self.limit_bytes = limit_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._blocks: dict[BlockKey, _Block] = {}
        self.nbytes = 0
        self.completed = 0
        self.expired = 0
        self.layers_in_place = 0  # block-layers a rank wrote where the block lies
        self.layers_copied = 0  # block-layers copied here from where a put brought them
        self._shapes: dict[int, tuple[tuple[LayerSpec, ...], _Shape]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def pending(self, key: BlockKey) -> bool:
        return key in self._blocks

    def place_in_arena(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        layers: tuple[LayerSpec, ...],
        subset: Sequence[int],
    ) -> tuple[int, int, int] | None:
        """Where a rank may write layers `subset` of new blocks `hashes` in place: (extent,
        the blocks it holds, position of the first) of the arena extent their parts lie in,
        blocks side by side from there (when this makes the extent, it holds `len(hashes)`
        blocks). Those layers are claimed for the writer: no
        other reservation gets them; its commit brings them with `add(..., lies_at=...)`.
        None, nothing changed, where they cannot be written in place: no arena room, some
        of the blocks held elsewhere or apart, a layer already put or claimed, another
        layout or parent, or beyond the bound (the rank then writes an extent of its own,
        copied in at commit, which meets the same checks)."""
        if self.arena is None or not hashes:
            return None
        self.expire()
        held = [self._blocks.get((namespace, h)) for h in hashes]
        if all(block is None for block in held):
            shape = self._shape(layers)
            if self.nbytes + shape.block_bytes * len(hashes) > self.limit_bytes:
                return None
            extent = self.arena.hold(layers, len(hashes))
            if extent is None:
                return None
            self._new_blocks(namespace, hashes, parents, layers, shape, extent)
            held = [self._blocks[(namespace, h)] for h in hashes]
        first = held[0]
        if first is None or first.extent is None:
            return None
        for n, (block, parent) in enumerate(zip(held, parents, strict=True)):
            if (
                block is None or block.rows is not first.rows or block.row != first.row + n
                or block.layers != layers or block.parent != parent
            ):  # fmt: skip
                return None
        import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

        rows = first.rows
        where = np.ix_(np.arange(first.row, first.row + len(held)), _indices(subset))
        if rows.have[where].any() or rows.claimed[where].any():  # put or claimed already
            return None
        rows.claimed[where] = True
        return first.extent, first.extent_blocks, first.position

    def add(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        layers: tuple[LayerSpec, ...],
        subset: Sequence[int],
        data: Callable[[int, int], memoryview],
        *,
        indices: Sequence[int] | None = None,
        tokens: Sequence[Sequence[int]] | None = None,
        sums: Any = None,
        kind: str = XXH3,
        runs: Callable[[int], memoryview] | None = None,
        lies_at: tuple[int, int] | None = None,
    ) -> list[Whole]:
        """Take one put's parts: for block `i` of `hashes` (those in `indices`, default
        all), layer `subset[k]`'s bytes are `data(k, i)`, and their checksums of `kind`
        `sums[i][k]` (an array [len(hashes), len(subset)], e.g. numpy's) where the caller
        has them already (else their xxh3 is computed).
        Returns the blocks this made whole, in put order: with the parts' kind where every
        part had it (a TP engine's GPU sums, kept), else xxh3. All or nothing: a part that
        conflicts with what is held raises PartError, a put that would go beyond the bound
        PartsFull, and nothing is taken. `runs(k)`: layer subset[k] of every block of the
        put, back to back (a reservation's extent): where the put's blocks are all new and
        land in one arena extent, each layer is one copy instead of one per block.
        `lies_at`: (extent, position) where block 0 of `hashes` lies, the others beside it
        (place_in_arena's answer): a block still held there is not copied at all."""
        if sums is None and kind != XXH3:
            raise ValueError(f"parts of checksum kind {kind!r} come with their sums")
        self.expire()
        todo = range(len(hashes)) if indices is None else indices
        shape = self._shape(layers)
        new_bytes = 0
        for i in todo:
            held = self._blocks.get((namespace, hashes[i]))
            if held is None:
                new_bytes += shape.block_bytes
            elif held.layers is not layers and held.layers != layers:  # (interned: one identity test)
                raise PartError(
                    f"block {hashes[i].hex()}: another layer layout than the parts of it already put"
                )
            elif held.parent != parents[i]:
                raise PartError(f"block {hashes[i].hex()}: another parent than the parts of it already put")
        if self.nbytes + new_bytes > self.limit_bytes:
            raise PartsFull(
                f"blocks waiting for their other parts would hold {self.nbytes + new_bytes} bytes "
                f"(max_partial_bytes {self.limit_bytes}); retry once their other ranks have put them"
            )
        new = [i for i in todo if (namespace, hashes[i]) not in self._blocks]
        extent = self.arena.hold(layers, len(new)) if self.arena is not None and new else None
        # all placed first: a part that fails to copy expires
        self._new_blocks(
            namespace, [hashes[i] for i in new], [parents[i] for i in new], layers, shape, extent
        )
        sizes = shape.sizes
        # the put's blocks lie side by side in both extents, in the same order: a copy per layer
        whole_layers = (
            runs is not None and extent is not None and list(todo) == list(range(len(hashes))) == new
        )
        if whole_layers and runs is not None:
            self.layers_copied += len(subset) * len(new)
            first = self._blocks[(namespace, hashes[0])]
            for k, layer_index in enumerate(subset):
                start = first.at(layer_index)
                first.view[start : start + len(new) * sizes[layer_index]] = runs(k)
        import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

        blocks = [self._blocks[(namespace, hashes[i])] for i in todo]
        for n, (i, block) in enumerate(zip(todo, blocks, strict=True)):
            if tokens is not None and block.tokens is None:
                block.tokens = list(tokens[n])
            in_place = lies_at is not None and (block.extent, block.position) == (lies_at[0], lies_at[1] + i)
            if in_place:
                self.layers_in_place += len(subset)
            elif not whole_layers:
                self.layers_copied += len(subset)
                for k, layer_index in enumerate(subset):
                    block.layer(layer_index)[:] = data(k, i)
        # what they hold, summed once: by the caller (its kind), or xxh3 here; per group of
        # blocks that arrived together, one numpy call each, not one per block
        chosen, code = _indices(subset), _KINDS.index(kind)
        given = None if sums is None else np.asarray(sums, dtype=np.uint64)
        groups: dict[int, list[int]] = {}  # id(rows) -> positions in todo
        for n, block in enumerate(blocks):
            groups.setdefault(id(block.rows), []).append(n)
        whole: dict[int, tuple[PackedSums, str]] = {}  # position in todo -> its sums and kind
        for members in groups.values():
            rows = blocks[members[0]].rows
            index = np.fromiter((blocks[n].row for n in members), np.intp, len(members))
            where = np.ix_(index, chosen)
            if given is None:
                summed = [[checksum(blocks[n].layer(k)) for k in subset] for n in members]
                rows.sums[where] = np.array(summed, dtype=np.uint64)
            else:
                rows.sums[where] = given[[todo[n] for n in members]]
            rows.have[where] = True
            rows.kinds[where] = code
            complete = [members[j] for j in np.flatnonzero(rows.have[index].all(axis=1)).tolist()]
            if complete:
                whole.update(zip(complete, _one_kind([blocks[n] for n in complete]), strict=True))
        done: list[Whole] = []
        for n, i in enumerate(todo):
            if n in whole:
                block = self._blocks.pop((namespace, hashes[i]))
                self.nbytes -= shape.block_bytes
                self.completed += 1
                packed, made = whole[n]
                done.append(Whole(i, hashes[i], block.parent, layers, packed, block.tokens, block, made))
        return done

    def _shape(self, layers: tuple[LayerSpec, ...]) -> _Shape:
        """The layout's sizes and starts, made once per (interned) layout: found by the
        tuple's identity, not by hashing its 256 specs on every put."""
        return per_layout(self._shapes, layers, _make_shape)

    def _new_blocks(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        parents: Sequence[bytes],
        layers: tuple[LayerSpec, ...],
        shape: _Shape,
        extent: int | None,
    ) -> None:
        """The blocks' first parts: where each will lie (block i of the extent of
        len(hashes), laid out as a commit's; or a heap buffer each, layers back to back),
        their per-layer arrays rows of one array each (an allocation per block and array
        was most of a 512-block reservation's time)."""
        import numpy as np  # NOTE: not at import: numpy's BLAS threads would miss the daemon's signal mask

        now, count, width = self._clock(), len(hashes), len(layers)
        sums, have = np.zeros((count, width), np.uint64), np.zeros((count, width), bool)
        kinds, claimed = np.full((count, width), -1, np.int8), np.zeros((count, width), bool)
        arena = self.arena.view if extent is not None and self.arena is not None else None
        rows = _Rows(sums, have, kinds, claimed)
        for i, (block_hash, parent) in enumerate(zip(hashes, parents, strict=True)):
            if arena is None:
                view = memoryview(bytearray(shape.block_bytes))
                block = _Block(layers, shape, parent, view, now, rows, i)
            else:
                block = _Block(layers, shape, parent, arena, now, rows, i, None, extent)
            self._blocks[(namespace, block_hash)] = block
        self.nbytes += shape.block_bytes * count

    def expire(self) -> list[BlockKey]:
        """Drop blocks whose parts have waited longer than timeout_s; their keys."""
        cutoff = self._clock() - self.timeout_s
        gone = [key for key, block in self._blocks.items() if block.started <= cutoff]
        for key in gone:
            block = self._blocks.pop(key)
            self.nbytes -= block.shape.block_bytes
            if block.extent is not None and self.arena is not None:
                self.arena.let_go(block.extent)
        if gone:
            self.expired += len(gone)
            log.warning(
                "dropped %d blocks put in part only: their other layers (another tensor-parallel "
                "rank's KV heads) did not arrive within %gs",
                len(gone),
                self.timeout_s,
            )
        return gone

    def stats(self) -> dict[str, int]:
        self.expire()
        return {
            "partial_blocks": len(self._blocks),
            "partial_bytes": self.nbytes,
            "partials_completed": self.completed,
            "partials_expired": self.expired,
            "part_layers_in_place": self.layers_in_place,
            "part_layers_copied": self.layers_copied,
        }

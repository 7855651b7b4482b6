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
written into it in place, so the block made whole is committed there without
another copy), else in the daemon's heap (then stored like a put's blocks).

Not thread-safe: the store calls it under a lock of its own (never the commit lock:
the blocks it makes whole are then stored, in the arena like a commit's or as a Put, which
takes that lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore import arena_format as fmt
from kvstore.blocks import XXH3, BlockKey, LayerSpec, checksum, selected_layers

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


@dataclass
class _Block:
    layers: tuple[LayerSpec, ...]
    parent: bytes
    view: memoryview  # where the block lies: its own heap buffer, or the arena
    checksums: list[int | None]
    started: float
    offsets: list[int]  # each layer's start in `view`
    kinds: list[str | None]  # each layer's checksum kind (its part's)
    tokens: list[int] | None = None
    extent: int | None = None  # in the arena: the extent (of `extent_blocks`) and position
    extent_blocks: int = 0
    position: int = 0

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.checksums)


@dataclass(frozen=True, slots=True)
class Whole:
    """A block whose parts are all in: ready to store like any put's block. `extent` not
    None: it lies in that arena extent, at `position`, held until let go (ArenaRoom)."""

    index: int  # in the put that completed it
    block_hash: bytes
    parent: bytes
    layers: tuple[LayerSpec, ...]
    view: memoryview
    checksums: tuple[int, ...]
    tokens: list[int] | None
    offsets: list[int]
    extent: int | None = None
    extent_blocks: int = 0
    position: int = 0
    kind: str = XXH3  # of its checksums

    def layer(self, k: int) -> memoryview:
        start = self.offsets[k]
        return self.view[start : start + self.layers[k].nbytes]

    @property
    def data(self) -> bytes:
        """The block's layers back to back."""
        return b"".join(self.layer(k) for k in range(len(self.layers)))


def _one_kind(block: _Block) -> tuple[tuple[int, ...], str]:
    """A whole block's checksums, all of one kind: its parts' where they agree and it lies
    in the arena (committed there as a commit of that kind is); else xxh3, summed here for
    the layers whose parts brought another kind."""
    kinds = set(block.kinds)
    if len(kinds) == 1 and block.extent is not None:
        (kind,) = kinds
        return tuple(c for c in block.checksums if c is not None), kind or XXH3
    sums = tuple(
        c if k == XXH3 and c is not None else checksum(block.view[start : start + layer.nbytes])
        for c, k, start, layer in zip(block.checksums, block.kinds, block.offsets, block.layers, strict=True)
    )
    return sums, XXH3


def check_subset(subset: Sequence[int], num_layers: int) -> tuple[int, ...] | None:
    """A put's or read's layer subset, validated: None for "all layers" (empty, or every
    index). Raises PartError for indices out of range or not strictly increasing."""
    if not subset:
        return None
    try:
        chosen = selected_layers(subset, num_layers)
    except ValueError as exc:
        raise PartError(str(exc)) from exc
    return None if len(chosen) == num_layers else tuple(chosen)


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

    def __len__(self) -> int:
        return len(self._blocks)

    def pending(self, key: BlockKey) -> bool:
        return key in self._blocks

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
        sums: Callable[[int, int], int] | None = None,
        kind: str = XXH3,
        runs: Callable[[int], memoryview] | None = None,
    ) -> list[Whole]:
        """Take one put's parts: for block `i` of `hashes` (those in `indices`, default
        all), layer `subset[k]`'s bytes are `data(k, i)`, and their checksums of `kind`
        `sums(k, i)` where the caller has them already (else their xxh3 is computed).
        Returns the blocks this made whole, in put order: with the parts' kind where every
        part had it (a TP engine's GPU sums, kept), else xxh3. All or nothing: a part that
        conflicts with what is held raises PartError, a put that would go beyond the bound
        PartsFull, and nothing is taken. `runs(k)`: layer subset[k] of every block of the
        put, back to back (a reservation's extent): where the put's blocks are all new and
        land in one arena extent, each layer is one copy instead of one per block."""
        if sums is None and kind != XXH3:
            raise ValueError(f"parts of checksum kind {kind!r} come with their sums")
        self.expire()
        todo = range(len(hashes)) if indices is None else indices
        new_bytes = 0
        block_bytes = sum(layer.nbytes for layer in layers)
        for i in todo:
            held = self._blocks.get((namespace, hashes[i]))
            if held is None:
                new_bytes += block_bytes
            elif held.layers != layers:
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
        now = self._clock()
        sizes = [layer.nbytes for layer in layers]
        starts = fmt.layer_starts(sizes)
        new = [i for i in todo if (namespace, hashes[i]) not in self._blocks]
        extent = self.arena.hold(layers, len(new)) if self.arena is not None and new else None
        for position, i in enumerate(new):  # all placed first: a part that fails to copy expires
            self._blocks[(namespace, hashes[i])] = self._new_block(
                layers, parents[i], now, sizes, starts, extent, len(new), position
            )
            self.nbytes += block_bytes
        # the put's blocks lie side by side in both extents, in the same order: a copy per layer
        whole_layers = (
            runs is not None and extent is not None and list(todo) == list(range(len(hashes))) == new
        )
        if whole_layers and runs is not None:
            first = self._blocks[(namespace, hashes[0])]
            for k, layer_index in enumerate(subset):
                start = first.offsets[layer_index]
                first.view[start : start + len(new) * sizes[layer_index]] = runs(k)
        done: list[Whole] = []
        for n, i in enumerate(todo):
            key = (namespace, hashes[i])
            block = self._blocks[key]
            if tokens is not None and block.tokens is None:
                block.tokens = list(tokens[n])
            for k, layer_index in enumerate(subset):
                start = block.offsets[layer_index]
                target = block.view[start : start + sizes[layer_index]]
                if not whole_layers:
                    target[:] = data(k, i)
                # what it holds, summed once: by the caller (its kind), or xxh3 here
                block.checksums[layer_index] = checksum(target) if sums is None else sums(k, i)
                block.kinds[layer_index] = kind
            if block.complete:
                del self._blocks[key]
                self.nbytes -= block_bytes
                self.completed += 1
                whole, whole_kind = _one_kind(block)
                done.append(Whole(i, hashes[i], block.parent, layers, block.view, whole, block.tokens,
                                  block.offsets, block.extent, block.extent_blocks, block.position,
                                  whole_kind))  # fmt: skip
        return done

    def _new_block(
        self,
        layers: tuple[LayerSpec, ...],
        parent: bytes,
        now: float,
        sizes: list[int],
        starts: list[int],
        extent: int | None,
        blocks: int,
        position: int,
    ) -> _Block:
        """A block's first part: where it will lie (block `position` of the extent of
        `blocks`, laid out as a commit's; or a heap buffer, layers back to back)."""
        unset: list[int | None] = [None] * len(layers)
        kinds: list[str | None] = [None] * len(layers)
        if extent is None or self.arena is None:
            return _Block(layers, parent, memoryview(bytearray(sum(sizes))), unset, now, starts, kinds)
        offsets = [
            extent + blocks * start + position * size for start, size in zip(starts, sizes, strict=True)
        ]
        return _Block(
            layers, parent, self.arena.view, unset, now, offsets, kinds, None, extent, blocks, position
        )

    def expire(self) -> list[BlockKey]:
        """Drop blocks whose parts have waited longer than timeout_s; their keys."""
        cutoff = self._clock() - self.timeout_s
        gone = [key for key, block in self._blocks.items() if block.started <= cutoff]
        for key in gone:
            block = self._blocks.pop(key)
            self.nbytes -= sum(layer.nbytes for layer in block.layers)
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
        }

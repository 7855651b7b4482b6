"""The load side: `Run` (pinned blocks that lie together), `Pinned` (blocks pinned
for a lease: read, verify, release) and `ArenaSource` (a LayerStream source over them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from kvstore import arena_format as fmt
from kvstore import wire
from kvstore.blocks import CHECKSUMS, STOP_NONE, XXH3, subset_indices
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.arena.mapping import Call, Mapping
from kvstore_client.arena.views import _pinned_layout, _typed, _typed_rows, checksums

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Run:
    """Pinned blocks [first, first + count) that lie together in the arena: `count` blocks
    of one extent from `position` on, its layers one after another (layer-major: a layer's
    blocks are one range), or, where `stride` is set, `count` one-block extents side by
    side, `stride` bytes apart (block-major: a block's layers are one range, and so are
    blocks [a, b); what a promotion from the persistent tier places)."""

    first: int  # index in the pinned prefix
    count: int
    offset: int  # extent (of the first block, where block-major)
    extent_blocks: int
    position: int  # of `first` in the extent
    stride: int = 0  # block-major: bytes from one block to the next

    def block_range(self, first: int, stop: int) -> tuple[int, int]:
        """Arena offset and length of blocks [first, stop) of a block-major run (each
        block's padding to its extent's size included, the last one's left out)."""
        if not self.stride:
            raise ValueError("a layer-major run's blocks are not one range")
        return self.offset + first * self.stride, (stop - first) * self.stride


class Pinned:
    """Blocks pinned in the arena for a lease: read them, `verify()`, then `release()`.

    `pieces(layer)` gives [(first_block, view [count, *shape])] covering the prefix
    in order: each view is one contiguous run in the arena.
    """

    def __init__(
        self,
        call: Call,
        mapping: Mapping,
        resp: pb.PinResponse,
        spec_type: Any,
        sent: float | None = None,
        progress: tuple[Any, pb.PinProgress] | None = None,
    ) -> None:
        self._call = call
        self.mapping = mapping
        self.pin_id: int = resp.pin_id
        # The daemon's lease starts when the Pin arrived, after `sent` (both monotonic, one
        # host): before this deadline the pin certainly holds.
        self.deadline = (time.monotonic() if sent is None else sent) + resp.lease_seconds
        self.num_blocks: int = resp.num_blocks
        self.layers, self._sizes, self._starts = _pinned_layout(resp, spec_type)
        self.packed_checksums: bytes = resp.checksums
        """The checksums as the daemon sent them: little-endian uint64s, block-major."""
        try:
            self.checksums = wire.unpack_checksums(resp.checksums)
        except ValueError as exc:
            raise errors.StoreInternalError(f"Pin answer: {exc}") from exc
        self.kinds = list(resp.checksum_kinds) or [XXH3] * self.num_blocks
        """Each block's checksum kind (kvstore.blocks.CHECKSUMS)."""
        self.stop_reason = wire.stop_reason_name(resp.stop_reason)
        """Why num_blocks is short of the blocks asked for (kvstore.blocks' STOP_* reasons)."""
        runs: list[Run] = []
        first = 0
        one = fmt.extent_bytes(sum(self._sizes), 1)  # a one-block extent
        for r in resp.runs:
            run = Run(first, r.count, r.offset, r.extent_blocks, r.first)
            if r.extent_blocks == 1:  # one block: both layouts; side by side with the last: block-major
                last = runs[-1] if runs else None
                if last is not None and last.stride == one and last.offset + last.count * one == r.offset:
                    run = Run(last.first, last.count + 1, last.offset, 1, 0, one)
                    runs.pop()
                else:
                    run = Run(first, 1, r.offset, 1, 0, one)
            runs.append(run)
            first += r.count
        if (
            first != self.num_blocks
            or len(self.checksums) != self.num_blocks * len(self.layers)
            or len(self.kinds) != self.num_blocks
            or any(kind not in CHECKSUMS for kind in self.kinds)
        ):
            raise errors.StoreInternalError("Pin answer does not cover its blocks")
        self.runs = runs
        self.released = False
        # PinStream: the call still reporting progress, and how many leading layers are in
        # place for every block (all, for a plain Pin)
        self._progress = progress[0] if progress is not None else None
        self.ready_layers = progress[1].ready_layers if progress is not None else len(self.layers)
        """Layers [0, ready_layers) of every pinned block are in place."""
        self.ready_blocks = progress[1].ready_blocks if progress is not None else self.num_blocks
        """Every layer of blocks [0, ready_blocks) is in place."""
        if self.ready_layers >= len(self.layers):
            self._end_progress(finished=True)
            self.ready_blocks = self.num_blocks

    def wait_layers(self, count: int) -> None:
        """Return once layers [0, count) of every pinned block are in place (at once for a
        plain Pin or blocks that were all in memory); within the pin call's deadline.
        Raises LoadIncomplete when the daemon could not read them (then release the pin
        and recompute), StoreTimeout or StoreUnavailable when the stream broke."""
        self._wait(lambda: self.ready_layers >= min(count, len(self.layers)))

    def wait_blocks(self, count: int) -> None:
        """Return once every layer of blocks [0, count) is in place: a loader may copy the
        first blocks of a cold load while the daemon reads the rest (blocks it reads
        whole, in one request each, are reported block by block). Raises as wait_layers."""
        self._wait(lambda: self.ready_blocks >= min(count, self.num_blocks))

    def _wait(self, done: Callable[[], bool]) -> None:
        while not done():
            if self._progress is None:
                raise errors.LoadIncomplete("the pin's progress stream is gone")
            try:
                message = next(self._progress)
            except StopIteration:
                self._progress = None
                raise errors.LoadIncomplete(
                    f"the daemon read {self.ready_layers} of {len(self.layers)} layers of the pinned blocks"
                ) from None
            except errors.KVStoreError:
                self._progress = None
                raise
            if message.stop_reason not in (0, wire.STOP_REASONS[STOP_NONE]):
                self._end_progress()
                raise errors.LoadIncomplete(
                    "the daemon could not read the pinned blocks from its persistent tier "
                    f"({wire.stop_reason_name(message.stop_reason)})"
                )
            self.ready_layers = max(self.ready_layers, message.ready_layers)
            self.ready_blocks = max(self.ready_blocks, message.ready_blocks)
        if self.ready_layers >= len(self.layers):
            # NOTE: the stream's end is not read now, but at finish or release, and only if
            # it has come by then: the daemon places the blocks it read before it ends the
            # stream, and a loader that waited for the end here issued its last copies only
            # after that placement. On an H200 host its last range was copied 1.95 / 7.65 ms
            # after the last report at 2048 / 8192 tokens; 0.65 ms where it had joined
            # another load's promotion, whose owner places it
            # (bench/results/persistent_h200_run10.txt). An end that has not come when the
            # load is over costs the connection (closed, not pooled), not a wait.
            self.ready_blocks = self.num_blocks

    def _end_progress(self, *, finished: bool = False) -> None:
        """Stop reading progress: `finished` (the answer said every layer was in place: the
        daemon is ending the stream, so its end is read, briefly, and the connection
        serves another call) or cancelled (what of the end has come is read; without it,
        the connection closes)."""
        call, self._progress = self._progress, None
        if call is not None:
            if finished:
                call.finish()
            else:
                call.cancel()

    def _at(self, run: Run, layer: int, block: int) -> int:
        """Offset of block `block` (index within `run`) of `layer`."""
        if run.stride:
            return run.offset + block * run.stride + self._starts[layer]
        return (
            run.offset + run.extent_blocks * self._starts[layer] + (run.position + block) * self._sizes[layer]
        )

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        """One block's bytes of each layer."""
        return self._sizes

    def spans(self, run: Run, layers: range) -> list[tuple[range, torch.Tensor]]:
        """The bytes of `layers` (consecutive) of one run as uint8 tensors over the arena:
        one span when they lie back to back (the run is its whole extent, layer-major),
        else one per layer. Within a span, layer `layers[k]`'s `run.count` blocks follow
        layer `layers[k - 1]`'s. Layer-major runs only (block-major: blocks())."""
        if run.stride and run.count > 1:
            raise ValueError("a block-major run's layers are not one range: use blocks()")
        whole = run.position == 0 and run.count == run.extent_blocks
        parts = [layers] if whole else [range(layer, layer + 1) for layer in layers]
        arena = self.mapping.tensor()
        out = []
        for part in parts:
            at = self._at(run, part.start, 0)
            nbytes = sum(self._sizes[part.start : part.stop]) * run.count
            out.append((part, arena[at : at + nbytes]))
        return out

    def within_block(self, layers: range) -> tuple[int, int]:
        """Where consecutive `layers` lie within a block of a block-major run: (start, stop) bytes."""
        return self._starts[layers.start], self._starts[layers.stop - 1] + self._sizes[layers.stop - 1]

    def blocks(self, run: Run, first: int, stop: int) -> torch.Tensor:
        """Blocks [first, stop) (within `run`, block-major) as one uint8 tensor over the
        arena: [stop - first, run.stride], each row a block's layers (then padding)."""
        at, nbytes = run.block_range(first, stop)
        return self.mapping.tensor()[at : at + nbytes].view(stop - first, run.stride)

    def pieces(self, layer: int) -> list[tuple[int, torch.Tensor]]:
        """(first block, [count, *shape] view) of each run of `layer`; a block-major run's
        view is strided (one block every run.stride bytes)."""
        spec = self.layers[layer]
        out = []
        for run in self.runs:
            at = self._at(run, layer, 0)
            if run.stride and run.count > 1:
                rows = self.blocks(run, 0, run.count)[
                    :, at - run.offset : at - run.offset + self._sizes[layer]
                ]
                out.append((run.first, _typed_rows(rows, spec)))
            else:
                out.append((run.first, _typed(self.mapping, at, run.count, spec)))
        return out

    def views(self, layer: int) -> Iterator[tuple[int, memoryview]]:
        """(first block, bytes) of each run of `layer`: of each block, where block-major."""
        size = self._sizes[layer]
        for run in self.runs:
            if run.stride:
                for block in range(run.count):
                    at = self._at(run, layer, block)
                    yield run.first + block, self.mapping.view[at : at + size]
                continue
            at = self._at(run, layer, 0)
            yield run.first, self.mapping.view[at : at + size * run.count]

    def block_view(self, block: int, layer: int) -> memoryview:
        for run in self.runs:
            if run.first <= block < run.first + run.count:
                at = self._at(run, layer, block - run.first)
                return self.mapping.view[at : at + self._sizes[layer]]
        raise IndexError(block)

    def verify(self, subset: Sequence[int] | None = None) -> int | None:
        """Index of the first block whose bytes fail a checksum (of layer subset `subset`,
        default all), or None when all match."""
        width = len(self.layers)
        bad: int | None = None
        for layer in range(width) if subset is None else subset:
            size = self._sizes[layer]
            pieces = [
                view[i * size : (i + 1) * size]
                for _first, view in self.views(layer)
                for i in range(len(view) // size)
            ]
            if all(kind == XXH3 for kind in self.kinds):
                digests = checksums(pieces)
            else:
                digests = [CHECKSUMS[kind](piece) for kind, piece in zip(self.kinds, pieces, strict=True)]
            for block, digest in enumerate(digests):
                if digest != self.checksums[block * width + layer]:
                    bad = block if bad is None else min(bad, block)
                    break
        return bad

    def held(self) -> bool:
        """Whether the pin certainly still holds: its lease has not run out and the daemon
        that granted it still owns the arena (a restarted daemon forgets its pins)."""
        return time.monotonic() < self.deadline and self.mapping.current()

    def finish(self) -> bool:
        """End the pin once its bytes have been copied out; False: it may have lapsed
        during the copy (treat the load as failed). When it certainly held, the Release is
        sent without waiting for its answer (a load does not pay its round trip); else
        this waits for the daemon's word, as release() does."""
        self._end_progress()
        if self.released or not self.pin_id:
            return True
        if self.held():
            self.released = True
            self._call("Release", pb.ReleaseRequest(pin_id=self.pin_id), background=True)
            return True
        return self.release()

    def release(self, corrupt: Sequence[bytes] = ()) -> bool:
        """End the pin and wait for the answer; False if its lease had already run out (the
        bytes read may have been reused: treat the load as failed). Safe to call twice."""
        self._end_progress()
        if self.released or not self.pin_id:
            return True
        self.released = True
        try:
            resp = self._call("Release", pb.ReleaseRequest(pin_id=self.pin_id, corrupt_block_hashes=corrupt))
        except errors.KVStoreError as exc:
            log.info("could not release pin %d (its lease will end it): %s", self.pin_id, exc)
            return True  # the pin was alive when the copy ended, as far as we know
        return bool(resp.was_pinned)


class ArenaSource:
    """A LayerStream source over pinned blocks: per layer, one verified view per run.

    Each run's bytes are verified just before they are handed out; a mismatch is
    reported (the daemon re-verifies and drops the block) and ends the stream with
    LocalDataCorrupt. The pin is released when the stream ends; a lease that ran out
    meanwhile ends it with StoreTimeout (the bytes may have been reused).
    """

    def __init__(self, pinned: Pinned, hashes: Sequence[bytes], subset: Sequence[int] = ()) -> None:
        """`subset`: stream only this layer subset of the pinned blocks' layers (chunks count
        within it); empty: all."""
        self._pinned = pinned
        self._hashes = list(hashes[: pinned.num_blocks])
        self.num_blocks = pinned.num_blocks
        self.stop_reason = pinned.stop_reason
        self._subset_indices = subset_indices(subset, len(pinned.layers)) if self.num_blocks else []
        self.layers = [pinned.layers[k] for k in self._subset_indices]
        self._cancelled = False

    def chunks(self) -> Iterator[wire.Chunk]:
        pinned = self._pinned
        width = len(pinned.layers)
        try:
            for position, layer in enumerate(self._subset_indices):
                size = pinned._sizes[layer]
                for first, view in pinned.views(layer):
                    if self._cancelled:
                        raise errors.StoreTimeout("arena read cancelled")
                    for i in range(len(view) // size):
                        block = first + i
                        digest = CHECKSUMS[pinned.kinds[block]]
                        if digest(view[i * size : (i + 1) * size]) != pinned.checksums[block * width + layer]:
                            self._corrupt(block, layer)
                    yield wire.Chunk(position, first, view)
        finally:
            if not pinned.released and not pinned.finish():
                raise errors.StoreTimeout("the pin's lease ran out during the read; read again")

    def _corrupt(self, block: int, layer: int) -> NoReturn:
        block_hash = self._hashes[block]
        name = self._pinned.layers[layer].name
        what = f"block {block_hash.hex()} layer {name!r} fails its checksum in the arena"
        log.warning("%s: reported to the daemon", what)
        self._pinned.release([block_hash])
        raise errors.LocalDataCorrupt(what)

    def cancel(self) -> None:
        self._cancelled = True

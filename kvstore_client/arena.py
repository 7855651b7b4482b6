"""The same-host data plane: saves and loads through the daemon's memory arena.

The daemon owns an arena file in shared memory (kvstore/arena_format.py). A client
on its host maps the file once per process and moves KV bytes itself; gRPC carries
only the control messages:

    save:  Reserve -> write the blocks into the reserved extent -> Commit (checksums)
    load:  Pin -> read the pinned extents (verify checksums) -> Release

    res = kv.reserve(ns, hashes, layers)        # None: the daemon offers no arena here
    res.layer("layer.0").copy_(t0[res.blocks])  # [len(res.blocks), *shape] views
    res.commit()                                # xxh3 per block-layer, then visible
    pin = kv.pin(ns, hashes)                    # pin.pieces(layer) -> [(first, view)]
    ...copy out, pin.verify(), pin.finish()         # or release(): waits for the answer

Who may map the arena: a process that can open the file the daemon names (same
host and the same /dev/shm: in containers, `ipc: service:kvstore` or a shared shm
volume) with read-write access (file mode 0600: the daemon's user; 0660 with
`memory_group`), and finds the daemon's run id in its header. Anything else uses
the gRPC byte stream (Put/Get), as do all calls while the arena cannot be used.

Trust: every process that maps the arena can write all of it. The checksums catch
stray writes and torn reservations, not a malicious peer: give the arena only to
processes you would give the KV itself (that is why `--token-file` turns it off
for clients unless `memory_clients` says otherwise).

The client only maps the arena: pre-faulting its pages and registering them with
CUDA are the caller's (the connector does both: kvstore_connector.host_memory), with
`Mapping.on_close` to undo them when the mapping's last client lets go.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import xxhash

from kvstore import arena_format as fmt
from kvstore import wire
from kvstore.blocks import CHECKSUMS, STOP_NONE, XXH3, selected_layers
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.streams import LayerWrites

if TYPE_CHECKING:
    import torch

    from kvstore_client.types import Chain

log = logging.getLogger(__name__)

_checksum = xxhash.xxh3_64_intdigest
# xxhash releases the GIL only for inputs above 64 KiB (measured on an H200 host: 64 KiB
# pieces hash at ~6 GB/s however many threads; 128 KiB pieces at 20 GB/s on 4 threads,
# 27 on 8), and a task per piece costs more than hashing it: one task per thread, each
# over a contiguous share of the pieces.
_PARALLEL_PIECE = (64 << 10) + 1
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))

Call = Callable[..., Any]
"""call(method, request, timeout=None) -> response: a unary KVStore RPC (raises
KVStoreError); call(method, request, background=True) sends it and returns None at once
(a failure is logged)."""


class ArenaUnavailable(Exception):
    """The arena cannot be used now; the message says why (callers use gRPC)."""


# ---- the mapping, once per process -----------------------------------------------------
class Mapping:
    """One arena file mapped into this process, shared by every client in it that uses
    this daemon run's arena (`_acquire`/`_release` count them). When the last one lets go
    (closed, or moved on to a restarted daemon's arena), the mapping runs its `on_close`
    callbacks and leaves the registry; it is unmapped once no view of it is left (a
    pinned view handed to the caller keeps it). Until then, the pages of an arena file
    the daemon already removed stay allocated (in /dev/shm: memory)."""

    def __init__(self, path: Path, size: int, store_id: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot open {path}: {exc.strerror}") from exc
        try:
            if os.fstat(fd).st_size != size:
                raise ArenaUnavailable(f"{path} is not the size the daemon reports")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot map {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.store_id = store_id
        self.view = memoryview(self._mmap)
        self._tensor: torch.Tensor | None = None
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._lock = threading.Lock()
        self.users = 0  # clients using it (under _MAPPINGS_LOCK)
        if not self.current():
            raise ArenaUnavailable(
                f"{path} belongs to another daemon run than the one at this address "
                "(another host, or another /dev/shm)"
            )

    def current(self) -> bool:
        """Whether the daemon run that offered this file still owns it."""
        try:
            return fmt.Header.unpack(self.view[: fmt.HEADER_BYTES]).store_id == self.store_id
        except fmt.ArenaFormatError:
            return False

    def tensor(self) -> torch.Tensor:
        """The whole arena as one uint8 tensor (made once)."""
        with self._lock:
            if self._tensor is None:
                import torch

                self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            return self._tensor

    def on_close(self, callback: Callable[[], None]) -> bool:
        """Call `callback` when the mapping's last client lets go (to undo what the caller did
        to the mapping: a CUDA registration, a pre-fault thread). False, and never called:
        the mapping is closed already."""
        with self._lock:
            if self._closed:
                return False
            self._on_close.append(callback)
            return True

    def close(self) -> None:
        """Its last client let go: run the `on_close` callbacks. The pages are unmapped when
        the last view of them goes."""
        with self._lock:
            self._closed = True
            callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()


_MAPPINGS: dict[tuple[str, str], Mapping] = {}
_MAPPINGS_LOCK = threading.Lock()


def _acquire(path: Path, size: int, store_id: str) -> Mapping:
    """The process's mapping of this daemon run's arena, mapped if no client has it yet;
    the caller `_release`s it when done."""
    key = (str(path), store_id)
    with _MAPPINGS_LOCK:
        mapping = _MAPPINGS.get(key)
        if mapping is None:
            # an older run's mapping of this path is of no use to new clients: its users
            # release it as they notice the restart
            for old in [k for k in _MAPPINGS if k[0] == key[0]]:
                del _MAPPINGS[old]
            mapping = _MAPPINGS[key] = Mapping(path, size, store_id)
        mapping.users += 1
        return mapping


def _release(mapping: Mapping) -> None:
    with _MAPPINGS_LOCK:
        mapping.users -= 1
        if mapping.users > 0:
            return
        key = (str(mapping.path), mapping.store_id)
        if _MAPPINGS.get(key) is mapping:
            del _MAPPINGS[key]
    mapping.close()


# ---- views over extents ------------------------------------------------------------------
def _layer_sizes(layers: Sequence[Any]) -> list[int]:
    return [wire.layer_block_bytes(spec.dtype, tuple(spec.shape)) for spec in layers]


# A model's layout comes and goes with every save and load: its 256 store layers (a KV
# head each) took ~0.5 ms to build into a request and ~0.4 ms to read from a Pin answer.
# Both are kept by the layout's (name, dtype, shape) rows; the parsed one is a tuple, so
# every Pinned may share it.
_LAYOUTS_KEPT = 64
_WIRE_LAYERS: dict[tuple[tuple[str, str, tuple[int, ...]], ...], list[pb.LayerSpec]] = {}
_PINNED_LAYOUTS: dict[tuple[Any, ...], PinnedLayout] = {}


def _wire_layers(layers: Sequence[Any]) -> list[pb.LayerSpec]:
    key = tuple([(s.name, s.dtype, tuple(s.shape)) for s in layers])
    found = _WIRE_LAYERS.get(key)
    if found is None:
        if len(_WIRE_LAYERS) >= _LAYOUTS_KEPT:
            _WIRE_LAYERS.clear()
        found = _WIRE_LAYERS[key] = [pb.LayerSpec(name=n, dtype=d, shape=shape) for n, d, shape in key]
    return found


PinnedLayout = tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...]]


def _pinned_layout(specs: Sequence[pb.LayerSpec], spec_type: Any) -> PinnedLayout:
    """A Pin answer's layers (as `spec_type`), their bytes per block and their starts in a
    one-block extent."""
    key = (spec_type, *[(s.name, s.dtype, tuple(s.shape)) for s in specs])
    found = _PINNED_LAYOUTS.get(key)
    if found is None:
        layers = tuple(spec_type(s.name, s.dtype, tuple(s.shape)) for s in specs)
        sizes = _layer_sizes(layers)
        if len(_PINNED_LAYOUTS) >= _LAYOUTS_KEPT:
            _PINNED_LAYOUTS.clear()
        found = _PINNED_LAYOUTS[key] = (layers, tuple(sizes), tuple(fmt.layer_starts(sizes)))
    return found


def _typed(mapping: Mapping, offset: int, count: int, spec: Any) -> torch.Tensor:
    """`count` blocks of one layer at `offset` as a [count, *shape] tensor of its dtype."""
    from kvstore_client.tensors import torch_dtype

    nbytes = wire.layer_block_bytes(spec.dtype, tuple(spec.shape)) * count
    raw = mapping.tensor()[offset : offset + nbytes]
    return raw.view(torch_dtype(spec.dtype)).view(count, *spec.shape)


def _typed_rows(rows: torch.Tensor, spec: Any) -> torch.Tensor:
    """uint8 rows [count, layer bytes] (strided) as a [count, *shape] tensor of the layer's dtype."""
    from kvstore_client.tensors import torch_dtype

    return rows.view(torch_dtype(spec.dtype)).view(rows.shape[0], *spec.shape)


def _hash_all(pieces: Sequence[memoryview]) -> list[int]:
    return [_checksum(piece) for piece in pieces]


def checksums(pieces: Sequence[memoryview]) -> list[int]:
    """xxh3-64 of each piece; split over threads when the pieces release the GIL."""
    if _HASH_THREADS < 2 or len(pieces) < 2 or len(pieces[0]) < _PARALLEL_PIECE:
        return _hash_all(pieces)
    share = -(-len(pieces) // _HASH_THREADS)
    parts = [pieces[i : i + share] for i in range(share, len(pieces), share)]
    futures = [_hasher().submit(_hash_all, part) for part in parts]
    out = _hash_all(pieces[:share])  # this thread takes the first share
    for future in futures:
        out.extend(future.result())
    return out


_HASHER: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    with _MAPPINGS_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(_HASH_THREADS - 1, thread_name_prefix="kvstore-xxh3")
        return _HASHER


def _put_result(resp: Any) -> Any:
    """A Commit's answer as a PutResult (None: nothing was reserved, nothing written)."""
    from kvstore_client.types import PutResult

    if resp is None:
        return PutResult(0, 0, 0, 0)
    return PutResult(resp.blocks_written, resp.blocks_skipped, resp.bytes_written, resp.blocks_evicted)


def _answered(answer: Any, make: Callable[[Any], Any]) -> Any:
    """One item's answer of a *Many call: make(answer), or the error it was refused with."""
    return errors.from_code(answer.refused_code, answer.refused) if answer.refused_code else make(answer)


def _each(
    items: Sequence[Any], one: Callable[[Any], Any], undo: Callable[[Any], Any] | None
) -> list[Any] | None:
    """one(item) for each item (a daemon without the *Many call): each result, or the
    KVStoreError it raised; None when one answered None (no arena any more), after undo()
    of the results made before."""
    out: list[Any] = []
    for item in items:
        try:
            result = one(item)
        except errors.KVStoreError as exc:
            out.append(exc)
            continue
        if result is None:
            for made in out:
                if undo is not None and not isinstance(made, errors.KVStoreError):
                    undo(made)
            return None
        out.append(result)
    return out


class Reservation:
    """An extent reserved for a save: write each layer's blocks, then `commit()`.

    `blocks` are the indexes (into the request's hashes) of the blocks to write:
    the ones the store did not hold yet, in extent order. `layer(i)` is the
    [len(blocks), *shape] view of layer i in the arena. Nothing is visible until
    commit; `abort()` gives the space back (so does the lease running out).
    """

    def __init__(
        self,
        call: Call,
        mapping: Mapping,
        resp: pb.ReserveResponse,
        layers: Sequence[Any],
        subset: Sequence[int] = (),
    ) -> None:
        self._call = call
        self.mapping = mapping
        self.reservation_id: int = resp.reservation_id
        self.blocks: list[int] = list(resp.blocks)
        self.offset: int = resp.offset
        self.lease_seconds: float = resp.lease_seconds
        self.layers = [layers[k] for k in subset] if subset else list(layers)
        self._index = {spec.name: i for i, spec in enumerate(self.layers)}
        self._sizes = _layer_sizes(self.layers)
        # where each layer's run of these blocks starts, relative to `offset`: layers back
        # to back, or, written in place (a partial save into its blocks' one extent: see
        # ReserveResponse.extent_blocks), where the subset's layers lie among all layers
        self.in_place = bool(resp.extent_blocks)
        if self.in_place:
            full = _layer_sizes(layers)
            starts = fmt.layer_offsets(full, resp.extent_blocks)
            self._starts = [starts[k] + resp.position * full[k] for k in subset]
        else:
            self._starts = fmt.layer_offsets(self._sizes, len(self.blocks))
        self.done = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def layer(self, layer: str | int) -> torch.Tensor:
        i = self._index[layer] if isinstance(layer, str) else layer
        return _typed(self.mapping, self.offset + self._starts[i], len(self.blocks), self.layers[i])

    def layer_start(self, layer: int) -> int:
        """Where `layer`'s blocks start, relative to `offset` (back to back with the
        layer before it, unless `in_place`: then where the layout puts it among the other
        ranks' layers; a rank's consecutive layers of one attention layer still lie back to
        back)."""
        return self._starts[layer]

    def layer_pieces(self, layer: int) -> list[memoryview]:
        """Each written block's bytes of one layer, in block order."""
        view, size = self.mapping.view, self._sizes[layer]
        at = self.offset + self._starts[layer]
        return [view[at + i * size : at + (i + 1) * size] for i in range(len(self.blocks))]

    def checksums(self, per_layer: dict[int, list[int]] | None = None) -> array[int]:
        """Commit's checksums, block-major; `per_layer[l]` may come precomputed (e.g. each
        layer hashed as soon as its copy landed), the other layers are hashed now."""
        width = len(self.layers)
        out = array("Q", bytes(8 * width * len(self.blocks)))
        for layer in range(width):  # one strided assignment a layer, not an int a block-layer
            sums = per_layer.get(layer) if per_layer else None
            out[layer::width] = array("Q", checksums(self.layer_pieces(layer)) if sums is None else sums)
        return out

    def commit(self, sums: Sequence[int] | bytes | None = None, *, kind: str = XXH3) -> Any:
        """Checksum what was written (unless `sums` come precomputed, of `kind`: "xxh3", or
        "wsum32" as a GPU computes it, see kvstore.blocks; block-major, as ints or already
        packed as little-endian uint64s) and commit."""
        req = self.commit_request(sums, kind=kind)
        if req is None:  # every block was stored already: nothing was reserved
            return _put_result(None)
        try:
            return _put_result(self._call("Commit", req))
        except errors.KVStoreError:
            self.done = False  # not committed: abort() gives the extent back
            raise

    def commit_request(self, sums: Sequence[int] | bytes | None = None, *, kind: str = XXH3) -> Any:
        """The CommitRequest of commit() (None when nothing was reserved); the reservation
        counts as committed from here on."""
        self.done = True
        if not self.blocks:
            return None
        if sums is None:
            sums = self.checksums()
        packed = sums if isinstance(sums, bytes) else wire.pack_checksums(sums)
        return pb.CommitRequest(reservation_id=self.reservation_id, checksums=packed, checksum_kind=kind)

    def abort(self) -> None:
        """Give the extent back; safe to call twice. A failure is logged (the lease frees it)."""
        if self.done or not self.blocks:
            self.done = True
            return
        self.done = True
        try:
            self._call("Abort", pb.AbortRequest(reservation_id=self.reservation_id))
        except errors.KVStoreError as exc:
            log.info("could not abort reservation %d (its lease will end it): %s", self.reservation_id, exc)


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
        self.layers, self._sizes, self._starts = _pinned_layout(resp.layers, spec_type)
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
            self._progress = None
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
            self.ready_blocks = self.num_blocks
            self._end_progress()

    def _end_progress(self) -> None:
        call, self._progress = self._progress, None
        if call is not None:
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

    def verify(self, layers: Sequence[int] | None = None) -> int | None:
        """Index of the first block whose bytes fail a checksum (of `layers`, default all),
        or None when all match."""
        width = len(self.layers)
        bad: int | None = None
        for layer in range(width) if layers is None else layers:
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

    def __init__(self, pinned: Pinned, hashes: Sequence[bytes], layers: Sequence[int] = ()) -> None:
        """`layers`: stream only these of the pinned blocks' layers (chunks count within them)."""
        self._pinned = pinned
        self._hashes = list(hashes[: pinned.num_blocks])
        self.num_blocks = pinned.num_blocks
        self.stop_reason = pinned.stop_reason
        self._used = selected_layers(layers, len(pinned.layers)) if self.num_blocks else []
        self.layers = [pinned.layers[k] for k in self._used]
        self._cancelled = False

    def chunks(self) -> Iterator[wire.Chunk]:
        pinned = self._pinned
        width = len(pinned.layers)
        try:
            for position, layer in enumerate(self._used):
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


class Arena:
    """A client's use of the daemon's arena: negotiated lazily, re-negotiated when the
    daemon restarts (its run id changes). Never waits on another thread's negotiation."""

    def __init__(self, call: Call, spec_type: Any, retry_interval: float = 30.0) -> None:
        self._call = call
        self._spec_type = spec_type
        self._retry_interval = retry_interval
        self._streams = True  # the daemon answers PinStream (until it says it does not)
        self._lock = threading.Lock()
        self._mapping: Mapping | None = None
        self._prefix = b""
        self._negotiating = False
        self._next_try = 0.0
        self._reason: str | None = None
        self._closed = False

    def mapping(self) -> Mapping | None:
        """The arena, mapped; None while it cannot be used (then use gRPC)."""
        stale = None
        with self._lock:
            mapping = self._mapping
            if mapping is not None and mapping.current():
                return mapping
            if mapping is not None:  # the daemon restarted: ask again now
                stale, self._mapping = mapping, None
                self._next_try = 0.0
            if self._negotiating or self._closed or time.monotonic() < self._next_try:
                opening = False
            else:
                opening = self._negotiating = True
                self._next_try = time.monotonic() + self._retry_interval
        if stale is not None:
            _release(stale)
        if not opening:
            return None
        opened = None
        try:
            opened = self._open()
        except ArenaUnavailable as exc:
            if str(exc) != self._reason:
                self._reason = str(exc)
                log.info("arena off, using gRPC: %s", exc)
        with self._lock:
            self._negotiating = False
            if self._closed and opened is not None:
                stale, opened = opened, None
            else:
                stale, self._mapping = None, opened
        if stale is not None:
            _release(stale)
        if opened is not None:
            self._reason = None
        return opened

    def _open(self) -> Mapping:
        try:
            resp = self._call("ArenaAccess", pb.ArenaAccessRequest())
        except errors.KVStoreError as exc:
            raise ArenaUnavailable(f"the daemon does not offer its arena: {exc}") from exc
        return _acquire(Path(resp.path), resp.size_bytes, resp.store_id)

    def reserve(
        self,
        namespace: bytes,
        hashes: Sequence[bytes],
        layers: Sequence[Any],
        parent_hash: bytes,
        timeout: float | None = None,
        token_ids: Sequence[int] = (),
        subset: Sequence[int] = (),
    ) -> Reservation | None:
        """A reservation; None when the arena is off (use Put). A reservation with no blocks
        means every block is stored already. `subset`: a partial save of these of `layers`
        (the reservation then holds only them, in that order)."""
        mapping = self.mapping()
        if mapping is None:
            return None
        req = pb.ReserveRequest(
            namespace=namespace,
            block_hashes=hashes,
            parent_hash=parent_hash,
            layers=_wire_layers(layers),
            token_ids=token_ids,
            layer_subset=subset,
            in_place=bool(subset),
        )
        try:
            resp = self._call("Reserve", req, timeout)
        except errors.NotOffered:
            self._off()
            return None
        return Reservation(self._call, mapping, resp, layers, subset)

    def reserve_many(
        self,
        namespace: bytes,
        chains: Sequence[Chain],
        layers: Sequence[Any],
        timeout: float | None = None,
        subset: Sequence[int] = (),
    ) -> list[Reservation | errors.KVStoreError] | None:
        """A reservation per chain (saves of one layout) in one round trip, in order: each
        a Reservation, or the error a reserve of that chain alone would have raised. None
        when the arena is off. A daemon without ReserveMany is asked chain by chain."""
        mapping = self.mapping()
        if mapping is None:
            return None
        req = pb.ReserveManyRequest(
            namespace=namespace,
            layers=_wire_layers(layers),
            layer_subset=subset,
            in_place=bool(subset),
            chains=[
                pb.ReserveChain(block_hashes=c.hashes, parent_hash=c.parent_hash, token_ids=c.token_ids)
                for c in chains
            ],  # fmt: skip
        )
        try:
            answers = self._many("ReserveMany", req, "reservations", len(chains), timeout)
        except errors.NotOffered:
            self._off()
            return None
        if answers is None:

            def one(c: Chain) -> Reservation | None:
                return self.reserve(namespace, c.hashes, layers, c.parent_hash, timeout, c.token_ids, subset)

            return _each(chains, one, Reservation.abort)
        return [
            _answered(answer, lambda a: Reservation(self._call, mapping, a, layers, subset))
            for answer in answers
        ]

    def commit_many(
        self,
        items: Sequence[tuple[Reservation, Sequence[int] | bytes | None, str]],
        timeout: float | None = None,
    ) -> list[Any]:
        """Reservation.commit(sums, kind=kind) of each item in one round trip, in order: each
        a PutResult, or the KVStoreError its commit alone would have raised (that
        reservation may then be aborted). A daemon without CommitMany is asked one commit
        at a time."""
        requests = [res.commit_request(sums, kind=kind) for res, sums, kind in items]
        sent = [req for req in requests if req is not None]
        if not sent:
            return [_put_result(None) for _ in items]
        try:
            answers = self._many(
                "CommitMany", pb.CommitManyRequest(commits=sent), "answers", len(sent), timeout
            )
        except errors.KVStoreError:
            for res, _, _ in items:
                res.done = False  # not committed, as far as we know: abort() may give them back
            raise
        if answers is None:
            results = _each(sent, lambda req: _put_result(self._call("Commit", req, timeout)), None) or []
        else:
            results = [_answered(answer, lambda a: _put_result(a.result)) for answer in answers]
        got = iter(results)
        out = [next(got) if req is not None else _put_result(None) for req in requests]
        for (res, _, _), answer in zip(items, out, strict=True):
            if isinstance(answer, errors.KVStoreError):
                res.done = False  # not committed: abort() gives the extent back
        return out

    def _many(
        self, method: str, request: Any, field: str, count: int, timeout: float | None
    ) -> list[Any] | None:
        """The answers of a *Many call (its response's `field`), one per item, in order;
        None from a daemon that predates the call (UNIMPLEMENTED): ask item by item."""
        try:
            resp = self._call(method, request, timeout)
        except errors.StoreInternalError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
            return None
        answers = list(getattr(resp, field))
        if len(answers) != count:
            raise errors.StoreInternalError(f"{method} answered {len(answers)} of {count}")
        return answers

    def pin(
        self, namespace: bytes, hashes: Sequence[bytes], timeout: float | None = None, *, stream: bool = False
    ) -> Pinned | None:
        mapping = self.mapping()
        if mapping is None:
            return None
        sent = time.monotonic()
        request = pb.PinRequest(namespace=namespace, block_hashes=hashes)
        try:
            if stream and self._streams:
                call = self._call("PinStream", request, timeout)
                try:
                    first = next(call)
                except errors.KVStoreError as exc:
                    if exc.code != "UNIMPLEMENTED":
                        raise
                    self._streams = False  # a daemon that predates it
                    log.info("the daemon has no PinStream: pins wait for their promotion")
                except StopIteration:
                    raise errors.StoreInternalError("PinStream ended without an answer") from None
                else:
                    return Pinned(self._call, mapping, first.pin, self._spec_type, sent, (call, first))
            resp = self._call("Pin", request, timeout)
        except errors.NotOffered:
            self._off()
            return None
        return Pinned(self._call, mapping, resp, self._spec_type, sent)

    def leased(self, pin: pb.PinResponse, store_id: str, taken: float) -> Pinned | None:
        """A lookup's lease of one namespace (kvstore_client.Lease: `pin`, its daemon run
        and when it was taken) as a Pinned, to load from like a Pin's answer and release
        after; None when this client cannot use it (no arena, or another daemon run's
        arena mapped: the caller gives its share back, e.g. with release_lease)."""
        mapping = self.mapping()
        if mapping is None or mapping.store_id != store_id or not pin.pin_id:
            return None
        return Pinned(self._call, mapping, pin, self._spec_type, taken)

    def pin_many(
        self, namespace: bytes, chains: Sequence[Sequence[bytes]], timeout: float | None = None
    ) -> list[Pinned | errors.KVStoreError] | None:
        """A pin of each chain (one namespace) in one round trip, in order: each a Pinned
        (its blocks in place: promoted first where needed), or the error a pin of that
        chain alone would have raised. None when the arena is off. A daemon without
        PinMany is asked chain by chain."""
        mapping = self.mapping()
        if mapping is None:
            return None
        sent = time.monotonic()
        request = pb.PinManyRequest(namespace=namespace, chains=[pb.PinChain(block_hashes=c) for c in chains])
        try:
            answers = self._many("PinMany", request, "pins", len(chains), timeout)
        except errors.NotOffered:
            self._off()
            return None
        if answers is None:
            return _each(chains, lambda hashes: self.pin(namespace, hashes, timeout), Pinned.release)
        return [
            _answered(pin, lambda a: Pinned(self._call, mapping, a, self._spec_type, sent)) for pin in answers
        ]

    def _off(self) -> None:
        with self._lock:
            mapping, self._mapping = self._mapping, None
            self._next_try = time.monotonic() + self._retry_interval
        if mapping is not None:
            _release(mapping)

    def close(self) -> None:
        """Let go of the mapping (its client is closing); later calls use no arena."""
        with self._lock:
            self._closed = True
            mapping, self._mapping = self._mapping, None
        if mapping is not None:
            _release(mapping)


class ArenaPutStream:
    """PutStream's interface over a reservation: each write_layer copies the layer's
    blocks straight into the arena (the blocks the store lacks), commit checksums and
    commits. The tensors may be reused as soon as write_layer returns."""

    def __init__(self, reservation: Reservation, num_blocks: int, timeout: float) -> None:
        self.reservation = reservation
        self.layers = reservation.layers
        self.num_blocks = num_blocks
        self.timeout = timeout
        self._writes = LayerWrites(self.layers, num_blocks)
        self._ids: torch.Tensor | None = None
        self._done = False

    def write_layer(self, layer: str | int, tensor: torch.Tensor) -> None:
        import torch

        from kvstore_client.tensors import copy_into

        index, _spec = self._writes.take(layer, tensor)
        blocks = self.reservation.blocks
        if blocks:
            dest = self.reservation.layer(index)
            if len(blocks) == self.num_blocks:
                copy_into(dest, tensor)
            else:
                if self._ids is None:
                    self._ids = torch.tensor(blocks, dtype=torch.long, device=tensor.device)
                torch.index_select(tensor, 0, self._ids, out=dest)

    def commit(self) -> Any:
        from kvstore_client.types import PutResult

        missing = self._writes.missing()
        if missing:
            self.abort()
            raise ValueError(f"commit without layers {missing[:4]}")
        self._done = True
        if not self.reservation.blocks:
            return PutResult(0, self.num_blocks, 0, 0)
        return self.reservation.commit()

    def abort(self) -> None:
        if not self._done:
            self._done = True
            if self.reservation.blocks:
                self.reservation.abort()

    def __enter__(self) -> ArenaPutStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or not self._done:
            self.abort()

"""Moving whole blocks between vLLM's paged KV buffers and host memory.

Every layer's paged buffer has one dimension that indexes blocks (dim 0 in the
standardized [num_blocks, H, block_size, C] views of vLLM 0.32+, MLA included;
found, not assumed). A save gathers a request's blocks with one indexed copy
per layer; a load scatters them back with one. Blocks are moved as opaque
bytes: their interior layout (e.g. K stored transposed by the CPU backend)
never matters, as long as both sides share a namespace.

On CUDA the host side is pinned memory and copies run on a side stream: the
compute stream is never synchronised on the store, it only waits (GPU-side)
for the copies that touch blocks it is about to use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from kvstore_connector.compression import Codec


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A view of `tensor` with blocks at dim 0.

    vLLM 0.32+ hands connectors block-major views; older layouts kept K/V at
    dim 0 ([2, num_blocks, ...]); kernel-block splitting gives
    [num_blocks * r, ...]. Anything else is refused with a clear error.
    """
    if tensor.shape[0] == num_blocks:
        return tensor
    if tensor.shape[0] % num_blocks == 0 and tensor.shape[0] > num_blocks:
        return tensor.unflatten(0, (num_blocks, -1))
    for dim in range(1, tensor.dim()):
        if tensor.shape[dim] == num_blocks:
            return tensor.movedim(dim, 0)
    raise ValueError(f"no dimension of KV cache shape {tuple(tensor.shape)} indexes its {num_blocks} blocks")


def index_select(
    kv: torch.Tensor, dim: int, ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """torch.index_select at `dim` 0 or 1 (into `out` when given). On CPU, dim 1 is done
    as one dim-0 select per row: torch's CPU kernel for a later dim copies element by
    element (32 MiB of a [blocks, heads, 16, 256] bf16 view: 133 ms, against 2 ms a row at
    a time); CUDA's is one kernel either way."""
    if dim == 0 or kv.is_cuda:
        return torch.index_select(kv, dim, ids) if out is None else torch.index_select(kv, dim, ids, out=out)
    if dim != 1:
        raise ValueError(f"index_select at dim {dim}: only 0 and 1")
    if out is None:
        out = kv.new_empty((kv.shape[0], len(ids), *kv.shape[2:]))
    for row in range(kv.shape[0]):
        torch.index_select(kv[row], 0, ids, out=out[row])
    return out


Write = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]
"""(kv, ids, staged, dim): staged blocks to write into a paged view at ids (scatter_staged);
dim 1: kv is [layers, num_blocks, ...] and staged [layers, len(ids), ...] (a rank's KV heads)."""


@dataclass
class PendingCopy:
    """A device->host copy in flight; `wait()` before reading `host`."""

    host: torch.Tensor
    event: Any = None  # torch.cuda.Event on CUDA
    keep: Any = None  # the device tensor the copy reads, alive until the copy is done

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.keep = None
        return self.host


class BlockMover:
    """Gathers and scatters blocks of one device's KV buffers."""

    def __init__(self, device: torch.device, codec: Codec | None = None) -> None:
        """`codec` (kvstore_connector.compression): blocks are quantized on this device as
        they are gathered, and dequantized on it before they are scattered; the host side
        then holds the codec's packed rows (uint8 [n, P]), not the cache's dtype."""
        self.codec = codec
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # an index: torch's stream lookups then take its fast path
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # D2H and H2D copies on one stream, scatters on another, checksums on a third: the
        # copy engine never waits for a kernel before starting the next copy, and a load's
        # scatter of one group never queues behind the checks of groups still landing.
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._scatter_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._check_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def _current(self) -> torch.cuda.Stream:
        """The calling thread's current stream on this device."""
        return torch.cuda.current_stream(self.device.index)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream) -> Iterator[None]:
        """torch.cuda.stream(stream) for a stream of this device, without its per-call device
        lookups (~20 us each; a save and a load enter these once or twice per layer)."""
        previous = self._current()
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(previous)

    def index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def to_device_for_load(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor (block ids, checksums) on the device for a load, copied on the
        copy stream, which the load's scatters follow; from another thread the default
        stream would wait for the forward pass in flight."""
        if not self.cuda:
            return host
        pinned = host.pin_memory()  # the caching host allocator keeps it until the copy ran
        with self.on_copy_stream():
            return pinned.to(self.device, non_blocking=True)

    def gather(self, kv: torch.Tensor, ids: torch.Tensor) -> PendingCopy:
        """Copy blocks `ids` of a block-major view `kv` to host memory: [n, *kv.shape[1:]]
        (pinned on CUDA; with a codec, its packed rows); see gather_into."""
        gathered = self._selected(kv, ids)
        if not self.cuda:
            return PendingCopy(gathered)
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        return self._to_host(gathered, host)

    def _selected(
        self, kv: torch.Tensor, ids: torch.Tensor, via: torch.Tensor | None = None, dim: int = 0
    ) -> torch.Tensor:
        """Blocks `ids` of `kv` (indexed at `dim`) on its device, encoded when there is a codec
        (a row per block and layer), into `via` when given (dest's shape, on kv's device)."""
        if self.codec is None:
            return index_select(kv, dim, ids, via)
        blocks = index_select(kv, dim, ids)
        rows = blocks if dim == 0 else blocks.flatten(0, 1)
        if via is None:
            return self.codec.encode(rows).view(*blocks.shape[: dim + 1], -1)
        self.codec.encode_into(rows, via.view(rows.shape[0], -1))
        return via

    def gather_into(
        self,
        kv: torch.Tensor,
        ids: torch.Tensor,
        dest: torch.Tensor,
        via: torch.Tensor | None = None,
        *,
        dim: int = 0,
    ) -> PendingCopy:
        """Copy blocks `ids` of `kv` into the host tensor `dest` ([len(ids), *kv.shape[1:]],
        e.g. an arena reservation; with a codec, [len(ids), P] uint8): on CPU one indexed
        copy; on CUDA the gather (and encoding) runs on the compute stream (right after
        attention wrote the blocks, before anything can reuse them: ~0.1 ms per 256 MB on an
        H200) and the device-to-host copy on the side stream. `via` (dest's shape, on the
        device): gather there, copy from there (and keep it). `dim` 1: `kv` is [layers,
        num_blocks, ...] (a rank's KV heads of one layer) and `dest` [layers, len(ids), ...]."""
        if not self.cuda:  # into dest itself, or through via
            if via is None:
                self._selected(kv, ids, dest, dim)
            else:
                dest.copy_(self._selected(kv, ids, via, dim))
            return PendingCopy(dest)
        return self._to_host(self._selected(kv, ids, via, dim), dest)

    def _to_host(self, gathered: torch.Tensor, dest: torch.Tensor) -> PendingCopy:
        """Copy `gathered` (on the device, queued on the compute stream) to `dest` on the side stream."""
        stream = cast(torch.cuda.Stream, self._stream)
        stream.wait_stream(self._current())
        with self._on(stream):
            dest.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return PendingCopy(dest, event, gathered)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where a load lands before it is scattered: pinned on CUDA."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def scatter(self, kv: torch.Tensor, ids: torch.Tensor, host: torch.Tensor) -> Any:
        """Write host blocks into `kv` at `ids`. Returns a CUDA event to wait on (None on CPU)."""
        if not self.cuda:
            kv.index_copy_(0, ids, self._decoded(kv, host))
            return None
        copy_stream = cast(torch.cuda.Stream, self._stream)
        scatter_stream = cast(torch.cuda.Stream, self._scatter_stream)
        with self._on(copy_stream):
            staged = host.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        scatter_stream.wait_event(copied)
        with self._on(scatter_stream):
            kv.index_copy_(0, ids, self._decoded(kv, staged))
            done = torch.cuda.Event()
            done.record(scatter_stream)
        staged.record_stream(scatter_stream)
        return done

    # Staged loads (see ArenaTransport): host -> device on the copy stream, checks there,
    # then scatters. On CPU the same calls run in order on this thread (stage is a copy),
    # so the path is the same code on both.
    def on_copy_stream(self) -> Any:
        """A context that queues work on the copy stream (behind its copies)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return self._on(cast(torch.cuda.Stream, self._stream))

    def on_check_stream(self, after: Any = None, *, after_compute: bool = False) -> Any:
        """A context that queues work on the check stream (a load's checks, a save's
        checksums), behind event `after`, or behind what the calling thread's current
        (compute) stream has queued so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        stream = cast(torch.cuda.Stream, self._check_stream)
        if after is not None:
            stream.wait_event(after)
        if after_compute:
            stream.wait_stream(self._current())
        return self._on(stream)

    def record(self, *, on_check: bool = False) -> Any:
        """A CUDA event recorded now on the copy stream (or the check stream); None on CPU,
        where all is done already."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(cast(torch.cuda.Stream, self._check_stream if on_check else self._stream))
        return event

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        """Host to device on the copy stream (the load's first half, see scatter_staged)."""
        if not self.cuda:
            return host.clone()
        with self.on_copy_stream():
            return host.to(self.device, non_blocking=True)

    def stage_into(self, on_device: torch.Tensor, host: torch.Tensor) -> None:
        """Host to device into `on_device` (allocated on the copy stream) on the copy stream."""
        if not self.cuda:
            on_device.copy_(host)
            return
        with self.on_copy_stream():
            on_device.copy_(host, non_blocking=True)

    def scatter_staged(self, writes: list[Write], ready: Any) -> Any:
        """Each (kv, ids, staged): write the staged device blocks into `kv` at `ids`, once
        `ready` (an event) has fired; returns one event to wait on before using any of
        them (None on CPU: written already)."""
        if not self.cuda:
            for kv, ids, staged, dim in writes:
                kv.index_copy_(dim, ids, self._decoded(kv, staged, dim))
            return None
        scatter_stream = cast(torch.cuda.Stream, self._scatter_stream)
        if ready is not None:
            scatter_stream.wait_event(ready)
        with self._on(scatter_stream):
            for kv, ids, staged, dim in writes:
                kv.index_copy_(dim, ids, self._decoded(kv, staged, dim))
            done = torch.cuda.Event()
            done.record(scatter_stream)
        for _kv, _ids, staged, _dim in writes:
            staged.record_stream(scatter_stream)
        return done

    def _decoded(self, kv: torch.Tensor, blocks: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Blocks as `kv` holds them: dequantized (on their device) when there is a codec.
        `dim` 1: [layers, n, ...] blocks of a [layers, num_blocks, ...] `kv`."""
        if self.codec is None:
            return blocks
        lead = blocks.shape[: dim + 1]
        rows = blocks.reshape(lead.numel(), -1)
        return self.codec.decode(rows, kv.dtype, tuple(kv.shape[dim + 1 :])).view(*lead, *kv.shape[dim + 1 :])

    def wait_on_compute_stream(self, event: Any) -> None:
        """Make the compute stream wait (GPU-side, no host sync) for a scatter."""
        if event is not None:
            self._current().wait_event(event)


_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def wsum32_blocks(blocks: torch.Tensor) -> torch.Tensor | None:
    """kvstore.blocks.wsum32 of each block of a contiguous [n, ...] tensor, in one pass on
    its device: an int64 tensor [n] holding the bits of each unsigned sum. None when a
    block's bytes are not whole 32-bit words (callers then use xxh3 on the host)."""
    n = blocks.shape[0]
    raw = blocks.contiguous().view(torch.uint8).reshape(n, -1)
    if raw.shape[1] % 4:
        return None
    # zero-extended from uint32 (no masking pass), multiplied in place: 0.21 ms for 64 MiB
    # on an H100 against 0.32 (int32, masked, then a product; bench/results/check_h100_micro.txt)
    words = raw.view(torch.uint32).to(torch.int64)
    key = (words.shape[1], str(blocks.device))
    weights = _WEIGHTS.get(key)
    if weights is None:
        if len(_WEIGHTS) > 16:
            _WEIGHTS.clear()
        weights = _WEIGHTS[key] = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=blocks.device)
    words *= weights
    return words.sum(dim=1)  # int64 arithmetic wraps: the sum mod 2**64


def unsigned(value: int) -> int:
    """An int64 tensor element as the unsigned 64-bit checksum it holds."""
    return value & 0xFFFFFFFFFFFFFFFF


def signed(value: int) -> int:
    """An unsigned 64-bit checksum as an int64 tensor element."""
    return value - (1 << 64) if value >= 1 << 63 else value

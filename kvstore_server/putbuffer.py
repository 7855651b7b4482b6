"""Where one Put's payload lives while it streams in, until its commit is stored.

An anonymous mapping of exactly the bytes the Put's header declared (what
`max_inflight_put_bytes` admitted), laid out block-major: block i's layers back
to back, in header order. So:

- the daemon's memory for puts is exactly what the budget admitted, and goes
  back to the kernel (munmap) when the put ends, instead of staying in malloc's
  heap where gRPC's freed messages fragment it (measured: 2.5x the admitted
  bytes, resident long after the load);
- each received message is copied in and dropped at once, never held until the
  commit;
- a block is one contiguous value: LMDB stores it without joining its layers.

Each block-layer's checksum is computed as it is copied in (cache-hot, outside
the store's commit lock).

`PutBudget` admits puts against `max_inflight_put_bytes` and keeps the mappings
of finished puts for the next put of the same size: a fresh mapping costs the
kernel zeroing and mapping every page, which took a fifth of a 64 MiB put's time
here. Kept mappings count against the budget too (they are given up first when
a put needs the room), so what puts map never exceeds it, and they are all
unmapped once the daemon is idle.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence

from kvstore import wire
from kvstore_server.errors import MalformedPut
from kvstore_server.tiers import LayerSpec, checksum

log = logging.getLogger(__name__)

# Pre-fault the mapping in one call: cheaper than one fault per 4 KiB page as it fills.
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class PutBuffer:
    """One Put's blocks: fill with `accept`, check with `missing_layers`, read with
    `block` and `layer`, then `close`. Not thread-safe (one Put stream is one thread)."""

    def __init__(
        self, layers: Sequence[LayerSpec], num_blocks: int, mapping: mmap.mmap | None = None
    ) -> None:
        """`mapping`: one of exactly the payload's size to reuse (every byte a commit
        reads is written first: a put commits only once all its blocks arrived)."""
        self.layers = tuple(layers)
        self.num_blocks = num_blocks
        self.block_bytes = sum(layer.nbytes for layer in layers)
        self.nbytes = self.block_bytes * num_blocks
        self._offsets = []
        offset = 0
        for layer in layers:
            self._offsets.append(offset)
            offset += layer.nbytes
        self._map = mapping if mapping is not None else mmap.mmap(-1, self.nbytes, flags=_FLAGS)
        self._view = memoryview(self._map)
        self.checksums: list[list[int]] = [[] for _ in layers]

    def accept(self, chunk: wire.Chunk) -> None:
        """Copy one LayerChunk in: the next blocks of one layer, in order."""
        if chunk.layer_index >= len(self.layers):
            raise MalformedPut(f"chunk for layer {chunk.layer_index}; the header declared {len(self.layers)}")
        spec = self.layers[chunk.layer_index]
        sums = self.checksums[chunk.layer_index]
        if chunk.first_block != len(sums):
            raise MalformedPut(
                f"layer {spec.name!r}: chunk starts at block {chunk.first_block}, expected {len(sums)}"
            )
        size = len(chunk.data)
        if size == 0 or size % spec.nbytes:
            raise MalformedPut(
                f"layer {spec.name!r}: chunk of {size} bytes is not a whole number of "
                f"{spec.nbytes}-byte blocks ({spec.dtype} {list(spec.shape)})"
            )
        count = size // spec.nbytes
        if len(sums) + count > self.num_blocks:
            raise MalformedPut(f"layer {spec.name!r}: more data than the {self.num_blocks} declared blocks")
        nbytes = spec.nbytes
        dest = self._offsets[chunk.layer_index] + chunk.first_block * self.block_bytes
        for i in range(count):
            target = self._view[dest : dest + nbytes]
            target[:] = chunk.data[i * nbytes : (i + 1) * nbytes]
            sums.append(checksum(target))
            dest += self.block_bytes

    def missing_layers(self) -> list[str]:
        """Names of the layers not yet complete."""
        return [
            spec.name
            for spec, sums in zip(self.layers, self.checksums, strict=True)
            if len(sums) < self.num_blocks
        ]

    def block(self, index: int) -> memoryview:
        """Block `index`: its layers' bytes back to back."""
        start = index * self.block_bytes
        return self._view[start : start + self.block_bytes]

    def layer(self, layer_index: int, index: int) -> memoryview:
        start = index * self.block_bytes + self._offsets[layer_index]
        return self._view[start : start + self.layers[layer_index].nbytes]

    def detach(self) -> mmap.mmap | None:
        """End this buffer: its mapping, free for another put, or None when a view handed
        out is still held (say, by a traceback): that mapping is unmapped when the view goes."""
        self._view.release()
        try:
            self._map.resize(self.nbytes)  # raises while another view is exported
        except BufferError:
            log.debug("a put's payload is still referenced; it is unmapped when the last view goes")
            return None
        return self._map


class PutBudget:
    """Bytes of puts in flight, at most `limit`, and the mappings kept for reuse (which
    count against it too). Thread-safe; acquiring never waits."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # bytes of puts in flight
        self._kept: dict[int, list[mmap.mmap]] = {}
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, layers: Sequence[LayerSpec], num_blocks: int) -> PutBuffer | None:
        """A buffer for a put, or None when the budget has no room for it."""
        size = sum(layer.nbytes for layer in layers) * num_blocks
        with self._lock:
            if self.used + size > self.limit:
                return None
            self.used += size
            mapping = self._take(size)
            dropped = []
            while self.used + self._kept_bytes > self.limit:  # give kept mappings up for this one
                old = self._take(next(iter(self._kept)))  # (used <= limit: some mapping is kept)
                if old is not None:
                    dropped.append(old)
        for old in dropped:
            old.close()
        try:
            return PutBuffer(layers, num_blocks, mapping)
        except (OSError, ValueError):
            self._return(size, None)
            raise

    def release(self, buffer: PutBuffer) -> None:
        """The put is over (stored or not): its bytes go back, its mapping is kept."""
        self._return(buffer.nbytes, buffer.detach())

    def _return(self, size: int, mapping: mmap.mmap | None) -> None:
        with self._lock:
            self.used -= size
            if mapping is not None and self.used + self._kept_bytes + size <= self.limit:
                self._kept.setdefault(size, []).append(mapping)
                self._kept_bytes += size
                mapping = None
        if mapping is not None:
            mapping.close()

    def _take(self, size: int) -> mmap.mmap | None:
        """A kept mapping of `size` bytes, taken out of the pool (under the lock)."""
        group = self._kept.get(size)
        if not group:
            return None
        mapping = group.pop()
        if not group:
            del self._kept[size]
        self._kept_bytes -= size
        return mapping

    def drain(self) -> None:
        """Unmap every kept mapping (the daemon is idle)."""
        with self._lock:
            kept = [m for group in self._kept.values() for m in group]
            self._kept.clear()
            self._kept_bytes = 0
        for mapping in kept:
            mapping.close()

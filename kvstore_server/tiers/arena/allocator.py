"""First-fit allocation of ALIGN-sized pages, coalescing on free: the arena's extents
(MemoryTier) and the persistent tier's segments (tiers.segments) are carved by it."""

from __future__ import annotations

import bisect
from collections.abc import Iterator


class Allocator:
    """Free extents of [start, end), in units of fmt.ALIGN bytes; first fit."""

    def __init__(self, start: int, end: int) -> None:
        self._starts: list[int] = [start]
        self._lengths: dict[int, int] = {start: end - start}
        self.free_bytes = end - start
        self.total = end - start

    def allocate(self, nbytes: int, align: int = 1) -> int | None:
        """The first free run that holds `nbytes` at an offset that is a multiple of `align`."""
        for start in self._starts:
            length = self._lengths[start]
            at = start if align == 1 else -(-start // align) * align
            if length >= nbytes + (at - start):
                if at == start:
                    i = bisect.bisect_left(self._starts, start)
                    del self._starts[i]
                    del self._lengths[start]
                    if length > nbytes:
                        self._starts.insert(i, start + nbytes)
                        self._lengths[start + nbytes] = length - nbytes
                    self.free_bytes -= nbytes
                    return start
                self.claim(at, nbytes)
                return at
        return None

    def claim(self, offset: int, nbytes: int) -> bool:
        """Mark [offset, offset + nbytes) used (recovery); False if any of it is not free."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0:
            return False
        start = self._starts[i]
        length = self._lengths[start]
        if offset + nbytes > start + length:
            return False
        del self._starts[i]
        del self._lengths[start]
        if offset > start:
            self._starts.insert(i, start)
            self._lengths[start] = offset - start
            i += 1
        tail = start + length - (offset + nbytes)
        if tail:
            self._starts.insert(i, offset + nbytes)
            self._lengths[offset + nbytes] = tail
        self.free_bytes -= nbytes
        return True

    def free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._starts, offset)
        end = offset + nbytes
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next
            nbytes += self._lengths.pop(end)
            del self._starts[i]
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == offset:  # merge with the previous
                self._lengths[prev] += nbytes
                self.free_bytes += end - offset
                return
        self._starts.insert(i, offset)
        self._lengths[offset] = nbytes
        self.free_bytes += end - offset

    def runs(self) -> Iterator[tuple[int, int]]:
        """The free runs, as (start, length), in address order."""
        for start in list(self._starts):
            yield start, self._lengths[start]

    @property
    def largest(self) -> int:
        return max(self._lengths.values(), default=0)

"""The client side of the arena: checksums split over threads agree with one thread."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvstore_client import arena


@pytest.mark.parametrize("piece", [4096, 64 << 10, (128 << 10) + 3])
@pytest.mark.parametrize("count", [1, 2, 7, 33])
def test_checksums_match_one_thread_in_order(piece: int, count: int) -> None:
    data = memoryview(os.urandom(piece * count))
    pieces = [data[i * piece : (i + 1) * piece] for i in range(count)]
    assert arena.checksums(pieces) == [xxhash.xxh3_64_intdigest(p) for p in pieces]

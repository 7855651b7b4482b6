"""Block hashes for the tests and benches (the one copy of `chain`)."""

from __future__ import annotations

import hashlib

from kvstore_client.hashing import block_hashes

NS = "integration-ns"  # chain's default namespace: the integration suite's
BLOCK_SIZE = 16


def chain(tag: str, n: int, namespace: str | bytes = NS) -> list[bytes]:
    """n chained block hashes of a deterministic prompt named `tag`."""
    tokens = [
        int.from_bytes(hashlib.sha256(f"{tag}:{i}".encode()).digest()[:4], "little")
        for i in range(n * BLOCK_SIZE)
    ]
    out = block_hashes(namespace, tokens, BLOCK_SIZE)
    assert len(out) == n
    return out

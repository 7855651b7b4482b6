from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore_client import KVStoreClient


@pytest.fixture
def kv(daemon) -> Iterator[KVStoreClient]:
    """A client of the per-test daemon (both backends)."""
    with KVStoreClient(daemon.address, timeout=20.0) as client:
        yield client

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore_client import KVStoreClient


@pytest.fixture
def kv(daemon) -> Iterator[KVStoreClient]:  # noqa: ANN001 - the `daemon` fixture of tests/conftest.py
    """A client of the per-test daemon (both backends)."""
    with KVStoreClient(daemon.address, timeout=20.0) as client:
        yield client

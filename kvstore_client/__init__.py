"""kvstore_client: the Python client of the kvstore daemon.

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes
"""

from kvstore.memory import tune_malloc
from kvstore_client.client import (
    Event,
    EvictResult,
    KVStoreClient,
    LayerSpec,
    LayerStream,
    PutResult,
    PutStream,
    WatchStream,
)
from kvstore_client.errors import KVStoreError

__all__ = [
    "Event",
    "EvictResult",
    "KVStoreClient",
    "KVStoreError",
    "LayerSpec",
    "LayerStream",
    "PutResult",
    "PutStream",
    "WatchStream",
    "tune_malloc",
]

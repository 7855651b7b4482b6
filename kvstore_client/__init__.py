"""kvstore_client: the Python client of the kvstore daemon.

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes
"""

from kvstore.memory import tune_malloc
from kvstore_client.client import KVStoreClient
from kvstore_client.errors import KVStoreError
from kvstore_client.streams import LayerSource, LayerStream, PutStream, WatchStream
from kvstore_client.types import (
    EVENT_REMOVED,
    EVENT_STORED,
    Chain,
    Event,
    EvictResult,
    LayerSpec,
    Lease,
    PutResult,
    Selection,
    Where,
)

__all__ = [
    "EVENT_REMOVED",
    "EVENT_STORED",
    "Chain",
    "Event",
    "EvictResult",
    "KVStoreClient",
    "KVStoreError",
    "LayerSource",
    "LayerSpec",
    "LayerStream",
    "Lease",
    "PutResult",
    "PutStream",
    "Selection",
    "Where",
    "WatchStream",
    "tune_malloc",
]

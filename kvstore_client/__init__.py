"""kvstore_client: the Python client of the kvstore daemon.

    from kvstore_client import KVStoreClient
    from kvstore_client.hashing import block_hashes
"""

from kvstore_client.client import EvictResult, KVStoreClient, LayerSpec, LayerStream, PutResult, PutStream
from kvstore.memory import tune_malloc
from kvstore_client.errors import KVStoreError

__all__ = ["EvictResult", "KVStoreClient", "KVStoreError", "LayerSpec", "LayerStream", "PutResult", "PutStream", "tune_malloc"]

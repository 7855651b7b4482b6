"""kvstore_connector: a vLLM v1 KV connector that keeps KV in the kvstore daemon.

Load it with kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector".
"""

from kvstore_connector.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]

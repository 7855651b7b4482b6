"""kvstore_connector: a vLLM v1 KV connector that keeps KV in the kvstore daemon.

Load it with kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_connector".
The class is imported on first access, so the data-path helpers in
kvstore_connector.transfer import without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore_connector.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from kvstore_connector.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module 'kvstore_connector' has no attribute {name!r}")

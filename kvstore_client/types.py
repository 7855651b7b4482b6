"""The client's result types: what KVStoreClient's calls return.

LayerSpec     one layer's per-block slice (kvstore.blocks, shared with the daemon)
PutResult     what a committed put did (kvstore.blocks)
EvictResult   what an evict removed
Event         one change reported by Watch; kind EVENT_STORED or EVENT_REMOVED
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.blocks import LayerSpec, PutResult

__all__ = ["EVENT_REMOVED", "EVENT_STORED", "Event", "EvictResult", "LayerSpec", "PutResult"]

EVENT_STORED = "stored"
EVENT_REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class EvictResult:
    blocks_evicted: int
    bytes_freed: int
    fleet_objects_removed: int = 0


@dataclass(frozen=True, slots=True)
class Event:
    """One change of the store as Watch reports it: blocks of one namespace stored or removed."""

    sequence: int
    """1, 2, 3, ... in commit order; restarts with every daemon start (see store_id)."""
    kind: str
    """EVENT_STORED ("stored") or EVENT_REMOVED ("removed")."""
    namespace: bytes
    block_hashes: tuple[bytes, ...]
    parent_hashes: tuple[bytes, ...]
    """Stored: each block's parent (b"" where a chain starts). Removed: ()."""
    timestamp: float
    """Unix seconds of the commit."""
    store_id: str
    """Random per daemon start: a new value means the store's picture must be rebuilt."""

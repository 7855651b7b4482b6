"""What the scheduler side tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Load `hashes` from the store into the paged blocks `block_ids` (same length)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Save the paged blocks `block_ids` as `hashes`; `parent_hash` precedes hashes[0] (b"" at the root)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parent_hash: bytes
    token_ids: list[int] = field(default_factory=list)  # the blocks' tokens, for the store's KV events


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

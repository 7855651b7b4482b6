"""What the scheduler side tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore_client import Lease


@dataclass
class LoadSpec:
    """Load `hashes` from the store into the paged blocks `block_ids` (same length).
    `lease`: the scheduler side's lookup pinned exactly these blocks in the memory tier
    (each namespace's pin, for every tensor-parallel rank of it): the load starts on it
    without a Pin of its own, and each rank releases its share (Transport.leased)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    lease: Lease | None = None


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

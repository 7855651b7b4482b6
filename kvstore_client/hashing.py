"""Chained block hashes: the keys of the store.

    h_{-1} = SHA-256("kvstore-root-v1" || namespace)
    h_i    = SHA-256("kvstore-block-v1" || h_{i-1} || block size || tokens of block i
                     || extra keys of block i)

Tokens are encoded as little-endian uint32. Extra keys, each length-prefixed:
multimodal inputs overlapping the block (identifier, placeholder offset and
length), the cache salt (first block only) and the LoRA name (every block).
Only full blocks are hashed.

Everything here is a pure function of its arguments: nothing depends on
PYTHONHASHSEED, the process, the host or vLLM's own prefix-cache hash settings,
so equal prompts give equal keys everywhere and different images never share
one. The connector, the client and `kvstore-cli explain` all use this module.
No torch, no numpy.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.namespaces import ConnectorNamespace, parse_namespace

HASH_BYTES = 32
_ROOT_TAG = b"kvstore-root-v1"
_BLOCK_TAG = b"kvstore-block-v1"


@dataclass(frozen=True, slots=True)
class MultiModalInput:
    """One multimodal item in a prompt: its content identifier and its placeholder tokens.

    `identifier` must identify the content (vLLM's mm_hash / identifier does);
    `offset` is the first placeholder token's position, `length` how many there are.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(
                f"multimodal input needs offset >= 0 and length > 0, got {self.offset}, {self.length}"
            )


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<I", len(value)) + value


def root_hash(namespace: bytes | str) -> bytes:
    ns = namespace.encode() if isinstance(namespace, str) else namespace
    return hashlib.sha256(_field(_ROOT_TAG, ns)).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be in 0..2**32-1") from exc
    if arr.itemsize != 4:  # pragma: no cover - platforms where C int is not 32-bit
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def block_hashes(
    namespace: bytes | str,
    token_ids: Sequence[int],
    block_size: int,
    *,
    mm_inputs: Sequence[MultiModalInput] = (),
    cache_salt: str | None = None,
    lora_name: str | None = None,
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`.

    `parent` and `start_block` continue a chain: pass the hash of block
    `start_block - 1` and the tokens from block `start_block` on, and get the
    same hashes as hashing the whole prompt. Called once per request by the
    connector's scheduler side; cost is one SHA-256 per block.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = _token_bytes(token_ids)
    prev = parent if parent is not None else root_hash(namespace)
    if len(prev) != HASH_BYTES:
        raise ValueError("parent must be a 32-byte block hash")
    lora = _field(b"lora", lora_name.encode()) if lora_name else b""
    mm = sorted(mm_inputs, key=lambda m: m.offset)
    out = []
    stride = 4 * block_size
    for i in range(len(token_ids) // block_size):
        block = start_block + i
        start, end = block * block_size, (block + 1) * block_size
        extra = [lora]
        if block == 0 and cache_salt:
            extra.append(_field(b"salt", cache_salt.encode()))
        for item in mm:
            if item.offset < end and item.offset + item.length > start:
                extra.append(
                    _field(b"mm", item.identifier.encode()) + struct.pack("<QQ", item.offset, item.length)
                )
        h = hashlib.sha256(_BLOCK_TAG)
        h.update(prev)
        h.update(struct.pack("<I", block_size))
        h.update(tokens[i * stride : (i + 1) * stride])
        for part in extra:
            h.update(part)
        prev = h.digest()
        out.append(prev)
    return out


def _connector_namespace(namespace: bytes) -> ConnectorNamespace | None:
    try:
        return parse_namespace(namespace.decode())
    except (UnicodeDecodeError, ValueError):
        return None


def connector_hash_root(namespace: bytes) -> bytes | None:
    """The chain root of a vLLM-connector namespace (kvstore.namespaces: without its
    compression and rank parts); None for others."""
    parts = _connector_namespace(namespace)
    return parts.root.encode() if parts else None


def connector_block_size(namespace: bytes) -> int | None:
    """The block size (bsN) named in a vLLM-connector namespace; None for others."""
    parts = _connector_namespace(namespace)
    return parts.block_size if parts else None

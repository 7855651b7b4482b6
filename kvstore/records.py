"""Binary block records: one per block in an LMDB index, defined once for the arena's
index (kvstore_server.tiers.arena), the persistent tier's (kvstore_server.tiers.lmdb) and
same-host readers (kvstore.layouts).

A record is a fixed head, the parent hash, then the block's per-layer checksums as
little-endian uint64s (packed, as the Pin answer carries them; parsed, they stay packed:
blocks.PackedSums):

    where     three integers whose meaning is the index's: (extent offset, blocks in the
              extent, position) in the arena; (offset, segment, payload bytes) in the
              persistent tier
    created   float seconds
    kind      the checksums' kind (kvstore.blocks.CHECKSUMS), as a small code
    digest    the layer layout's digest: layouts are stored once, under it, in a second
              database (a model's blocks share one)

JSON per block was the format before: a commit of 512 blocks of 32 layers spent 60 ms
writing it, and with a store layer per KV head every per-layer cost is paid 256 times.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.blocks import WSUM32, XXH3, BlockMeta, LayerSpec, Layout, PackedSums, layout_of

_HEAD = struct.Struct("<QIId B 8s B")
KINDS = (XXH3, WSUM32)  # a checksum kind <-> its code
_SUMS: dict[int, struct.Struct] = {}

Where = tuple[int, int, int]
BAD_RECORD = (struct.error, ValueError, TypeError, KeyError, IndexError)
"""What parsing a record that is not one raises."""


def sums_packer(width: int) -> struct.Struct:
    """The struct packing `width` checksums (cached per width)."""
    packer = _SUMS.get(width)
    if packer is None:
        packer = _SUMS[width] = struct.Struct(f"<{width}Q")
    return packer


def pack_sums(checksums: tuple[int, ...] | PackedSums) -> bytes:
    if isinstance(checksums, PackedSums):
        return checksums.packed
    return sums_packer(len(checksums)).pack(*checksums)


def index_key(namespace: bytes, block_hash: bytes) -> bytes:
    """`len(ns)` (2 bytes, big-endian) || ns || hash: namespaces never mix."""
    return len(namespace).to_bytes(2, "big") + namespace + block_hash


def split_key(key: bytes) -> tuple[bytes, bytes]:
    n = int.from_bytes(key[:2], "big")
    return key[2 : 2 + n], key[2 + n :]


@dataclass(frozen=True, slots=True)
class Record:
    meta: BlockMeta
    where: Where
    sums: bytes  # meta.checksums, packed


def pack(where: Where, meta: BlockMeta, sums: bytes | None = None) -> tuple[bytes, Layout]:
    """The record of `meta` at `where`, and its layout (to store once under its digest)."""
    layout = layout_of(meta.layers)
    head = _HEAD.pack(
        *where, meta.created_at, KINDS.index(meta.checksum_kind), layout.digest, len(meta.parent_hash)
    )
    return head + meta.parent_hash + (sums if sums is not None else pack_sums(meta.checksums)), layout


def parse(key: bytes, raw: bytes | memoryview, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> Record:
    """A record read back; `layouts` maps digests to parsed layouts (Layout.parse).
    Raises struct.error, KeyError (unknown layout), IndexError (unknown kind), ValueError."""
    namespace, block_hash = split_key(key)
    a, b, c, created, kind, digest, parent_len = _HEAD.unpack_from(raw)
    layers = layouts[bytes(digest)]
    at = _HEAD.size + parent_len
    parent = bytes(raw[_HEAD.size : at])
    packed = bytes(raw[at : at + 8 * len(layers)])
    if len(packed) != 8 * len(layers):
        raise ValueError(f"a record with {len(packed)} bytes of checksums for {len(layers)} layers")
    meta = BlockMeta(namespace, block_hash, parent, layers, PackedSums(packed), created, KINDS[kind])
    return Record(meta, (a, b, c), packed)

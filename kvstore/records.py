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
from typing import Any

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


class Record:
    """A record read back (parse). Checked whole at once, `where` and `layers` read then;
    `meta` and `sums` made when first used: they cost a Python object per block and a
    copy of its checksums, and a promotion issues its reads before it needs them (512
    records of 256 layers took 8 ms to make on an H100 host, all before the first read)."""

    __slots__ = ("key", "where", "layers", "_raw", "_head", "_meta")

    def __init__(self, key: bytes, raw: bytes, head: tuple[Any, ...], layers: tuple[LayerSpec, ...]) -> None:
        self.key = key  # the index key (index_key)
        self.where: Where = (head[0], head[1], head[2])
        self.layers = layers
        self._raw = raw
        self._head = head
        self._meta: BlockMeta | None = None

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        """meta.layers, without making meta."""
        return self.layers

    @property
    def sums(self) -> bytes:
        """meta.checksums, packed."""
        at = _HEAD.size + self._head[6]
        return self._raw[at : at + 8 * len(self.layers)]

    @property
    def meta(self) -> BlockMeta:
        meta = self._meta
        if meta is None:
            namespace, block_hash = split_key(self.key)
            _, _, _, created, kind, _, parent_len = self._head
            parent = self._raw[_HEAD.size : _HEAD.size + parent_len]
            meta = self._meta = BlockMeta(
                namespace, block_hash, parent, self.layers, PackedSums(self.sums), created, KINDS[kind]
            )
        return meta

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return self.key == other.key and self._raw == other._raw

    def __hash__(self) -> int:
        return hash((self.key, self._raw))

    def __repr__(self) -> str:
        return f"Record(key={self.key.hex()}, where={self.where})"


def pack(where: Where, meta: BlockMeta, sums: bytes | None = None) -> tuple[bytes, Layout]:
    """The record of `meta` at `where`, and its layout (to store once under its digest)."""
    layout = layout_of(meta.layers)
    head = _HEAD.pack(
        *where, meta.created_at, KINDS.index(meta.checksum_kind), layout.digest, len(meta.parent_hash)
    )
    return head + meta.parent_hash + (sums if sums is not None else pack_sums(meta.checksums)), layout


def parse(key: bytes, raw: bytes | memoryview, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> Record:
    """A record read back; `layouts` maps digests to parsed layouts (Layout.parse). `raw`
    is copied (a transaction's buffer may go). Raises struct.error, KeyError (unknown
    layout), IndexError (unknown kind), ValueError (too short)."""
    raw = bytes(raw)
    head = _HEAD.unpack_from(raw)
    layers = layouts[bytes(head[5])]
    if head[4] >= len(KINDS):  # now, not when meta is first made
        raise IndexError(f"unknown checksum kind code {head[4]}")
    if len(raw) < _HEAD.size + head[6] + 8 * len(layers):
        raise ValueError(f"a record of {len(raw)} bytes is too short for {len(layers)} layers' checksums")
    return Record(key, raw, head, layers)

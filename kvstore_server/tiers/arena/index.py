"""Committed blocks of the arena and where they lie (`Placed`), kept in a small LMDB
environment beside the arena file (`ArenaIndex`: same filesystem, so it lives and dies
with it). A commit writes its blocks' records in one transaction: after a SIGKILL the
daemon recovers exactly the committed blocks; a reservation that was never committed
has no record, so its bytes are free space, never data.

Records are keyed by a sequence number, in commit order, not by the block's key: a
commit's records go in at the B-tree's right edge, side by side (keyed by block hash,
each landed on its own leaf page, and with 20,000 blocks indexed a commit of 128 took
2-3x as long in LMDB). The block's key is in the record; the index keeps which
sequence number each block has (a dict, rebuilt by scan), for deletes."""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore import arena_format as fmt
from kvstore import records
from kvstore.blocks import Layout
from kvstore_server.tiers.arena.file import ArenaError
from kvstore_server.tiers.base import BlockKey, BlockMeta, LayerSpec

log = logging.getLogger(__name__)

_ID_KEY = b"arena-id"  # in the main database, beside the two named ones
_INDEX_FORMAT = "3"  # another format's records are dropped like another arena's
_SEQ = struct.Struct(">Q")  # a record's LMDB key: big-endian, so LMDB's order is commit order
_KEY_LEN = struct.Struct("<H")  # a record's value: the block's index key, length first, then the record
_INDEX_MAP_BYTES = 1 << 30  # sparse: address space, not memory


@dataclass(frozen=True, slots=True)
class Placed:
    """A committed block in the arena: its metadata and where its extent is. `sums`: its
    checksums packed as a Pin sends them (little-endian uint64s, made from the metadata
    when not given): a Pin of 512 blocks of 256 store layers spent 77% of its time
    turning 131,072 ints into bytes."""

    meta: BlockMeta
    extent: int
    extent_blocks: int
    position: int
    sums: bytes = b""

    def __post_init__(self) -> None:
        if len(self.sums) != 8 * len(self.meta.checksums):
            if self.sums:
                raise ValueError(f"{len(self.sums)} bytes of checksums for {len(self.meta.checksums)} layers")
            object.__setattr__(self, "sums", records.pack_sums(self.meta.checksums))

    def layer_offset(self, layer: int) -> int:
        sizes = [spec.nbytes for spec in self.meta.layers]
        return self.extent + fmt.block_layer_offset(sizes, self.extent_blocks, layer, self.position)

    def layer_offsets(self) -> list[int]:
        """Where each layer of the block lies in the arena (one pass over the layers)."""
        sizes = [spec.nbytes for spec in self.meta.layers]
        return [self.extent + at for at in fmt.block_offsets(sizes, self.extent_blocks, self.position)]


class ArenaIndex:
    """Committed blocks' records, in an LMDB environment beside the arena file: named
    databases `blocks` (key: a sequence number; value: the block's index key, then its
    record) and `layouts`. Safe to use from several threads."""

    def __init__(self, path: Path, arena_id: str) -> None:
        self._lock = threading.Lock()  # one write at a time, with the maps below
        self._seq: dict[BlockKey, bytes] = {}  # each indexed block's LMDB key
        self._next = 0
        self._stored_layouts: set[bytes] = set()
        marker = f"{arena_id}/{_INDEX_FORMAT}".encode()
        try:
            env = self._open(path)
            with env.begin() as txn:
                current = txn.get(_ID_KEY) == marker
            if not current:  # another arena's records, or another format: start empty
                env.close()
                shutil.rmtree(path)
                env = self._open(path)
            self._env = env
            self._blocks = env.open_db(b"blocks")
            self._layouts = env.open_db(b"layouts")
            with env.begin(write=True) as txn:
                txn.put(_ID_KEY, marker)
        except (lmdb.Error, OSError) as exc:
            raise ArenaError(f"cannot open the memory tier's index {path}: {exc}") from exc
        self.path = path

    @staticmethod
    def _open(path: Path) -> lmdb.Environment:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        return lmdb.open(
            str(path), map_size=_INDEX_MAP_BYTES, sync=False, metasync=False, max_dbs=2, readahead=False
        )

    def scan(self) -> Iterator[Placed]:
        """Every record, in commit order (once, at start, before any put or delete: it
        rebuilds the sequence map)."""
        with self._env.begin(buffers=True) as txn:
            layouts = {}
            for digest, record in txn.cursor(db=self._layouts):
                try:
                    layouts[bytes(digest)] = Layout.parse(record)
                except (ValueError, TypeError) as exc:
                    log.warning("skipping an unreadable memory-tier layout: %s", exc)
            self._stored_layouts.update(layouts)
            for at, raw in txn.cursor(db=self._blocks):  # in key order: the last is the newest
                seq = bytes(at)
                self._next = _SEQ.unpack(seq)[0] + 1
                try:
                    placed = self._parse(raw, layouts)
                except (struct.error, ValueError, KeyError, IndexError) as exc:
                    log.warning("skipping an unreadable memory-tier record: %s", exc)
                    continue
                self._seq[placed.meta.key] = seq
                yield placed

    @staticmethod
    def _parse(raw: memoryview, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> Placed:
        (n,) = _KEY_LEN.unpack_from(raw)
        at = _KEY_LEN.size + n
        record = records.parse(bytes(raw[_KEY_LEN.size : at]), raw[at:], layouts)
        extent, count, position = record.where
        return Placed(record.meta, extent, count, position, record.sums)

    def put(self, blocks: Sequence[Placed]) -> None:
        """Index `blocks` (a block indexed already gets its new record)."""
        if not blocks:
            return
        rows, layouts = [], {}
        for p in blocks:
            raw, layout = records.pack((p.extent, p.extent_blocks, p.position), p.meta, p.sums)
            if layout.digest not in self._stored_layouts:
                layouts[layout.digest] = layout.record
            index_key = records.index_key(*p.meta.key)
            rows.append((p.meta.key, _KEY_LEN.pack(len(index_key)) + index_key + raw))
        with self._lock:
            first = self._next
            items = [(_SEQ.pack(first + i), value) for i, (_, value) in enumerate(rows)]
            try:
                with self._env.begin(write=True) as txn:
                    for digest, record in layouts.items():
                        txn.put(digest, record, db=self._layouts)
                    for key, _ in rows:  # a block indexed already: its old record goes
                        old = self._seq.get(key)
                        if old is not None:
                            txn.delete(old, db=self._blocks)
                    # above every key in the tree: appended at its right edge
                    txn.cursor(db=self._blocks).putmulti(items, append=True)
            except lmdb.Error as exc:
                raise ArenaError(f"memory tier index commit failed: {exc}") from exc
            self._next = first + len(items)
            self._stored_layouts.update(layouts)
            for (key, _), (seq, _) in zip(rows, items, strict=True):
                self._seq[key] = seq

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Drop the records of `keys` (those not indexed are skipped)."""
        with self._lock:
            gone = [(key, seq) for key in keys if (seq := self._seq.get(key)) is not None]
            if not gone:
                return
            try:
                with self._env.begin(write=True) as txn:
                    for _, seq in sorted(gone, key=lambda ks: ks[1]):
                        txn.delete(seq, db=self._blocks)
            except lmdb.Error as exc:
                raise ArenaError(f"memory tier index delete failed: {exc}") from exc
            for key, _ in gone:
                del self._seq[key]

    def close(self) -> None:
        self._env.close()

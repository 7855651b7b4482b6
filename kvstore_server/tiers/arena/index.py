"""Committed blocks of the arena and where they lie (`Placed`), kept in a small LMDB
environment beside the arena file (`ArenaIndex`: same filesystem, so it lives and dies
with it). A commit writes its blocks' records in one transaction: after a SIGKILL the
daemon recovers exactly the committed blocks; a reservation that was never committed
has no record, so its bytes are free space, never data.

A put writes one record per run of blocks of one namespace and layout (a commit's
blocks: one run), keyed by a sequence number, in commit order: runs go in at the
B-tree's right edge. A block's record per block was the format before: a commit of 128
blocks of 256 store layers spent 1.6 ms of its 2.4 (on the 2-core VM) making 128
records of 2 KiB and writing them, each an overflow page of its own; as one record it
is one copy of the checksums. A block deleted from a run that keeps others is marked in
the run's bitmap of dead blocks (a second database, keyed like the runs); a run whose
blocks are all dead goes. The index keeps which run and slot each block has (a dict,
rebuilt by scan), for deletes. Records of the format before (one per block) are read
as runs of one."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import msgspec

from kvstore import arena_format as fmt
from kvstore import records
from kvstore.blocks import BlockMeta, LayerSpec, Layout, PackedSums, layout_of
from kvstore_server.tiers.arena.file import ArenaError
from kvstore_server.tiers.base import BlockKey

log = logging.getLogger(__name__)

_ID_KEY = b"arena-id"  # in the main database, beside the named ones
_INDEX_FORMAT = "4"  # another format's records are dropped like another arena's
_READS = ("3", "4")  # formats whose records this one reads (3: a record per block)
_SEQ = struct.Struct(">Q")  # a record's LMDB key: big-endian, so LMDB's order is commit order
_KEY_LEN = struct.Struct("<H")  # format 3's value: the block's index key, length first, then the record
_INDEX_MAP_BYTES = 1 << 30  # sparse: address space, not memory
# A run's value: the mark (no index key of format 3 is this long), the head, the
# namespace, an entry per block (then its hash and parent), then every block's checksums.
_RUN_MARK = b"\xff\xff"
_RUN_HEAD = struct.Struct("<IIH8s")  # blocks, layers (checksums a block), namespace length, layout digest
_ENTRY = struct.Struct("<QIIdBBB")  # extent, extent_blocks, position, created, kind, hash and parent lengths


class Placed(msgspec.Struct, frozen=True, gc=False):  # type: ignore[call-arg]
    """A committed block in the arena: its metadata and where its extent is. `sums`: its
    checksums packed as a Pin sends them (little-endian uint64s, made from the metadata
    when not given): a Pin of 512 blocks of 256 store layers spent 77% of its time
    turning 131,072 ints into bytes. A msgspec Struct, as BlockMeta is (made per block)."""

    meta: BlockMeta
    extent: int
    extent_blocks: int
    position: int
    sums: bytes = b""

    def __post_init__(self) -> None:
        if len(self.sums) != 8 * len(self.meta.checksums):
            if self.sums:
                raise ValueError(f"{len(self.sums)} bytes of checksums for {len(self.meta.checksums)} layers")
            msgspec.structs.force_setattr(self, "sums", records.pack_sums(self.meta.checksums))

    def layer_offset(self, layer: int) -> int:
        sizes = [spec.nbytes for spec in self.meta.layers]
        return self.extent + fmt.block_layer_offset(sizes, self.extent_blocks, layer, self.position)

    def layer_offsets(self) -> list[int]:
        """Where each layer of the block lies in the arena (one pass over the layers)."""
        sizes = [spec.nbytes for spec in self.meta.layers]
        return [self.extent + at for at in fmt.block_offsets(sizes, self.extent_blocks, self.position)]


def _pack_run(run: Sequence[Placed], layout: Layout) -> bytes:
    """One record for `run` (blocks of one namespace and layout)."""
    first = run[0].meta
    parts = [_RUN_MARK, _RUN_HEAD.pack(len(run), len(first.layers), len(first.namespace), layout.digest),
             first.namespace]  # fmt: skip
    kinds = records.KINDS
    for p in run:
        meta = p.meta
        kind = kinds.index(meta.checksum_kind)
        where = (p.extent, p.extent_blocks, p.position, meta.created_at, kind)
        parts += (
            _ENTRY.pack(*where, len(meta.block_hash), len(meta.parent_hash)),
            meta.block_hash,
            meta.parent_hash,
        )
    parts.extend(p.sums for p in run)
    return b"".join(parts)


def _parse_run(raw: bytes, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> list[Placed]:
    """A run's blocks, in slot order. Raises struct.error, KeyError (unknown layout),
    IndexError (unknown kind), ValueError (the record is cut short)."""
    count, width, ns_len, digest = _RUN_HEAD.unpack_from(raw, len(_RUN_MARK))
    layers = layouts[digest]
    if len(layers) != width:
        raise ValueError(f"a run of {width} checksums a block has a layout of {len(layers)} layers")
    at = len(_RUN_MARK) + _RUN_HEAD.size
    namespace, at = raw[at : at + ns_len], at + ns_len
    heads = []
    for _ in range(count):
        extent, extent_blocks, position, created, kind, hash_len, parent_len = _ENTRY.unpack_from(raw, at)
        at += _ENTRY.size
        block_hash, parent = raw[at : at + hash_len], raw[at + hash_len : at + hash_len + parent_len]
        at += hash_len + parent_len
        heads.append((extent, extent_blocks, position, created, records.KINDS[kind], block_hash, parent))
    step = 8 * width
    if len(raw) != at + count * step:
        raise ValueError(
            f"a run of {count} blocks of {width} checksums is {len(raw)} bytes, not {at + count * step}"
        )
    placed = []
    for i, (extent, extent_blocks, position, created, kind, block_hash, parent) in enumerate(heads):
        sums = raw[at + i * step : at + (i + 1) * step]
        meta = BlockMeta(namespace, block_hash, parent, layers, PackedSums(sums), created, kind)
        placed.append(Placed(meta, extent, extent_blocks, position, sums))
    return placed


def _parse_block(raw: bytes, layouts: dict[bytes, tuple[LayerSpec, ...]]) -> Placed:
    """Format 3's record of one block."""
    (n,) = _KEY_LEN.unpack_from(raw)
    at = _KEY_LEN.size + n
    record = records.parse(raw[_KEY_LEN.size : at], raw[at:], layouts)
    extent, count, position = record.where
    return Placed(record.meta, extent, count, position, record.sums)


def _no_dead(count: int) -> bytearray:
    """The bitmap of dead slots of a run of `count` blocks, none dead."""
    return bytearray(-(-count // 8))


def _is_dead(bits: bytearray, slot: int) -> bool:
    return bool(bits[slot >> 3] & (1 << (slot & 7)))


def _runs(blocks: Sequence[Placed]) -> list[Sequence[Placed]]:
    """`blocks` cut where the namespace or the layout changes (layouts are interned)."""
    cuts = [i for i in range(1, len(blocks))
            if blocks[i].meta.layers is not blocks[i - 1].meta.layers
            or blocks[i].meta.namespace != blocks[i - 1].meta.namespace]  # fmt: skip
    bounds = [0, *cuts, len(blocks)]
    return [blocks[a:b] for a, b in itertools.pairwise(bounds)]


class ArenaIndex:
    """Committed blocks' records, in an LMDB environment beside the arena file: named
    databases `blocks` (key: a sequence number; value: a run's record), `dead` (a run's
    bitmap of deleted slots, where it has some) and `layouts`. Safe to use from several
    threads."""

    def __init__(self, path: Path, arena_id: str) -> None:
        self._lock = threading.Lock()  # one write at a time, with the maps below
        self._at: dict[BlockKey, tuple[bytes, int]] = {}  # each indexed block's run and slot
        self._runs: dict[bytes, tuple[bytearray, int]] = {}  # each run's bitmap of dead slots, live blocks
        self._next = 0
        self._stored_layouts: set[bytes] = set()
        marker = f"{arena_id}/{_INDEX_FORMAT}".encode()
        readable = {f"{arena_id}/{v}".encode() for v in _READS}
        try:
            env = self._open(path)
            with env.begin() as txn:
                current = txn.get(_ID_KEY) in readable
            if not current:  # another arena's records, or a format this one cannot read: start empty
                env.close()
                shutil.rmtree(path)
                env = self._open(path)
            self._env = env
            self._blocks = env.open_db(b"blocks")
            self._dead_db = env.open_db(b"dead")
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
            str(path), map_size=_INDEX_MAP_BYTES, sync=False, metasync=False, max_dbs=3, readahead=False
        )

    def scan(self) -> Iterator[Placed]:
        """Every live block, in commit order (once, at start, before any put or delete: it
        rebuilds the maps of runs)."""
        with self._env.begin(buffers=True) as txn:
            layouts = {}
            for digest, record in txn.cursor(db=self._layouts):
                try:
                    layouts[bytes(digest)] = Layout.parse(record)
                except (ValueError, TypeError) as exc:
                    log.warning("skipping an unreadable memory-tier layout: %s", exc)
            self._stored_layouts.update(layouts)
            dead = {bytes(seq): bytearray(bits) for seq, bits in txn.cursor(db=self._dead_db)}
            for at, value in txn.cursor(db=self._blocks):  # in key order: the last is the newest
                seq, raw = bytes(at), bytes(value)
                self._next = _SEQ.unpack(seq)[0] + 1
                try:
                    run = _parse_run(raw, layouts) if raw[:2] == _RUN_MARK else [_parse_block(raw, layouts)]
                except (*records.BAD_RECORD, ValueError) as exc:
                    log.warning("skipping an unreadable memory-tier record: %s", exc)
                    continue
                bits = dead.get(seq) or _no_dead(len(run))
                live = [(slot, p) for slot, p in enumerate(run) if not _is_dead(bits, slot)]
                self._runs[seq] = bits, len(live)
                for slot, placed in live:
                    self._at[placed.meta.key] = (seq, slot)
                    yield placed

    def put(self, blocks: Sequence[Placed]) -> None:
        """Index `blocks` (a block indexed already gets its new record)."""
        if not blocks:
            return
        by_key = {p.meta.key: p for p in blocks}  # a block twice: its last stays
        blocks = list(by_key.values())
        runs, layouts = [], {}
        for run in _runs(blocks):
            layout = layout_of(run[0].meta.layers)
            if layout.digest not in self._stored_layouts:
                layouts[layout.digest] = layout.record
            runs.append((run, _pack_run(run, layout)))
        with self._lock:
            seqs = [_SEQ.pack(self._next + i) for i in range(len(runs))]
            # a block indexed already: its old slot dies
            old = [at for key in by_key if (at := self._at.get(key)) is not None]
            try:
                with self._env.begin(write=True) as txn:
                    for digest, record in layouts.items():
                        txn.put(digest, record, db=self._layouts)
                    # above every key in the tree: appended at its right edge
                    txn.cursor(db=self._blocks).putmulti(
                        [(seq, value) for seq, (_, value) in zip(seqs, runs, strict=True)], append=True
                    )
                    killed = self._kill(txn, old)
            except lmdb.Error as exc:
                raise ArenaError(f"memory tier index commit failed: {exc}") from exc
            self._apply(killed)
            self._next += len(runs)
            self._stored_layouts.update(layouts)
            for seq, (run, _) in zip(seqs, runs, strict=True):
                self._runs[seq] = _no_dead(len(run)), len(run)
                self._at.update((p.meta.key, (seq, slot)) for slot, p in enumerate(run))

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Drop the records of `keys` (those not indexed are skipped)."""
        with self._lock:
            gone = [(key, at) for key in keys if (at := self._at.get(key)) is not None]
            if not gone:
                return
            try:
                with self._env.begin(write=True) as txn:
                    killed = self._kill(txn, [at for _, at in gone])
            except lmdb.Error as exc:
                raise ArenaError(f"memory tier index delete failed: {exc}") from exc
            self._apply(killed)
            for key, _ in gone:
                del self._at[key]

    def _kill(
        self, txn: lmdb.Transaction, slots: Sequence[tuple[bytes, int]]
    ) -> dict[bytes, tuple[bytearray, int]]:
        """Mark `slots` dead in `txn`: a run left with none live goes, another gets its new
        bitmap. Returns each run's new bitmap and live count, for _apply once `txn` is in."""
        changed: dict[bytes, tuple[bytearray, int]] = {}
        for seq, slot in sorted(set(slots)):
            bits, live = changed.get(seq) or (bytearray(self._runs[seq][0]), self._runs[seq][1])
            if not _is_dead(bits, slot):
                bits[slot >> 3] |= 1 << (slot & 7)
                live -= 1
            changed[seq] = bits, live
        for seq, (bits, live) in changed.items():
            if live:
                txn.put(seq, bytes(bits), db=self._dead_db)
            else:
                txn.delete(seq, db=self._blocks)
                txn.delete(seq, db=self._dead_db)
        return changed

    def _apply(self, changed: dict[bytes, tuple[bytearray, int]]) -> None:
        for seq, run in changed.items():
            if run[1]:
                self._runs[seq] = run
            else:
                del self._runs[seq]

    def close(self) -> None:
        self._env.close()

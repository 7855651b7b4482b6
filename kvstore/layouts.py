"""The data directory's on-disk layouts, defined once: the daemon writes them, same-host
clients read them (kvstore_client.local) without importing the daemon.

    <data_dir>/STORE_ID                  this daemon run's id (STORE_ID_FILE)
    <data_dir>/lmdb/                     the LMDB backend's index: databases BLOCKS_DB
                                         (lmdb_key(namespace, hash) -> a binary record,
                                         kvstore.records) and LAYOUTS_DB (digest -> layout)
    <data_dir>/lmdb/segments/seg-XXXXXXXX
                                         its payloads: a block's layers back to back, in one
                                         extent of a segment file (the record says where)
    <data_dir>/blocks/<ns>/<hh>/<hash>.safetensors
                                         the disk backend: one safetensors file per block
                                         (block_path, block_file_header, parse_block_file)

Paths are derived from hex digests only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
from io import BufferedReader
from pathlib import Path
from typing import Any, Final

from kvstore import records
from kvstore.blocks import BlockKey, BlockMeta, LayerSpec, Layout, StorageError, StoredBlock
from kvstore.wire import DTYPES

log = logging.getLogger(__name__)

STORE_ID_FILE: Final = "STORE_ID"
"""Holds the running daemon's store_id (see LocalAccess); gone when it stopped."""

# Each backend's directory under the data dir.
BACKEND_DIRS: Final = {"lmdb": "lmdb", "disk": "blocks"}
BACKENDS: Final = tuple(BACKEND_DIRS)


def backend_dir(kind: str, data_dir: Path) -> Path:
    """Where backend `kind` keeps its files under `data_dir`. Raises ValueError for an unknown kind."""
    if kind not in BACKEND_DIRS:
        raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")
    return data_dir / BACKEND_DIRS[kind]


# ---- LMDB: the index (records and layouts) in one environment; payloads in segments
BLOCKS_DB: Final = b"blocks"
LAYOUTS_DB: Final = b"layouts"
LMDB_MAX_DBS: Final = 2
FORMAT_KEY: Final = b"format"
"""In the main database: LMDB_FORMAT (an environment without it is of an older layout)."""
LMDB_FORMAT: Final = b"segments-1"
SEGMENTS_DIR: Final = "segments"
# Same-host clients take reader slots too: one per read in flight.
LMDB_MAX_READERS: Final = 1024

lmdb_key = records.index_key


def split_layers(data: memoryview, meta: BlockMeta) -> list[memoryview] | None:
    """A stored payload's per-layer views; None when its size does not match the record."""
    views = []
    offset = 0
    for layer in meta.layers:
        views.append(data[offset : offset + layer.nbytes])
        offset += layer.nbytes
    return views if offset == len(data) else None


def segment_path(root: Path, segment: int) -> Path:
    """Segment file `segment` of the LMDB backend rooted at `root`."""
    return root / SEGMENTS_DIR / f"seg-{segment:08x}"


class SegmentFiles:
    """The LMDB backend's segment files, opened read-only as they are first read, for a
    same-host reader. Reads copy (pread), never map: a file cut short under a mapping
    would be a SIGBUS in the reader's process (a vLLM engine); a short read is a miss.
    The daemon may reuse a freed extent while another process reads it: every reader
    verifies checksums, so that is a failed check, never wrong bytes used."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fds: dict[int, int] = {}

    def read(self, segment: int, offset: int, nbytes: int) -> memoryview | None:
        fd = self._fds.get(segment)
        if fd is None:
            try:
                fd = self._fds[segment] = os.open(segment_path(self.root, segment), os.O_RDONLY)
            except OSError as exc:
                log.warning("cannot open segment %d of %s: %s", segment, self.root, exc)
                return None
        data = bytearray(nbytes)
        view = memoryview(data)
        done = 0
        try:
            while done < nbytes:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    return None
                done += got
        except OSError as exc:
            log.warning("cannot read segment %d of %s: %s", segment, self.root, exc)
            return None
        return view

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# ---- disk: one safetensors file per block (readable by the `safetensors` library as-is),
# one tensor per layer, the block's record under __metadata__["kvstore"]
BLOCK_SUFFIX: Final = ".safetensors"
TMP_SUFFIX: Final = ".tmp"
"""A write in progress: written under a temporary name ending so, renamed into place."""


def block_path(root: Path, namespace: bytes, block_hash: bytes) -> Path:
    """`<root>/<sha256(ns) hex, 32 digits>/<hash hex, 2 digits>/<hash hex>.safetensors`."""
    ns_dir = hashlib.sha256(namespace).hexdigest()[:32]
    name = block_hash.hex()
    return root / ns_dir / name[:2] / (name + BLOCK_SUFFIX)


def block_file_header(meta: BlockMeta) -> bytes:
    """The safetensors header of a block file; the layers' bytes follow it in order."""
    doc: dict[str, object] = {"__metadata__": {"kvstore": meta.to_json().decode()}}
    offset = 0
    for layer in meta.layers:
        doc[layer.name] = {
            "dtype": DTYPES[layer.dtype][1],
            "shape": list(layer.shape),
            "data_offsets": [offset, offset + layer.nbytes],
        }
        offset += layer.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw


def map_file(f: BufferedReader) -> mmap.mmap | bytearray:
    """A block file's bytes: mapped read-only (page cache, which the kernel may reclaim;
    a read of many blocks does not copy them all into this process), or read into
    memory where it cannot be mapped (no address space or map slots left)."""
    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file
        log.debug("cannot map %s (%s); reading it", f.name, exc)
    buf = bytearray(os.fstat(f.fileno()).st_size)
    f.readinto(buf)
    return buf


def parse_block_file(buf: mmap.mmap | bytearray) -> tuple[BlockMeta, list[memoryview]]:
    """A block file's record and per-layer views into `buf`.
    Raises ValueError, KeyError, TypeError or StorageError for a file that is not one."""
    size = int.from_bytes(buf[:8], "little")
    if size > len(buf) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(bytes(buf[8 : 8 + size]))
    meta = BlockMeta.from_json(header["__metadata__"]["kvstore"])
    data = memoryview(buf)[8 + size :]
    views = []
    for layer in meta.layers:
        start, end = header[layer.name]["data_offsets"]
        if end - start != layer.nbytes or end > len(data):
            raise ValueError(f"layer {layer.name!r} does not match its metadata")
        views.append(data[start:end])
    return meta, views


# What a stored record that cannot be parsed raises (it is skipped, never served).
BAD_RECORD = (ValueError, KeyError, TypeError, StorageError)


def read_lmdb_record(
    txn: Any, blocks_db: Any, layouts_db: Any, key: BlockKey, layouts: LayoutReader | None = None
) -> records.Record | None:
    """A block's record in an open read transaction of the LMDB index; None when absent
    or unreadable (logged). `layouts`: a LayoutReader of `txn`, kept by a caller that
    reads many. lmdb.Error propagates to the caller, which owns the transaction."""
    raw_key = lmdb_key(*key)
    raw = txn.get(raw_key, db=blocks_db)
    if raw is None:
        return None
    try:
        return records.parse(raw_key, raw, layouts if layouts is not None else LayoutReader(txn, layouts_db))
    except (*BAD_RECORD, *records.BAD_RECORD) as exc:
        log.warning("unreadable record of block %s: %s", key[1].hex(), exc)
        return None


def read_lmdb_block(
    txn: Any, blocks_db: Any, layouts_db: Any, files: SegmentFiles, key: BlockKey
) -> StoredBlock | None:
    """One block: its record from the index and its payload read from the segment files.
    None when absent or unreadable (logged)."""
    record = read_lmdb_record(txn, blocks_db, layouts_db, key)
    if record is None:
        return None
    offset, segment, nbytes = record.where
    data = files.read(segment, offset, nbytes)
    views = split_layers(data, record.meta) if data is not None else None
    if views is None:
        log.warning("block %s: its extent does not match its record", key[1].hex())
        return None
    return StoredBlock(record.meta, views)


class LayoutReader(dict[bytes, tuple[LayerSpec, ...]]):
    """Layouts looked up in the index as records name them (cached process-wide)."""

    def __init__(self, txn: Any, layouts_db: Any) -> None:
        super().__init__()
        self._txn = txn
        self._db = layouts_db

    def __missing__(self, digest: bytes) -> tuple[LayerSpec, ...]:
        found = _LAYOUT_CACHE.get(digest)
        if found is None:
            raw = self._txn.get(digest, db=self._db)
            if raw is None:
                raise KeyError(f"unknown layout {digest.hex()}")
            if len(_LAYOUT_CACHE) > 256:
                _LAYOUT_CACHE.clear()
            found = _LAYOUT_CACHE[digest] = Layout.parse(raw)
        self[digest] = found  # the next record of this layout: a plain dict hit
        return found


_LAYOUT_CACHE: dict[bytes, tuple[LayerSpec, ...]] = {}


def read_block_file(root: Path, key: BlockKey) -> StoredBlock | None:
    """One block file of the disk backend, mapped (the views keep the mapping alive).
    None when absent, unreadable or holding another block (logged)."""
    path = block_path(root, *key)
    try:
        with open(path, "rb") as f:
            buf = map_file(f)
        meta, views = parse_block_file(buf)
    except FileNotFoundError:
        return None
    except (OSError, *BAD_RECORD) as exc:
        log.warning("unreadable block file %s: %s", path, exc)
        return None
    if meta.key != key:
        log.warning("block file %s holds another block", path)
        return None
    return StoredBlock(meta, views)

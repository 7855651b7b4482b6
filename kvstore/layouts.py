"""The data directory's on-disk layouts, defined once: the daemon writes them, same-host
clients read them (kvstore_client.local) without importing the daemon.

    <data_dir>/STORE_ID                  this daemon run's id (STORE_ID_FILE)
    <data_dir>/lmdb/                     the LMDB backend: databases META_DB and DATA_DB,
                                         both keyed by lmdb_key(namespace, hash); a block's
                                         data is its layers back to back (split_layers)
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

from kvstore.blocks import BlockKey, BlockMeta, StorageError, StoredBlock
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


# ---- LMDB: two named databases in one environment, so a block's record and bytes
# commit in one transaction
META_DB: Final = b"meta"
DATA_DB: Final = b"data"
LMDB_MAX_DBS: Final = 2
# Same-host clients take reader slots too: one per read in flight.
LMDB_MAX_READERS: Final = 1024


def lmdb_key(namespace: bytes, block_hash: bytes) -> bytes:
    """`len(ns)` (2 bytes, big-endian) || ns || hash."""
    return len(namespace).to_bytes(2, "big") + namespace + block_hash


def split_layers(data: memoryview, meta: BlockMeta) -> list[memoryview] | None:
    """A stored value's per-layer views; None when its size does not match the record."""
    views = []
    offset = 0
    for layer in meta.layers:
        views.append(data[offset : offset + layer.nbytes])
        offset += layer.nbytes
    return views if offset == len(data) else None


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


def read_lmdb_block(txn: Any, meta_db: Any, data_db: Any, key: BlockKey) -> StoredBlock | None:
    """One block in an open LMDB read transaction (buffers=True): its views point into
    the map until the transaction ends. None when absent or unreadable (logged);
    lmdb.Error propagates to the caller, which owns the transaction."""
    raw_key = lmdb_key(*key)
    raw_meta = txn.get(raw_key, db=meta_db)
    data = txn.get(raw_key, db=data_db)
    if raw_meta is None or data is None:
        return None
    try:
        meta = BlockMeta.from_json(raw_meta)
    except BAD_RECORD as exc:
        log.warning("unreadable metadata for block %s: %s", key[1].hex(), exc)
        return None
    views = split_layers(data, meta)
    if views is None:
        log.warning("block %s: stored size does not match its metadata", key[1].hex())
        return None
    return StoredBlock(meta, views)


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

"""Storage backends behind one small interface (see base.py)."""

from __future__ import annotations

from pathlib import Path

from kvstore.layouts import BACKEND_DIRS, BACKENDS, backend_dir
from kvstore_server.tiers.base import (
    NO_SPACE,
    Backend,
    BlockKey,
    BlockMeta,
    BlockWrite,
    LayerSpec,
    StorageError,
    StorageFullError,
    StoredBlock,
    checksum,
)

__all__ = [
    "NO_SPACE",
    "BACKENDS",
    "BACKEND_DIRS",
    "Backend",
    "BlockKey",
    "BlockMeta",
    "BlockWrite",
    "LayerSpec",
    "StorageError",
    "StorageFullError",
    "StoredBlock",
    "checksum",
    "backend_dir",
    "open_backend",
]


def open_backend(kind: str, data_dir: Path, *, capacity_bytes: int, sync: bool) -> Backend:
    """Open the backend `kind` under `data_dir` (created if missing)."""
    root = backend_dir(kind, data_dir)
    if kind == "lmdb":
        from kvstore_server.tiers.lmdb import LmdbBackend

        return LmdbBackend(root, capacity_bytes=capacity_bytes, sync=sync)
    from kvstore_server.tiers.disk import DiskBackend

    return DiskBackend(root, sync=sync)

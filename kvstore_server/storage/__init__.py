"""Storage backends behind one small interface (see base.py)."""

from __future__ import annotations

from pathlib import Path

from kvstore_server.storage.base import (
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

BACKENDS = ("lmdb", "disk")

__all__ = [
    "BACKENDS",
    "Backend",
    "BlockKey",
    "BlockMeta",
    "BlockWrite",
    "LayerSpec",
    "StorageError",
    "StorageFullError",
    "StoredBlock",
    "checksum",
    "open_backend",
    "open_reader",
]


def open_backend(kind: str, data_dir: Path, *, capacity_bytes: int, sync: bool) -> Backend:
    """Open the backend `kind` under `data_dir` (created if missing)."""
    if kind == "lmdb":
        from kvstore_server.storage.lmdb_backend import LmdbBackend

        return LmdbBackend(data_dir / "lmdb", capacity_bytes=capacity_bytes, sync=sync)
    if kind == "disk":
        from kvstore_server.storage.disk_backend import DiskBackend

        return DiskBackend(data_dir / "blocks", sync=sync)
    raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")


def open_reader(kind: str, data_dir: Path) -> Backend:
    """Open a running daemon's backend under `data_dir` for reading only (the same-host
    fast path, see kvstore_client.local): `read` works, writes raise StorageError.
    Raises StorageError when the files cannot be opened."""
    if kind == "lmdb":
        from kvstore_server.storage.lmdb_backend import LmdbBackend

        return LmdbBackend.reader(data_dir / "lmdb")
    if kind == "disk":
        from kvstore_server.storage.disk_backend import DiskBackend

        if not (data_dir / "blocks").is_dir():
            raise StorageError(f"{data_dir / 'blocks'} is not a directory")
        return DiskBackend(data_dir / "blocks", sync=False, readonly=True)
    raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")

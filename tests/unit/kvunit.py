"""Small helpers shared by the unit tests (no fixtures; see conftest.py for those)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path

from support.hashes import chain as chain  # re-exported: the unit tests' block hashes

from kvstore_server.tiers import Backend, BlockMeta, BlockWrite, LayerSpec, checksum, open_backend

NS = b"ns-a"
NS2 = b"ns-b"

# Two layers of different dtypes and sizes: 256 + 128 = 384 bytes per block.
LAYERS = (
    LayerSpec("k", "uint8", (256,), 256),
    LayerSpec("v", "float16", (8, 8), 128),
)
BLOCK_BYTES = sum(layer.nbytes for layer in LAYERS)


def h(tag: str | int) -> bytes:
    """A distinct 32-byte block hash for a label."""
    return hashlib.sha256(str(tag).encode()).digest()


def layer_bytes(key: bytes, layer: LayerSpec) -> bytes:
    """Deterministic, block- and layer-specific content (distinct across blocks)."""
    rng = random.Random(key + layer.name.encode())
    return rng.randbytes(layer.nbytes)


def block_data(hashes: Sequence[bytes], layers: Sequence[LayerSpec] = LAYERS) -> list[list[memoryview]]:
    """data[layer][block], as Store.put wants it."""
    return [[memoryview(layer_bytes(bh, layer)) for bh in hashes] for layer in layers]


def make_write(
    namespace: bytes,
    block_hash: bytes,
    parent: bytes = b"",
    layers: Sequence[LayerSpec] = LAYERS,
    created_at: float = 1_700_000_000.5,
) -> BlockWrite:
    datas = [layer_bytes(block_hash, layer) for layer in layers]
    meta = BlockMeta(
        namespace=namespace,
        block_hash=block_hash,
        parent_hash=parent,
        layers=tuple(layers),
        checksums=tuple(checksum(d) for d in datas),
        created_at=created_at,
    )
    return BlockWrite(meta, datas)


def new_backend(kind: str, root: Path, capacity_bytes: int = 64 << 20) -> Backend:
    return open_backend(kind, root, capacity_bytes=capacity_bytes, sync=False)


def flip_byte_in_file(path: Path, needle: bytes) -> int:
    """Flip one bit of the first occurrence of `needle` in `path` (in place); return its offset."""
    raw = path.read_bytes()
    offset = raw.find(needle)
    assert offset >= 0, f"{needle[:8].hex()}... not found in {path}"
    assert raw.find(needle, offset + 1) < 0, "needle is not unique in the file"
    target = offset + len(needle) // 2
    with open(path, "r+b") as f:
        f.seek(target)
        f.write(bytes([raw[target] ^ 0x01]))
    return target


def backend_file_with(kind: str, root: Path, namespace: bytes, block_hash: bytes) -> Path:
    """The file that holds a block's bytes for a backend rooted at `root`."""
    if kind == "lmdb":  # one segment file at these test sizes
        return root / "lmdb" / "segments" / "seg-00000000"
    found = list((root / "blocks").rglob(f"{block_hash.hex()}.safetensors"))
    assert len(found) == 1, found
    return found[0]

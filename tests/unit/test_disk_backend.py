"""DiskBackend specifics: file layout, atomic renames, safetensors compatibility."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kvunit import LAYERS, NS, NS2, chain, h, make_write
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file as torch_load_file

from kvstore.wire import DTYPES
from kvstore_server.tiers import BlockMeta, BlockWrite, LayerSpec, checksum, open_backend
from kvstore_server.tiers.disk import DiskBackend


@pytest.fixture
def disk(tmp_path: Path):
    backend = DiskBackend(tmp_path / "blocks", sync=False)
    yield backend
    backend.close()


def block_path(root: Path, namespace: bytes, block_hash: bytes) -> Path:
    """The documented layout: <root>/<ns digest>/<hh>/<hash>.safetensors."""
    name = block_hash.hex()
    return root / hashlib.sha256(namespace).hexdigest()[:32] / name[:2] / f"{name}.safetensors"


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_open_backend_uses_blocks_dir(tmp_path: Path) -> None:
    backend = open_backend("disk", tmp_path, capacity_bytes=1, sync=True)
    assert backend.name == "disk"
    backend.write([make_write(NS, h(1))])
    assert all_files(tmp_path) == [block_path(tmp_path / "blocks", NS, h(1))]
    backend.close()


def test_file_layout_and_namespace_not_in_path(disk: DiskBackend, tmp_path: Path) -> None:
    namespace = b"../../etc/passwd"
    disk.write([make_write(namespace, h(1)), make_write(NS2, h(1))])
    root = tmp_path / "blocks"
    assert all_files(root) == sorted([block_path(root, namespace, h(1)), block_path(root, NS2, h(1))])
    assert not any(".." in p.relative_to(root).parts for p in all_files(root))
    disk.delete([(namespace, h(1))])
    assert all_files(root) == [block_path(root, NS2, h(1))]


def test_leftover_tmp_files_are_removed_by_scan_and_never_listed(disk: DiskBackend, tmp_path: Path) -> None:
    root = tmp_path / "blocks"
    disk.write([make_write(NS, h(1))])
    real = block_path(root, NS, h(1))
    # what a crash between create and rename leaves behind: a hidden partial file
    partial = real.with_name(f".{block_path(root, NS, h(2)).name}.0badc0de.tmp")
    partial.write_bytes(real.read_bytes()[:100])
    whole_tmp = real.with_name(f".{real.name}.12345678.tmp")
    shutil.copy(real, whole_tmp)  # even a complete-looking temporary file is no block
    stray = root / "README.txt"
    stray.write_text("not a block")
    metas = list(disk.scan())
    assert [m.block_hash for m in metas] == [h(1)]
    assert not partial.exists()
    assert not whole_tmp.exists()
    assert stray.exists(), "files that are neither blocks nor temporaries are left alone"
    with disk.read([(NS, h(2))]) as blocks:
        assert blocks == [None]


def test_writes_leave_no_temporaries(disk: DiskBackend, tmp_path: Path) -> None:
    disk.write([make_write(NS, x) for x in chain("a", 5)])
    disk.write([make_write(NS, x) for x in chain("a", 5)])  # rewrite over existing files
    names = [p.name for p in all_files(tmp_path / "blocks")]
    assert len(names) == 5
    assert all(n.endswith(".safetensors") and not n.startswith(".") for n in names)


def test_unreadable_files_are_skipped(disk: DiskBackend, tmp_path: Path) -> None:
    root = tmp_path / "blocks"
    a = chain("a", 6)
    disk.write([make_write(NS, x) for x in a])
    # header lengths beyond the file: absurd, large, and just one byte too long
    for block_hash, size in ((a[0], 2**64 - 1), (a[1], 2**40), (a[2], None)):
        path = block_path(root, NS, block_hash)
        raw = path.read_bytes()
        if size is None:
            size = len(raw) - 7
        path.write_bytes(size.to_bytes(8, "little") + raw[8:])
    block_path(root, NS, a[3]).write_bytes(b"{}")  # shorter than the length field
    block_path(root, NS, a[4]).write_bytes(b"\x10" + b"\x00" * 7 + b"not json" * 2)
    p5 = block_path(root, NS, a[5])
    p5.write_bytes(p5.read_bytes()[:-10])  # truncated data: the header is intact
    assert [m.block_hash for m in disk.scan()] == [a[5]]
    with disk.read([(NS, x) for x in a]) as blocks:
        assert blocks == [None] * 6


def test_file_holding_another_block_reads_as_missing(disk: DiskBackend, tmp_path: Path) -> None:
    root = tmp_path / "blocks"
    disk.write([make_write(NS, h(1))])
    target = block_path(root, NS, h(2))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(block_path(root, NS, h(1)), target)
    with disk.read([(NS, h(2)), (NS, h(1))]) as blocks:
        assert blocks[0] is None
        assert blocks[1] is not None


def test_header_is_aligned(disk: DiskBackend, tmp_path: Path) -> None:
    for i in range(8):  # different metadata lengths hit every padding amount
        layers = (LayerSpec("x" * (i + 1), "uint8", (3,), 3),)
        disk.write([make_write(NS, h(i), layers=layers)])
        raw = block_path(tmp_path / "blocks", NS, h(i)).read_bytes()
        size = int.from_bytes(raw[:8], "little")
        assert size % 8 == 0
        assert raw[8:9] == b"{"
        assert len(raw) == 8 + size + 3


# ---- files are plain safetensors ---------------------------------------------------
def _torch_layers() -> tuple[dict[str, torch.Tensor], tuple[LayerSpec, ...]]:
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    shapes = [(2, 4, 8), (5,), (3, 3), (1, 2, 3, 4)]
    for i, name in enumerate(DTYPES):
        dtype = getattr(torch, name, None)
        if dtype is None:  # pragma: no cover - an old torch without this dtype
            continue
        shape = shapes[i % len(shapes)]
        raw = torch.randint(
            0, 256, (int(np.prod(shape)) * DTYPES[name][0],), dtype=torch.uint8, generator=gen
        )
        if name == "bool":
            raw = raw % 2
        tensors[f"model.layers.{i}.{name}"] = raw.view(dtype).reshape(shape)
    # deliberately not in name order: the data section follows the layer order
    names = sorted(tensors, reverse=True)
    specs = tuple(
        LayerSpec(n, str(tensors[n].dtype).removeprefix("torch."), tuple(tensors[n].shape), tensors[n].nbytes)
        for n in names
    )
    return {n: tensors[n] for n in names}, specs


def test_files_load_with_safetensors_torch(disk: DiskBackend, tmp_path: Path) -> None:
    tensors, specs = _torch_layers()
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2"} <= {s.dtype for s in specs}
    datas = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values()]
    meta = BlockMeta(NS, h("st"), h("parent"), specs, tuple(checksum(d) for d in datas), 1234.5)
    disk.write([BlockWrite(meta, datas)])
    path = block_path(tmp_path / "blocks", NS, h("st"))

    loaded = torch_load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, want in tensors.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        assert set(metadata) == {"kvstore"}
        assert BlockMeta.from_json(metadata["kvstore"]) == meta
        bf16 = next(n for n, s in zip(tensors, specs, strict=True) if s.dtype == "bfloat16")
        assert f.get_tensor(bf16).dtype == torch.bfloat16
        f8 = next(n for n, s in zip(tensors, specs, strict=True) if s.dtype == "float8_e4m3fn")
        assert f.get_tensor(f8).dtype == torch.float8_e4m3fn

    # and the backend reads back what safetensors sees
    with disk.read([(NS, h("st"))]) as blocks:
        block = blocks[0]
        assert block is not None and block.corrupt_layer() is None
        assert [bytes(v) for v in block.layers] == datas


def test_files_load_with_safetensors_numpy(disk: DiskBackend, tmp_path: Path) -> None:
    arrays = {
        "k": np.arange(24, dtype=np.float16).reshape(2, 3, 4),
        "v": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2),
        "pos": np.array([1, -2, 3], dtype=np.int64),
    }
    dtypes = {"k": "float16", "v": "float32", "pos": "int64"}
    specs = tuple(LayerSpec(n, dtypes[n], a.shape, a.nbytes) for n, a in arrays.items())
    datas = [a.tobytes() for a in arrays.values()]
    disk.write([BlockWrite(BlockMeta(NS, h("np"), b"", specs, tuple(checksum(d) for d in datas)), datas)])
    loaded = np_load_file(str(block_path(tmp_path / "blocks", NS, h("np"))))
    assert set(loaded) == set(arrays)
    for name, want in arrays.items():
        assert loaded[name].dtype == want.dtype
        np.testing.assert_array_equal(loaded[name], want)


def test_header_lists_layers_with_safetensors_dtype_codes(disk: DiskBackend, tmp_path: Path) -> None:
    disk.write([make_write(NS, h(1))])
    raw = block_path(tmp_path / "blocks", NS, h(1)).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["k"] == {"dtype": "U8", "shape": [256], "data_offsets": [0, 256]}
    assert header["v"] == {"dtype": "F16", "shape": [8, 8], "data_offsets": [256, 384]}
    assert BlockMeta.from_json(header["__metadata__"]["kvstore"]).layers == LAYERS


def test_sync_mode_writes_the_same_files(tmp_path: Path) -> None:
    plain = DiskBackend(tmp_path / "plain", sync=False)
    synced = DiskBackend(tmp_path / "synced", sync=True)
    plain.write([make_write(NS, h(1))])
    synced.write([make_write(NS, h(1))])
    rel = block_path(Path(""), NS, h(1))
    assert (tmp_path / "plain" / rel).read_bytes() == (tmp_path / "synced" / rel).read_bytes()
    assert os.listdir(tmp_path / "synced") == os.listdir(tmp_path / "plain")


def test_locate_and_read_into_fill_scattered_buffers_from_the_pool(disk: DiskBackend, tmp_path: Path) -> None:
    """The disk backend reaches the memory tier by the same I/O as the LMDB one: located
    files read with preadv into the caller's buffers (all layers, or a range of them);
    a file removed meanwhile still reads (it stays open); a cut file is not located."""
    from kvunit import layer_bytes

    disk.write([make_write(NS, h(1)), make_write(NS, h(2))])
    cut = block_path(tmp_path / "blocks", NS, h(2))
    os.truncate(cut, cut.stat().st_size - 1)
    with disk.locate([(NS, h(1)), (NS, h(2)), (NS, h(3))]) as found:
        assert found[1] is None and found[2] is None  # cut short; never stored
        handle = found[0]
        assert handle is not None and handle.meta.key == (NS, h(1))
        block_path(tmp_path / "blocks", NS, h(1)).unlink()  # evicted meanwhile
        target = bytearray(1000)
        view = memoryview(target)
        pieces = [view[600 : 600 + LAYERS[0].nbytes], view[0 : LAYERS[1].nbytes]]
        disk.read_into(handle, pieces).result()
        assert bytes(pieces[0]) == layer_bytes(h(1), LAYERS[0])
        assert bytes(pieces[1]) == layer_bytes(h(1), LAYERS[1])
        second = bytearray(LAYERS[1].nbytes)
        disk.read_into(handle, [memoryview(second)], range(1, 2)).result()
        assert bytes(second) == layer_bytes(h(1), LAYERS[1])
        with pytest.raises(ValueError, match="bytes of buffers"):
            disk.read_into(handle, pieces[:1])

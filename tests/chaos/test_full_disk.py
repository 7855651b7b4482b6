"""A full filesystem, for real: the daemon's data dir on a small tmpfs.

What holds, for both backends (README, Durability):

- filling the filesystem never wedges the store: each put is stored (eviction makes
  room on the filesystem as it does for the byte budget) or refused with
  RESOURCE_EXHAUSTED, never INTERNAL; what is stored reads back bit-exact;
- when another file takes the rest of the disk: the LMDB backend's segments were
  allocated when they were made, so eviction inside them still makes room and puts
  go on; the disk backend, whose evicted files a reader keeps alive, refuses a burst
  of puts with RESOURCE_EXHAUSTED at the cost of one put's eviction, not its contents;
- reads keep working on the full disk; Evict frees room; SIGTERM exits 0; and the
  daemon restarts on the full disk and serves what it has.

Needs root (mount); skipped with the reason where mount is refused.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from integration.helpers import NS, assert_same, chain, make_layers
from support.daemon import Daemon

from kvstore_client import KVStoreClient, errors
from kvstore_server.tiers.lmdb import LmdbBackend

MiB = 1 << 20
FS_MIB = 40
PUTS = 60  # of 1 MiB (2 layers x 512 KiB): half again the filesystem


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_MIB}m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path) -> None:
    """Write `path` until the filesystem has no room left."""
    with open(path, "ab") as f:
        with contextlib.suppress(OSError):  # ENOSPC is the point
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()


def layers(tag: str) -> dict[str, torch.Tensor]:
    return make_layers(1, num_layers=2, shape=(512, 512), seed=zlib.crc32(tag.encode()))


def put(kv: KVStoreClient, tag: str) -> str:
    """One 1 MiB put; its outcome: 'stored' or the error's status code."""
    try:
        kv.put(NS, chain(tag, 1), layers(tag))
    except errors.KVStoreError as exc:
        return exc.code or type(exc).__name__
    return "stored"


@contextlib.contextmanager
def pinned(data_dir: Path, backend: str) -> Iterator[None]:
    """Keep every stored block file of the disk backend alive whatever the daemon
    deletes (what a same-host reader's open files do). The LMDB backend's segments are
    never given back to the filesystem: nothing to hold."""
    with contextlib.ExitStack() as stack:
        if backend == "disk":
            for root, _dirs, files in os.walk(data_dir / "blocks"):
                for name in files:
                    stack.enter_context(open(os.path.join(root, name), "rb"))  # noqa: SIM115
        yield


def test_a_full_filesystem_refuses_puts_keeps_serving_and_restarts(small_fs: Path, backend: str) -> None:
    data_dir = small_fs  # (its log goes beside the mount point, not onto the full disk)
    daemon = Daemon(data_dir, backend=backend, capacity="1GiB").start()  # the filesystem is the limit
    try:
        with KVStoreClient(daemon.address, timeout=30, arena=False) as kv:
            outcomes = [put(kv, f"fill-{i}") for i in range(PUTS)]
            assert set(outcomes) <= {"stored", "RESOURCE_EXHAUSTED"}, outcomes
            assert free_bytes(small_fs) < 2 * MiB  # the store did fill the filesystem
            assert outcomes[-10:] == ["stored"] * 10  # ... and kept storing, by eviction
            last = chain(f"fill-{PUTS - 1}", 1)
            assert_same(kv.select(NS, last), layers(f"fill-{PUTS - 1}"))

            # Eviction cannot help: the evicted bytes stay held, and a file takes the rest.
            with pinned(data_dir, backend):
                fill(small_fs / "other-tenant")
                before = kv.stats()["blocks"]
                burst = [put(kv, f"burst-{i}") for i in range(17)]
                after = kv.stats()["blocks"]
                assert kv.lookup(NS, last) == 1 and kv.select(NS, last)  # reads keep working
            if backend == "lmdb":  # the segments' room is theirs: eviction in them helps
                assert burst == ["stored"] * 17, burst
                assert_same(kv.select(NS, chain("burst-16", 1)), layers("burst-16"))
            else:
                assert burst == ["RESOURCE_EXHAUSTED"] * 17, burst
                assert before - after <= 2  # one put's eviction (its size and one block), once
            print(
                f"\n[{backend}] {FS_MIB} MiB tmpfs: {outcomes.count('stored')}/{PUTS} puts stored, "
                f"{outcomes.count('RESOURCE_EXHAUSTED')} refused; with the space held elsewhere "
                f"{len(burst)} puts refused at a cost of {before - after} blocks ({before} -> {after})"
            )

            evicted = kv.evict(all=True)
            assert evicted.blocks_evicted == after
            assert put(kv, "after-evict") == "stored"  # evicting made room
        fill(small_fs / "other-tenant")  # full to the last block again
        assert daemon.stop() == 0  # the clean-stop record is written in place
        daemon.start()  # ... and the daemon starts on the full disk
        with KVStoreClient(daemon.address, timeout=30, arena=False) as kv:
            assert kv.health() == "SERVING"
            assert kv.lookup(NS, chain("after-evict", 1)) == 1
            assert kv.select(NS, chain("after-evict", 1))
            assert put(kv, "on-a-full-disk") in ("stored", "RESOURCE_EXHAUSTED")
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()


def test_lmdb_deletions_commit_on_a_full_disk_and_free_room_for_new_blocks(small_fs: Path) -> None:
    """The LMDB backend fills the filesystem with segments (each as large as the room left
    allows), then another file takes the last bytes: deletions still commit (the index
    gives up its headroom file if it must), and new blocks go into the freed extents."""
    from kvstore_server.tiers import BlockMeta, BlockWrite, LayerSpec, StorageFullError, checksum

    spec = (LayerSpec("l", "uint8", (MiB,), MiB),)
    backend = LmdbBackend(small_fs / "lmdb", capacity_bytes=1 << 30, sync=False)
    keys = []
    try:
        with pytest.raises(StorageFullError):
            for i in range(2 * FS_MIB):
                data = bytes([i % 251]) * MiB
                meta = BlockMeta(NS.encode(), chain(f"packed-{i}", 1)[0], b"", spec, (checksum(data),))
                backend.write([BlockWrite(meta, [data])])
                keys.append(meta.key)
        assert len(keys) >= FS_MIB // 2  # the segments took most of the filesystem
        fill(small_fs / "filler")
        assert free_bytes(small_fs) < 64 << 10
        backend.delete(keys[: len(keys) // 2])
        with backend.read(keys) as blocks:
            assert [b is not None for b in blocks] == [False] * (len(keys) // 2) + [True] * (
                len(keys) - len(keys) // 2
            )
            assert all(b.corrupt_layer() is None for b in blocks if b is not None)
        fresh = []
        for i in range(len(keys) // 2):  # into the extents the deletion freed
            data = bytes([7 + i]) * MiB
            meta = BlockMeta(NS.encode(), chain(f"reused-{i}", 1)[0], b"", spec, (checksum(data),))
            backend.write([BlockWrite(meta, [data])])
            fresh.append((meta.key, data))
        with backend.read([k for k, _ in fresh]) as blocks:
            assert [bytes(b.layers[0]) if b is not None else None for b in blocks] == [d for _, d in fresh]
    finally:
        backend.close()

"""A full filesystem, for real: the daemon's data dir on a small tmpfs.

What holds, for both backends (README, Durability):

- filling the filesystem never wedges the store: each put is stored (eviction makes
  room on the filesystem as it does for the byte budget) or refused with
  RESOURCE_EXHAUSTED, never INTERNAL; what is stored reads back bit-exact;
- when eviction cannot make room (the space is held elsewhere: here a reader keeps
  the evicted data alive, and another file takes the rest of the disk), a burst of
  puts fails with RESOURCE_EXHAUSTED and costs the store one put's eviction, not its
  contents;
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
from daemon import Daemon
from integration.helpers import NS, assert_same, chain, make_layers

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
    """Keep every stored block's bytes alive whatever the daemon deletes: open files of
    the disk backend, an LMDB read snapshot (what a same-host reader holds)."""
    with contextlib.ExitStack() as stack:
        if backend == "disk":
            for root, _dirs, files in os.walk(data_dir / "blocks"):
                for name in files:
                    stack.enter_context(open(os.path.join(root, name), "rb"))  # noqa: SIM115
        else:
            reader = LmdbBackend.reader(data_dir / "lmdb")
            stack.callback(reader.close)
            stack.enter_context(reader.read([]))  # a read transaction for as long as this lasts
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


def test_lmdb_deletions_commit_on_a_full_disk_through_the_headroom(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A packed LMDB file on a full filesystem: a deletion needs a few new pages (copied
    B-tree pages, the free list) and there are none, so the backend gives up its
    headroom file to let it commit; afterwards the freed pages take new blocks."""
    from kvstore_server.tiers import BlockMeta, BlockWrite, LayerSpec, StorageFullError, checksum

    spec = (LayerSpec("l", "uint8", (MiB,), MiB),)
    backend = LmdbBackend(small_fs / "lmdb", capacity_bytes=1 << 30, sync=False)
    keys = []
    try:
        with pytest.raises(StorageFullError, match="filesystem"):
            for i in range(2 * FS_MIB):
                data = bytes([i % 251]) * MiB
                meta = BlockMeta(NS.encode(), chain(f"packed-{i}", 1)[0], b"", spec, (checksum(data),))
                backend.write([BlockWrite(meta, [data])])
                keys.append(meta.key)
        # what the failed write left beyond LMDB's last page would give the deletion room: cut it
        os.truncate(small_fs / "lmdb" / "data.mdb", (backend._env.info()["last_pgno"] + 1) * 4096)
        fill(small_fs / "filler")
        assert free_bytes(small_fs) < 64 << 10
        caplog.set_level("WARNING")
        backend.delete(keys[: len(keys) // 2])
        assert "deletions commit in the headroom" in caplog.text
        with backend.read(keys) as blocks:
            assert [b is not None for b in blocks] == [False] * (len(keys) // 2) + [True] * (
                len(keys) - len(keys) // 2
            )
        data = bytes([7]) * MiB
        meta = BlockMeta(NS.encode(), chain("reused", 1)[0], b"", spec, (checksum(data),))
        backend.write([BlockWrite(meta, [data])])  # into the pages the deletion freed
        with backend.read([meta.key]) as blocks:
            assert blocks[0] is not None and bytes(blocks[0].layers[0]) == data
    finally:
        backend.close()

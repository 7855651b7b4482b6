"""SIGKILL around write-behind: what reaches the persistent tier, and what a kill leaves.

Real daemon processes, saves through the arena (a same-host KVStoreClient), both
backends. Removing the arena file after a kill is what a reboot does to /dev/shm: then
only the persistent tier is left.

- Blocks written behind (write_behind_blocks back at 0) survive a SIGKILL and the loss of
  the arena: every one reads back bit-exact, over gRPC and promoted into a new arena.
- A SIGKILL while write-behind is under way (a writer keeps saving chains, tens of MiB,
  and the daemon is killed while stats show blocks waiting) never leaves a torn block:
  with the arena kept, every acknowledged save is recovered whole; with it removed, what
  survives of each chain is a prefix whose bytes are exactly what was saved, and lookup
  counts exactly the blocks a read then serves.
"""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from integration.helpers import NS, all_blocks, assert_same, chain, make_layers, rows
from support.daemon import Daemon, eventually

from kvstore import arena_format as fmt
from kvstore_client import KVStoreClient, errors

MEMORY = "128MiB"  # the write-behind queue holds half (64 MiB): a round's saves are all queued


def forget_arena(daemon: Daemon) -> None:
    """Remove the killed daemon's arena file and its index, as a reboot does."""
    assert daemon.memory_dir is not None
    arena = fmt.arena_file(daemon.memory_dir, daemon.data_dir)
    assert arena.exists()
    arena.unlink()
    shutil.rmtree(fmt.index_path(arena), ignore_errors=True)


def new_daemon(tmp_path: Path, backend: str) -> Daemon:
    return Daemon(tmp_path / "data", backend=backend, memory_size=MEMORY, memory_dir=tmp_path / "shm")


# ---- written behind, then killed -----------------------------------------------------------
# (name, blocks, layer shape, dtype): page-multiple layers and odd ones, several layouts
SAVES = [
    ("pages", 12, (64, 1024), torch.uint8),  # 64 KiB per layer
    ("big", 6, (256, 1024), torch.float16),  # 512 KiB per layer
    ("odd", 9, (3, 333), torch.float16),  # 1998 bytes per layer
    ("prime", 7, (7919,), torch.uint8),
    ("bf16", 16, (8, 4, 129), torch.bfloat16),
]


def test_blocks_written_behind_survive_a_sigkill_and_the_loss_of_the_arena(
    tmp_path: Path, backend: str
) -> None:
    daemon = new_daemon(tmp_path, backend).start()
    saved = {
        name: (chain(f"behind-{name}", n), make_layers(n, num_layers=3, shape=shape, dtype=dtype, seed=i))
        for i, (name, n, shape, dtype) in enumerate(SAVES)
    }
    total = sum(n for _, n, _, _ in SAVES)
    try:
        with KVStoreClient(daemon.address, timeout=30) as kv:
            assert kv.arena_available()
            for hashes, layers in saved.values():
                # in pieces: several commits per chain, each naming its parent
                for start in range(0, len(hashes), 4):
                    parent = hashes[start - 1] if start else b""
                    part = rows(layers, start, start + 4)
                    result = kv.put(NS, hashes[start : start + 4], part, parent_hash=parent)
                    assert result.blocks_written == len(hashes[start : start + 4])
            eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
            stats = kv.stats()
            assert (stats["commits"], stats["write_behind_dropped"]) == (stats["puts"], 0)
            assert stats["written_behind"] == total and stats["memory_blocks"] == total
        daemon.kill()
        forget_arena(daemon)
        before = len(daemon.log())
        daemon.start()
        assert "memory tier: recovered" not in daemon.log()[before:]  # a new, empty arena
        with KVStoreClient(daemon.address, timeout=30, arena=False) as remote:
            stats = remote.stats()
            assert (stats["blocks"], stats["memory_blocks"]) == (total, 0)
            for hashes, layers in saved.values():
                assert remote.lookup(NS, hashes) == len(hashes)
                assert_same(remote.select(NS, hashes), layers)  # straight from the persistent tier
        with KVStoreClient(daemon.address, timeout=30) as kv:
            for hashes, layers in saved.values():
                stream = kv.get_stream(NS, hashes)
                assert stream.via == "arena"  # promoted: read back into the new arena
                assert_same(stream.read_all(), layers)
            stats = kv.stats()
            assert stats["promoted_blocks"] == total and stats["checksum_failures"] == 0
    finally:
        daemon.stop()


# ---- killed while writing behind -------------------------------------------------------------
BLOCKS = 8
SHAPE = (256, 1024)  # uint8, 2 layers: 512 KiB per block, 4 MiB per save
ROUNDS = 5  # kills at most, until one is seen to land while blocks wait for write-behind
SAVES_PER_ROUND = 6  # 24 MiB saved (and acknowledged) before each kill


def save_hashes(index: int) -> list[bytes]:
    return chain(f"wb-kill-{index}", BLOCKS)


def save_layers(index: int) -> dict[str, torch.Tensor]:
    return make_layers(BLOCKS, num_layers=2, shape=SHAPE, dtype=torch.uint8, seed=10_000 + index)


class Saver:
    """A thread saving fresh chains through the arena, one after another, until stopped
    or until a save fails (the daemon was killed)."""

    def __init__(self, address: str, first: int) -> None:
        self.address = address
        self.next = first
        self.attempted: list[int] = []
        self.acknowledged: list[int] = []
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="saver")

    def __enter__(self) -> Saver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        try:
            with KVStoreClient(self.address, timeout=10) as kv:
                if not kv.arena_available():
                    raise AssertionError("the arena is not in use")
                while not self.stopped.is_set():
                    index = self.next
                    self.next += 1
                    layers = save_layers(index)
                    self.attempted.append(index)
                    try:
                        kv.put(NS, save_hashes(index), layers)
                    except errors.KVStoreError:
                        return  # the daemon is gone
                    self.acknowledged.append(index)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self.error = exc


def kill_while_writing_behind(daemon: Daemon, saver: Saver) -> None:
    """SIGKILL the daemon as soon as stats show blocks waiting for write-behind, once the
    saver has had SAVES_PER_ROUND more saves acknowledged."""
    wanted = len(saver.acknowledged) + SAVES_PER_ROUND
    with KVStoreClient(daemon.address, timeout=10, arena=False) as kv:

        def ready() -> bool:
            assert saver.error is None, saver.error
            return len(saver.acknowledged) >= wanted and kv.stats()["write_behind_blocks"] > 0

        eventually(ready, deadline_s=60)
        daemon.kill()


def check_no_torn_block(daemon: Daemon, attempted: list[int], must_be_whole: list[int]) -> int:
    """Every attempted chain reads back as a prefix of what was saved (over gRPC and through
    the arena), lookup counts exactly that prefix, and nothing else is stored. Returns the
    blocks of acknowledged saves that are missing."""
    missing = 0
    served = 0
    with (
        KVStoreClient(daemon.address, timeout=30, arena=False) as remote,
        KVStoreClient(daemon.address, timeout=30) as local,
    ):
        known = {h for index in attempted for h in save_hashes(index)}
        listed = all_blocks(remote, NS)
        assert {b.block_hash for b in listed} <= known  # nothing the saver did not send
        for index in attempted:
            hashes, want = save_hashes(index), save_layers(index)
            n = remote.lookup(NS, hashes)
            got = remote.select(NS, hashes)
            assert got.num_blocks == n, (index, n, got.num_blocks, got.stop_reason)  # no promise broken
            assert got.stop_reason == ("none" if n == BLOCKS else "not_stored"), (index, got.stop_reason)
            if n:
                assert_same(got, rows(want, 0, n))
                stream = local.get_stream(NS, hashes)
                assert stream.via == "arena"
                assert_same(stream.read_all(), rows(want, 0, n))
            else:
                assert got == {}
            served += n
            if index in must_be_whole:
                missing += BLOCKS - n
        stats = remote.stats()
        assert stats["checksum_failures"] == 0
        assert stats["blocks"] == len(listed) >= served
    return missing


@pytest.mark.parametrize("arena", ["kept", "removed"])
def test_a_sigkill_during_write_behind_leaves_no_torn_block(tmp_path: Path, backend: str, arena: str) -> None:
    daemon = new_daemon(tmp_path, backend).start()
    attempted: list[int] = []
    acknowledged: list[int] = []
    kills = 0
    landed_mid_write_behind = False
    try:
        while not landed_mid_write_behind:
            assert kills < ROUNDS, f"no kill of {ROUNDS} landed while blocks waited for write-behind"
            with Saver(daemon.address, first=len(attempted)) as saver:
                kill_while_writing_behind(daemon, saver)
            kills += 1
            assert saver.error is None, saver.error
            attempted += saver.attempted
            acknowledged += saver.acknowledged
            if arena == "removed":
                forget_arena(daemon)
            before = len(daemon.log())
            daemon.start()
            log = daemon.log()[before:]
            recovered = re.search(
                r"memory tier: recovered \d+ committed blocks .* \((\d+) not yet written", log
            )
            if arena == "kept":
                # the arena recovers every acknowledged save, whatever write-behind had done
                assert check_no_torn_block(daemon, attempted, must_be_whole=acknowledged) == 0
                assert recovered is not None, log
                waiting = int(recovered.group(1))
            else:
                assert recovered is None, log
                # saves not yet written behind are lost with the arena: a kill that lost
                # some landed while they waited
                waiting = check_no_torn_block(daemon, attempted, must_be_whole=acknowledged)
            landed_mid_write_behind = waiting > 0
        print(
            f"\n[{backend}, arena {arena}] {kills} SIGKILLs, {len(attempted)} saves sent, "
            f"{len(acknowledged)} acknowledged; the last kill left {waiting} blocks "
            + (
                "waiting for write-behind (recovered)"
                if arena == "kept"
                else "of acknowledged saves unwritten"
            )
        )
    finally:
        daemon.stop()

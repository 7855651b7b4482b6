"""Arenas left by SIGKILLed daemons: removed once no data directory claims them.

Real daemon processes sharing one private memory directory (never the host's
/dev/shm). A killed daemon leaves its arena for a restart on its data directory to
recover; a daemon that starts on the same memory directory removes the arenas whose
data directory is gone or claims another arena, and leaves the live and the
recoverable ones alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from integration.helpers import NS, assert_same, chain, make_layers
from support.daemon import Daemon

from kvstore import arena_format as fmt
from kvstore import arenas
from kvstore_client import KVStoreClient


def _arena(memory_dir: Path, daemon: Daemon) -> Path:
    return fmt.arena_file(memory_dir, daemon.data_dir)


def test_a_starting_daemon_removes_orphans_and_keeps_live_and_recoverable_arenas(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    orphan = Daemon(tmp_path / "orphan", memory_dir=shm).start()
    recoverable = Daemon(tmp_path / "recoverable", memory_dir=shm).start()
    live = Daemon(tmp_path / "live", memory_dir=shm).start()
    newcomer = Daemon(tmp_path / "newcomer", memory_dir=shm)
    layers = make_layers(2, num_layers=2, shape=(16, 256), seed=7)
    hashes = chain("orphans", 2)
    try:
        with KVStoreClient(recoverable.address) as kv:
            kv.put(NS, hashes, layers)
        orphan.kill()
        recoverable.kill()
        shutil.rmtree(orphan.data_dir)
        paths = {name: _arena(shm, d) for name, d in
                 (("orphan", orphan), ("recoverable", recoverable), ("live", live))}  # fmt: skip
        assert all(p.exists() for p in paths.values())
        judged = {info.path: info.state for info in arenas.scan(shm)}
        assert judged == {
            paths["orphan"]: arenas.ORPHAN,
            paths["recoverable"]: arenas.RECOVERABLE,
            paths["live"]: arenas.LIVE,
        }

        newcomer.start()
        assert not paths["orphan"].exists()
        assert not fmt.index_path(paths["orphan"]).exists()
        assert paths["recoverable"].exists() and paths["live"].exists()
        assert f"removed the orphaned arena {paths['orphan']}" in newcomer.log()
        assert "is gone" in newcomer.log()

        # the live daemon still serves from its arena; the killed one recovers its own
        with KVStoreClient(live.address) as kv:
            kv.put(NS, hashes, layers)
            assert kv.lookup(NS, hashes) == 2
        recoverable.start()
        assert "(recovered)" in recoverable.log()
        with KVStoreClient(recoverable.address) as kv:
            assert_same(kv.select(NS, hashes), layers)
    finally:
        for d in (orphan, recoverable, live, newcomer):
            d.stop()


def test_an_arena_its_data_directory_no_longer_claims_is_removed(tmp_path: Path) -> None:
    """A daemon restarted on its data directory with another --memory-dir, or without
    a memory tier, gives its old arena up: the next start on the old memory directory
    removes it (here the restart without a memory tier, which also gives up its own)."""
    shm, elsewhere = tmp_path / "shm", tmp_path / "shm2"
    moved = Daemon(tmp_path / "moved", memory_dir=shm).start()
    off = Daemon(tmp_path / "off", memory_dir=shm).start()
    try:
        moved_arena, off_arena = _arena(shm, moved), _arena(shm, off)
        moved.kill()
        off.kill()
        moved.memory_dir = elsewhere
        moved.start()
        assert moved_arena.exists()  # nobody swept shm yet
        assert _arena(elsewhere, moved).exists()
        off.memory_size = "0"
        off.start()
        assert not off_arena.exists() and not moved_arena.exists()
        assert "claims no arena" in off.log()
        assert "claims another arena" in off.log()
        assert _arena(elsewhere, moved).exists()
    finally:
        for d in (moved, off):
            d.stop()

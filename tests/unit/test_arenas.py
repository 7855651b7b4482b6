"""Orphaned arenas: ownership recorded both ways, the daemon's lock, and what is removed.

Real arena files (ArenaFile, as the daemon makes them) in a private memory directory;
a lock held by another descriptor is a real flock (a second open file description
conflicts even within this process).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from kvstore import arena_format as fmt
from kvstore import arenas
from kvstore_cli.main import main as cli
from kvstore_server.tiers.arena import open_memory_tier, sweep_memory_dir

SIZE = 1 << 20


def make_arena(memory_dir: Path, data_dir: Path) -> Path:
    """An arena as a daemon on `data_dir` leaves it when SIGKILLed: file, index, claim."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tier = open_memory_tier(memory_dir, data_dir, SIZE, "run", lease_seconds=30, write_behind_bytes=SIZE)
    path = tier.file.path
    tier.close()  # not removed: what a crash leaves
    return path


def states(memory_dir: Path) -> dict[str, str]:
    return {info.path.name: info.state for info in arenas.scan(memory_dir)}


def test_the_header_records_its_owner_and_older_headers_read_as_unowned() -> None:
    header = fmt.Header(SIZE, "a" * 32, "s" * 32, owner="/var/lib/kvstore")
    assert fmt.Header.unpack(header.pack()).owner == "/var/lib/kvstore"
    legacy = fmt.Header(SIZE, "a" * 32, "s" * 32)
    assert fmt.Header.unpack(legacy.pack()).owner == ""
    with pytest.raises(fmt.ArenaFormatError):
        fmt.Header(SIZE, "a", "s", owner="x" * (fmt.MAX_OWNER_BYTES + 1)).pack()


def test_ownership_is_recorded_both_ways(tmp_path: Path) -> None:
    shm, data = tmp_path / "shm", tmp_path / "data"
    path = make_arena(shm, data)
    header = fmt.Header.unpack(path.read_bytes()[: fmt.HEADER_BYTES])
    assert header.owner == str(data.resolve())
    claimed, arena_id = arenas.read_claim(data) or ("", "")
    assert Path(claimed) == path.absolute() and arena_id == header.arena_id
    assert states(shm) == {path.name: arenas.RECOVERABLE}


def test_an_open_tier_is_live_and_a_second_opener_is_refused(tmp_path: Path) -> None:
    shm, data = tmp_path / "shm", tmp_path / "data"
    data.mkdir()
    tier = open_memory_tier(shm, data, SIZE, "run", lease_seconds=30, write_behind_bytes=SIZE)
    try:
        [info] = arenas.scan(shm)
        assert info.state == arenas.LIVE
        assert os.getpid() in info.holders
        assert arenas.remove_orphans(shm, include_unowned=True) == []
        with pytest.raises(arenas.ArenaLocked, match="locked by another process"):
            arenas.open_locked(tier.file.path, wait_s=0.05)
    finally:
        tier.close(remove=True)
    assert not tier.file.path.exists() and not fmt.index_path(tier.file.path).exists()
    assert arenas.read_claim(data) is None  # a clean stop withdraws the claim


def test_orphans_are_removed_and_the_rest_kept(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    gone = make_arena(shm, tmp_path / "gone")
    moved = make_arena(shm, tmp_path / "moved")
    kept = make_arena(shm, tmp_path / "kept")
    # data directory removed; data directory that since claims an arena elsewhere
    for entry in (tmp_path / "gone").iterdir():
        entry.unlink() if entry.is_file() else None
    (tmp_path / "gone").rmdir()
    make_arena(tmp_path / "other-shm", tmp_path / "moved")
    # a file cut short while it was created (no header), and one from an older kvstore
    torn = shm / "kvstore-00000000000000aa.arena"
    torn.write_bytes(b"\0" * 100)
    unowned = shm / "kvstore-00000000000000bb.arena"
    unowned.write_bytes(fmt.Header(SIZE, "b" * 32, "").pack())
    # an index whose arena is gone
    (shm / "kvstore-00000000000000cc.arena.index").mkdir()
    before = states(shm)
    assert before == {
        gone.name: arenas.ORPHAN,
        moved.name: arenas.ORPHAN,
        kept.name: arenas.RECOVERABLE,
        torn.name: arenas.ORPHAN,
        unowned.name: arenas.UNOWNED,
    }
    removed = arenas.remove_orphans(shm)
    assert {i.path.name for i in removed} == {gone.name, moved.name, torn.name}
    assert not fmt.index_path(gone).exists()
    assert sorted(os.listdir(shm)) == sorted([kept.name, fmt.index_path(kept).name, unowned.name])
    assert [i.path.name for i in arenas.remove_orphans(shm, include_unowned=True)] == [unowned.name]


def test_a_locked_orphan_is_not_removed(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    path = make_arena(shm, tmp_path / "data")
    (tmp_path / "data" / arenas.CLAIM_FILE).unlink()
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert states(shm) == {path.name: arenas.LIVE}
        assert arenas.remove_orphans(shm) == []
    finally:
        os.close(fd)
    assert [i.path for i in arenas.remove_orphans(shm)] == [path]


def test_running_without_a_memory_tier_gives_the_old_arena_up(tmp_path: Path) -> None:
    shm, data = tmp_path / "shm", tmp_path / "data"
    path = make_arena(shm, data)
    assert sweep_memory_dir(shm, data, enabled=True) == []  # its own arena is kept
    assert path.exists()
    assert [i.path for i in sweep_memory_dir(shm, data, enabled=False)] == [path]
    assert not path.exists() and arenas.read_claim(data) is None


def test_a_reopened_arena_is_recovered_not_replaced(tmp_path: Path) -> None:
    shm, data = tmp_path / "shm", tmp_path / "data"
    path = make_arena(shm, data)
    arena_id = fmt.Header.unpack(path.read_bytes()[: fmt.HEADER_BYTES]).arena_id
    tier = open_memory_tier(shm, data, SIZE, "run2", lease_seconds=30, write_behind_bytes=SIZE)
    try:
        assert not tier.file.fresh and tier.file.header.arena_id == arena_id
    finally:
        tier.close()


def test_cli_lists_and_removes_orphans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shm = tmp_path / "shm"
    orphan = make_arena(shm, tmp_path / "a")
    (tmp_path / "a" / arenas.CLAIM_FILE).unlink()
    kept = make_arena(shm, tmp_path / "b")
    assert cli(["arenas", "--memory-dir", str(shm)]) == 0
    out = capsys.readouterr().out
    assert orphan.name in out and "orphan" in out and "claims no arena" in out
    assert "1 orphaned arena(s) hold 1.0 MiB" in out and "--remove-orphans" in out
    assert orphan.exists()  # listing changes nothing
    assert cli(["arenas", "--memory-dir", str(shm), "--remove-orphans", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in doc["removed"]] == [str(orphan)]
    assert [(a["path"], a["state"]) for a in doc["arenas"]] == [(str(kept), "recoverable")]
    assert not orphan.exists() and kept.exists()
    assert cli(["arenas", "--memory-dir", str(tmp_path / "nope")]) == 2
    assert cli(["arenas", "--memory-dir", str(shm), "--include-unowned"]) == 2

"""kvstore_server.datadir: the directory lock and crash recovery."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from kvstore_server.datadir import DataDir, DataDirInUse, _boot_id, publish_store_id


def populate(path: Path) -> None:
    (path / "lmdb").mkdir()
    (path / "lmdb" / "data.mdb").write_bytes(b"lmdb data")
    (path / "blocks" / "ab").mkdir(parents=True)
    (path / "blocks" / "ab" / "x.safetensors").write_bytes(b"block")
    (path / "notes.txt").write_text("keep me")


def state(path: Path) -> dict:
    return json.loads((path / "STATE").read_text())


def write_state(path: Path, **fields: object) -> None:
    doc = {"clean": False, "boot_id": _boot_id(), "sync": False, "pid": 1}
    doc.update(fields)
    (path / "STATE").write_text(json.dumps(doc))


def crash(datadir: DataDir) -> None:
    """What a killed process leaves: the lock released, STATE still saying 'running'."""
    os.close(datadir._lock_fd)


def discarded(path: Path) -> list[Path]:
    return sorted(path.glob("discarded-*"))


def test_creates_directory_and_records_a_running_state(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    datadir = DataDir(path, sync=True)
    try:
        assert (path / "LOCK").exists()
        doc = state(path)
        assert doc["clean"] is False
        assert doc["sync"] is True
        assert doc["boot_id"] == _boot_id()
        assert doc["pid"] == os.getpid()
        assert not (path / "STATE.tmp").exists()
    finally:
        datadir.close(sync=True)
    assert state(path)["clean"] is True


def test_second_datadir_on_same_path_is_refused(tmp_path: Path) -> None:
    first = DataDir(tmp_path, sync=False)
    try:
        with pytest.raises(DataDirInUse, match=str(tmp_path)):
            DataDir(tmp_path, sync=False)
        assert state(tmp_path)["clean"] is False, "the refused opener must not touch STATE"
    finally:
        first.close(sync=False)
    # released on close
    second = DataDir(tmp_path, sync=False)
    second.close(sync=False)


def test_clean_stop_keeps_data(tmp_path: Path) -> None:
    DataDir(tmp_path, sync=False).close(sync=False)
    populate(tmp_path)
    write_state(tmp_path, clean=True, boot_id="some-other-boot")
    DataDir(tmp_path, sync=False).close(sync=False)
    assert (tmp_path / "lmdb" / "data.mdb").read_bytes() == b"lmdb data"
    assert discarded(tmp_path) == []


def test_unclean_stop_same_boot_keeps_data(tmp_path: Path) -> None:
    populate(tmp_path)
    crash(DataDir(tmp_path, sync=False))
    assert state(tmp_path)["clean"] is False
    datadir = DataDir(tmp_path, sync=False)
    datadir.close(sync=False)
    assert (tmp_path / "lmdb" / "data.mdb").read_bytes() == b"lmdb data"
    assert (tmp_path / "blocks" / "ab" / "x.safetensors").exists()
    assert discarded(tmp_path) == []


def test_unclean_stop_before_reboot_moves_data_aside(tmp_path: Path) -> None:
    populate(tmp_path)
    write_state(tmp_path, clean=False, boot_id="00000000-another-boot", sync=False)
    datadir = DataDir(tmp_path, sync=False)
    try:
        assert not (tmp_path / "lmdb").exists()
        assert not (tmp_path / "blocks").exists()
        [aside] = discarded(tmp_path)
        assert (aside / "lmdb" / "data.mdb").read_bytes() == b"lmdb data"
        assert (aside / "blocks" / "ab" / "x.safetensors").read_bytes() == b"block"
        assert (tmp_path / "notes.txt").exists(), "only the backends' data moves"
        assert (tmp_path / "LOCK").exists()
        doc = state(tmp_path)
        assert doc["clean"] is False and doc["boot_id"] == _boot_id()
    finally:
        datadir.close(sync=False)


def test_unclean_stop_before_reboot_with_sync_keeps_data(tmp_path: Path) -> None:
    populate(tmp_path)
    write_state(tmp_path, clean=False, boot_id="00000000-another-boot", sync=True)
    DataDir(tmp_path, sync=False).close(sync=False)
    assert (tmp_path / "lmdb" / "data.mdb").exists()
    assert discarded(tmp_path) == []


def test_unreadable_state_counts_as_unclean(tmp_path: Path) -> None:
    populate(tmp_path)
    (tmp_path / "STATE").write_text("{torn")
    DataDir(tmp_path, sync=False).close(sync=False)
    # boot id unknown: the data cannot be vouched for unless this host has no boot id either
    if _boot_id() == "unknown":  # pragma: no cover - hosts without /proc
        assert (tmp_path / "lmdb").exists()
    else:
        assert not (tmp_path / "lmdb").exists()
        assert len(discarded(tmp_path)) == 1


def test_boot_id_is_stable() -> None:
    assert _boot_id() == _boot_id()
    assert _boot_id()


def test_a_full_filesystem_overwrites_state_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No room for the temporary file (ENOSPC): STATE is rewritten in place, which needs
    no new block, so the daemon can start and stop on a full disk. (The chaos suite
    does this on a real full tmpfs.)"""
    datadir = DataDir(tmp_path, sync=False)
    publish_store_id(tmp_path, "b" * 32)
    real_open = os.open

    def no_new_files(path, flags, mode=0o777):  # what a full filesystem does to a new file
        if str(path).endswith(".tmp") and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_new_files)
    datadir.close(sync=False)
    assert state(tmp_path)["clean"] is True
    again = DataDir(tmp_path, sync=False)
    assert state(tmp_path)["clean"] is False
    publish_store_id(tmp_path, "a" * 32)
    monkeypatch.undo()
    again.close(sync=False)
    assert (tmp_path / "STORE_ID").read_text() == "a" * 32
    assert not list(tmp_path.glob("*.tmp"))

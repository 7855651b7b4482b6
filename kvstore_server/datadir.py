"""The data directory's guard: one daemon per directory, and honest recovery.

`STATE` records whether the last daemon stopped cleanly and on which boot it
ran. Without `sync`, commits reach the OS page cache but not the disk: they
survive any process crash (SIGKILL, OOM), but an OS crash or power loss can
lose or tear the newest writes. So when the last run did not stop cleanly
*and* the machine has rebooted since, the store cannot vouch for its files: it
moves them aside and starts empty (a cache may forget; it must not lie).

A full filesystem must not stop the daemon from starting or stopping cleanly:
the small records here (STATE, STORE_ID) are replaced atomically when there is
room, and overwritten in place when there is not (an existing file's block
needs no new space), so their records have a fixed length.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path

from kvstore import arenas
from kvstore.layouts import BACKEND_DIRS, STORE_ID_FILE
from kvstore_server.errors import DataDirInUse
from kvstore_server.tiers.base import NO_SPACE

log = logging.getLogger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

# STATE records are padded to this length, so one can overwrite another in place.
_STATE_BYTES = 256


def write_record(path: Path, data: bytes, *, sync: bool) -> None:
    """Replace the small file `path` by `data`: atomically (a temporary file renamed
    over it) when the filesystem has room, else in place, which needs no new block.
    Callers keep `data` the same length as what it overwrites."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_file(tmp, data, os.O_CREAT | os.O_TRUNC, sync=sync)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in NO_SPACE or not path.exists():
            raise
        log.warning("%s: the filesystem is full; overwriting %s in place", exc.strerror, path.name)
        _write_file(path, data, 0, sync=sync)
        return
    if sync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file(path: Path, data: bytes, flags: int, *, sync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | flags, 0o644)
    try:
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.ftruncate(fd, len(data))  # shrinking never needs space
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def publish_store_id(path: Path, store_id: str | None) -> None:
    """Write this run's store_id where same-host clients look for it (see LocalAccess);
    None withdraws it, so clients of an earlier run that offered local reads stop.
    Ids have a fixed length (32 hex digits), so a full filesystem overwrites in place."""
    if store_id is None:
        (path / STORE_ID_FILE).unlink(missing_ok=True)
        return
    write_record(path / STORE_ID_FILE, store_id.encode(), sync=False)


def claim_arena(data_dir: Path, arena: Path, arena_id: str) -> None:
    """Record in `data_dir` that the arena at `arena` is its own (kvstore.arenas: the
    other half of the record is the arena header's owner). A full filesystem only
    costs the claim: logged, and the arena is then an orphan once its daemon is gone."""
    try:
        write_record(
            data_dir / arenas.CLAIM_FILE, arenas.claim_record(arena.absolute(), arena_id), sync=False
        )
    except OSError as exc:
        log.warning(
            "cannot record the memory tier %s in %s (%s): after a crash it will be removed, not recovered",
            arena,
            data_dir,
            exc,
        )


def withdraw_arena_claim(data_dir: Path) -> None:
    """`data_dir` claims no arena (its arena was removed, or it runs without one)."""
    try:
        (data_dir / arenas.CLAIM_FILE).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot withdraw the memory tier's claim in %s: %s", data_dir, exc)


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


class DataDir:
    def __init__(self, path: Path, *, sync: bool) -> None:
        self.path = path
        # the last run stopped uncleanly and the machine has rebooted since: nothing that
        # was never fsynced (the memory tier's arena, if its file survived) can be trusted
        self.rebooted = False
        path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise DataDirInUse(f"{path} is in use by another kvstore-server") from exc
        self._recover(sync)
        self._write_state(clean=False, sync=sync)

    def _recover(self, sync: bool) -> None:
        state_path = self.path / "STATE"
        try:
            state = json.loads(state_path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s); treating the last stop as unclean", state_path, exc)
            state = {"clean": False, "boot_id": "unknown", "sync": False}
        if state.get("clean"):
            return
        if state.get("boot_id") == _boot_id():
            log.info("last run did not stop cleanly (process crash); committed data is intact")
            return
        self.rebooted = True
        if state.get("sync"):
            log.info("last run did not stop cleanly before a reboot; its commits were fsynced")
            return
        aside = self.path / f"discarded-{int(time.time())}"
        aside.mkdir()
        for entry in self.path.iterdir():
            if entry.name in BACKEND_DIRS.values():
                entry.rename(aside / entry.name)
        log.warning(
            "the last run stopped uncleanly before an OS restart without sync=true: unsynced writes may be "
            "torn, so the old data was moved to %s and the store starts empty",
            aside,
        )

    def _write_state(self, *, clean: bool, sync: bool) -> None:
        doc = json.dumps({"clean": clean, "boot_id": _boot_id(), "sync": sync, "pid": os.getpid()})
        write_record(self.path / "STATE", doc.ljust(_STATE_BYTES).encode(), sync=sync)

    def close(self, *, sync: bool, clean: bool = True) -> None:
        """Record the stop (clean: after the backend is closed) and release the lock."""
        try:
            self._write_state(clean=clean, sync=sync)
        finally:
            os.close(self._lock_fd)

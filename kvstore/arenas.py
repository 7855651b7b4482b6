"""Arena files in a memory directory: who owns each, whether it is in use, which are orphans.

An arena (`kvstore-<tag>.arena` and its index `kvstore-<tag>.arena.index/`, see
kvstore.arena_format) belongs to one data directory, and the ownership is recorded
both ways, so either side can be checked against the other:

    the arena's header        names its data directory (Header.owner)
    <data_dir>/ARENA          names the arena (its path and arena id): the claim

A daemon holds an exclusive `flock` on its arena file from the moment it opens it
until it exits (a SIGKILL releases it too: the kernel drops a dead process's locks).
An arena is then, in this order of precedence:

    live         a process holds its lock: a running daemon. Never touched.
    recoverable  its data directory exists and claims it: a daemon restarted on that
                 data directory recovers its committed blocks. Kept.
    orphan       its data directory is gone, or claims another arena (the daemon ran
                 since with another --memory-dir or with --memory 0), or the file is
                 not a readable arena (a creation cut short). Removed.
    unowned      written before owners were recorded (a kvstore older than this
                 module): its owner cannot be told. Kept, unless asked.

`remove_orphans` runs when a daemon starts (on its --memory-dir) and from
`kvstore-cli arenas --remove-orphans`. It decides and removes while holding the
arena's lock, so a daemon that opens the arena meanwhile waits, and then finds
its file gone and creates a fresh one (see `open_locked`).

NOTE: ownership is judged by the data directory's path as the remover sees it. A
memory directory shared by daemons that see different filesystems (containers
sharing /dev/shm but not their volumes) would take another's stopped arena for an
orphan: give such daemons memory directories of their own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import arena_format as fmt

log = logging.getLogger(__name__)

CLAIM_FILE = "ARENA"
"""<data_dir>/ARENA: JSON {"arena": absolute path, "arena_id": id}."""

LIVE, RECOVERABLE, ORPHAN, UNOWNED = "live", "recoverable", "orphan", "unowned"

# How long an opener waits for a lock another process holds briefly (a remover
# deciding): a live daemon holds it for good, and the opener then fails.
_LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.01


class ArenaLocked(OSError):
    """Another live process holds the arena's lock."""


# ---- the lock ---------------------------------------------------------------------
def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def open_locked(path: Path, *, wait_s: float = _LOCK_WAIT_S) -> int:
    """Open (creating it, mode 0600) and exclusively lock the arena file at `path`; the
    descriptor holds the lock until it is closed. Retries while another process holds
    the lock briefly, and when the file it locked was removed meanwhile (the lock then
    guards a file no longer at `path`). Raises ArenaLocked after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if _try_lock(fd):
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
        os.close(fd)
        if time.monotonic() > deadline:
            holders = ", ".join(map(str, lock_holders(path))) or "unknown"
            raise ArenaLocked(errno.EBUSY, f"the arena {path} is locked by another process (pid {holders})")
        # NOTE: a poll, not a blocking flock: a blocking lock on a file that is then
        # removed would be granted on the removed inode; the loop re-opens the path.
        time.sleep(_LOCK_POLL_S)


def lock_holders(path: Path) -> list[int]:
    """The pids holding a flock on `path` (from /proc/locks; [] where it cannot tell)."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" (blocked waiters add "->")
        parts = line.split()
        if "FLOCK" in parts and "->" not in parts and device in parts:
            pids.append(int(parts[parts.index(device) - 1]))
    return pids


# ---- the claim --------------------------------------------------------------------
def read_claim(data_dir: Path) -> tuple[str, str] | None:
    """(arena path, arena id) that `data_dir` claims; None when it claims none."""
    try:
        doc = json.loads((data_dir / CLAIM_FILE).read_text())
        return str(doc["arena"]), str(doc["arena_id"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("unreadable arena claim in %s: %s", data_dir, exc)
        return None


def claim_record(arena: Path, arena_id: str) -> bytes:
    """The ARENA file's content for `arena` (the daemon writes it; see kvstore_server.datadir)."""
    return json.dumps({"arena": str(arena), "arena_id": arena_id}).encode()


# ---- classification ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ArenaInfo:
    path: Path
    size: int  # bytes of the file (shared memory it holds)
    state: str  # LIVE, RECOVERABLE, ORPHAN or UNOWNED
    reason: str  # why, for people
    owner: str = ""  # the data directory it belongs to; "" when unknown
    holders: list[int] = field(default_factory=list)  # pids holding its lock (live)


def _classify(path: Path, fd: int, size: int) -> ArenaInfo:
    """Judge an arena whose lock the caller holds (so it is not live)."""
    try:
        header = fmt.Header.unpack(os.pread(fd, fmt.HEADER_BYTES, 0))
    except (OSError, fmt.ArenaFormatError) as exc:
        return ArenaInfo(path, size, ORPHAN, f"not a readable arena ({exc})")
    if not header.owner:
        return ArenaInfo(path, size, UNOWNED, "written by a kvstore that did not record owners")
    owner = Path(header.owner)
    if not owner.is_dir():
        return ArenaInfo(path, size, ORPHAN, f"its data directory {owner} is gone", header.owner)
    claim = read_claim(owner)
    if claim is None:
        return ArenaInfo(path, size, ORPHAN, f"{owner} claims no arena", header.owner)
    claimed_path, claimed_id = claim
    if claimed_id != header.arena_id or not _same_file(Path(claimed_path), path):
        return ArenaInfo(path, size, ORPHAN, f"{owner} claims another arena ({claimed_path})", header.owner)
    return ArenaInfo(path, size, RECOVERABLE, f"the next daemon on {owner} recovers it", header.owner)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # the claimed arena is not there: another one
        return False


def _arena_files(memory_dir: Path) -> Iterator[Path]:
    try:
        names = sorted(os.listdir(memory_dir))
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(fmt.ARENA_PREFIX) and name.endswith(fmt.ARENA_SUFFIX):
            yield memory_dir / name


def _inspect_locked(path: Path, decide: bool) -> tuple[ArenaInfo | None, int | None]:
    """Open `path` and take its lock without waiting. Returns (info, fd): fd is the
    locked descriptor (the caller closes it) unless the arena is live or gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    size = os.fstat(fd).st_size
    if not _try_lock(fd):
        os.close(fd)
        holders = lock_holders(path)
        who = f"pid {', '.join(map(str, holders))}" if holders else "a live process"
        owner = ""
        try:
            with open(path, "rb") as f:
                owner = fmt.Header.unpack(f.read(fmt.HEADER_BYTES)).owner
        except (OSError, fmt.ArenaFormatError) as exc:
            log.debug("live arena %s: header unreadable: %s", path, exc)
        return ArenaInfo(path, size, LIVE, f"in use by {who}", owner, holders), None
    if not decide:
        info = _classify(path, fd, size)
        os.close(fd)
        return info, None
    return _classify(path, fd, size), fd


def scan(memory_dir: Path) -> list[ArenaInfo]:
    """Every arena in `memory_dir`, judged (the directory is not changed)."""
    found = []
    for path in _arena_files(memory_dir):
        info, _ = _inspect_locked(path, decide=False)
        if info is not None:
            found.append(info)
    return found


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    shutil.rmtree(fmt.index_path(path), ignore_errors=True)
    fmt.socket_path(path).unlink(missing_ok=True)


def remove_orphans(
    memory_dir: Path, *, keep: Path | None = None, include_unowned: bool = False
) -> list[ArenaInfo]:
    """Remove the orphaned arenas of `memory_dir` (and `UNOWNED` ones if asked), each
    with its index, deciding under the arena's lock; `keep`: an arena never touched
    (the caller's own). Also removes indexes whose arena file is gone. Returns what
    was removed; logs each at WARNING (the shared memory it gave back). Also removes
    indexes and control sockets whose arena file is gone."""
    removed = []
    for path in _arena_files(memory_dir):
        if keep is not None and _same_file(path, keep):
            continue
        info, fd = _inspect_locked(path, decide=True)
        if fd is None or info is None:
            continue
        try:
            if info.state == ORPHAN or (include_unowned and info.state == UNOWNED):
                _remove(path)
                removed.append(info)
                log.warning("removed the orphaned arena %s (%d bytes): %s", path, info.size, info.reason)
        finally:
            os.close(fd)
    try:
        names = os.listdir(memory_dir)
    except FileNotFoundError:
        names = []
    for name in names:
        if not name.startswith(fmt.ARENA_PREFIX):
            continue
        if name.endswith(fmt.ARENA_SUFFIX + fmt.INDEX_SUFFIX):
            arena = memory_dir / name[: -len(fmt.INDEX_SUFFIX)]
        elif name.endswith(fmt.SOCKET_SUFFIX):
            arena = (memory_dir / name).with_suffix(fmt.ARENA_SUFFIX)
        else:
            continue
        if not arena.exists() and (keep is None or arena.name != keep.name):
            leftover = memory_dir / name
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            log.info("removed %s: its arena is gone", leftover)
    return removed

"""The arena file mapped once per process: `Mapping`, shared by every client in the
process that uses one daemon run's arena (`MAPPINGS` holds and counts them)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore import arena_format as fmt
from kvstore_client._shared import Shared

if TYPE_CHECKING:
    import torch

Call = Callable[..., Any]
"""call(method, request, timeout=None) -> response: a unary KVStore RPC (raises
KVStoreError); call(method, request, background=True) sends it and returns None at once
(a failure is logged)."""


class ArenaUnavailable(Exception):
    """The arena cannot be used now; the message says why (callers use gRPC)."""


# ---- the mapping, once per process -----------------------------------------------------
class Mapping:
    """One arena file mapped into this process, shared by every client in it that uses
    this daemon run's arena (`MAPPINGS` counts them). When the last one lets go (closed,
    or moved on to a restarted daemon's arena), the mapping leaves the registry and runs
    its `on_close` callbacks; it is unmapped once no view of it is left (a
    pinned view handed to the caller keeps it). Until then, the pages of an arena file
    the daemon already removed stay allocated (in /dev/shm: memory)."""

    def __init__(self, path: Path, size: int, store_id: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot open {path}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if st.st_size != size:
                raise ArenaUnavailable(f"{path} is not the size the daemon reports")
            self._file_id = (st.st_dev, st.st_ino)
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise ArenaUnavailable(f"cannot map {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        self.path = path
        self.size = size
        self.store_id = store_id
        self.view = memoryview(self._mmap)
        self._tensor: torch.Tensor | None = None
        self._on_close: list[Callable[[], None]] = []
        self._closed = False
        self._lock = threading.Lock()
        if not self.current():
            raise ArenaUnavailable(
                f"{path} belongs to another daemon run than the one at this address "
                "(another host, or another /dev/shm)"
            )

    def current(self) -> bool:
        """Whether the daemon run that offered this file still owns it, and it is still
        the file at its path: a daemon stopped cleanly removes its arena, and the next run
        makes a new file there (this mapping's header then still names the old run)."""
        try:
            if fmt.Header.unpack(self.view[: fmt.HEADER_BYTES]).store_id != self.store_id:
                return False
            st = os.stat(self.path)
        except (fmt.ArenaFormatError, OSError):
            return False
        return (st.st_dev, st.st_ino) == self._file_id

    def tensor(self) -> torch.Tensor:
        """The whole arena as one uint8 tensor (made once)."""
        with self._lock:
            if self._tensor is None:
                import torch

                self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
            return self._tensor

    def on_close(self, callback: Callable[[], None]) -> bool:
        """Call `callback` when the mapping's last client lets go (to undo what the caller did
        to the mapping: a CUDA registration, a pre-fault thread). False, and never called:
        the mapping is closed already."""
        with self._lock:
            if self._closed:
                return False
            self._on_close.append(callback)
            return True

    def close(self) -> None:
        """Its last client let go: run the `on_close` callbacks. The pages are unmapped when
        the last view of them goes."""
        with self._lock:
            self._closed = True
            callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()


def _same_path(new: tuple[str, str], old: tuple[str, str]) -> bool:
    return new[0] == old[0]


MAPPINGS: Shared[tuple[str, str], Mapping] = Shared(Mapping.close, replaces=_same_path)
"""The process's arena mappings by (path, daemon run id), shared by its clients:
`MAPPINGS.hold(key, lambda: Mapping(path, size, store_id))`, then `MAPPINGS.let_go(mapping)`.
A newer run's mapping of a path replaces older runs' for new clients (a restarted daemon
reuses the path); their users let go of theirs as they notice the restart."""

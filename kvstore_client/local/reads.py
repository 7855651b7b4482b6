"""LocalReads: the same-host fast path's negotiation and its shared open files (see
kvstore_client.local), and LocalSource, the LayerSource over a snapshot of them."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NoReturn

from kvstore import wire
from kvstore.blocks import (
    STOP_UNKNOWN,
    LayerSpec,
    StorageError,
    StoredBlock,
    checksum,
    leading_blocks,
    subset_indices,
)
from kvstore.host import pid_namespace
from kvstore.layouts import STORE_ID_FILE
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client._shared import Shared
from kvstore_client.local.readers import Reader, open_reader

log = logging.getLogger(__name__)


class LocalUnavailable(Exception):
    """The fast path cannot be used now; the message says why (callers use Get)."""


class _Files:
    """One daemon run's backend, opened read-only once per process and shared (`_OPEN_FILES`).

    LMDB forbids opening one environment twice in a process, and a vLLM engine
    has a client in its scheduler and one in its worker. Retired when no client
    holds it (or a read broke it); closed once retired and no read is in flight.
    """

    def __init__(self, reader: Reader, data_dir: Path, store_id: str) -> None:
        self.reader = reader
        self.data_dir = data_dir
        self.store_id = store_id
        self._lock = threading.Lock()
        self._active = 0
        self.retired = False

    def acquire(self) -> bool:
        with self._lock:
            if self.retired:
                return False
            self._active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._active -= 1
            close = self.retired and self._active == 0
        if close:
            self.reader.close()

    def retire(self) -> None:
        """No new reads; the files close when the last one ends."""
        with self._lock:
            if self.retired:
                return
            self.retired = True
            close = self._active == 0
        if close:
            self.reader.close()

    def current(self) -> bool:
        """Whether the daemon that published store_id still runs on this directory."""
        try:
            return (self.data_dir / STORE_ID_FILE).read_text() == self.store_id
        except OSError:
            return False


_OPEN_FILES: Shared[tuple[str, str, str], _Files] = Shared(_Files.retire)
"""The process's opened backends by (backend kind, resolved data directory, daemon run
id), shared by its LocalReads: held in `LocalReads._open`, let go of when the daemon
restarts, a read breaks them (`broken`: retired for everyone) or the client closes."""


class LocalSource:
    """A LayerSource (kvstore_client.streams) over blocks read in one snapshot of the files.

    Chunks are views into the snapshot (an LMDB map), one per block and layer,
    each verified against its checksum just before it is handed out (while the
    caller's copy will find it in cache). A mismatch is reported to the daemon
    (`report`, which has it verify and remove the block) and ends the stream
    with LocalDataCorrupt. The snapshot ends when the stream is exhausted,
    cancelled (at the reader's next chunk: never under a copy in progress) or
    dropped.
    """

    def __init__(
        self,
        files: _Files,
        stack: ExitStack,
        blocks: list[StoredBlock],
        report: Callable[[bytes], None],
        subset: Sequence[int] = (),
        stop_reason: str = STOP_UNKNOWN,
    ) -> None:
        """`subset`: stream only this layer subset of the blocks' layers (chunks count within it);
        `stop_reason`: why `blocks` stop short of the request (kvstore.blocks.STOP_*)."""
        self.stop_reason = stop_reason
        self._files = files
        self._stack: ExitStack | None = stack
        self._blocks = blocks
        self._report = report
        self._cancelled = False
        self.num_blocks = len(blocks)
        stored = blocks[0].meta.layers if blocks else ()
        self._subset_indices = subset_indices(subset, len(stored)) if blocks else []
        self.layers: list[LayerSpec] = [stored[k] for k in self._subset_indices]

    def chunks(self) -> Iterator[wire.Chunk]:
        """Every (layer, block) view in stream order, each verified just before it is yielded."""
        try:
            chunk, digest, blocks = wire.Chunk, checksum, self._blocks
            for position, layer in enumerate(self._subset_indices):
                for index, block in enumerate(blocks):
                    if self._cancelled:
                        raise errors.StoreTimeout("local read cancelled")
                    view = block.layers[layer]
                    if digest(view) != block.meta.checksums[layer]:
                        self._corrupt(block, layer)
                    yield chunk(position, index, view)
        finally:
            self.release()

    def _corrupt(self, block: StoredBlock, layer: int) -> NoReturn:
        what = (
            f"block {block.meta.block_hash.hex()} layer {block.meta.layers[layer].name!r} fails its checksum"
        )
        log.warning("%s: reported to the daemon", what)
        self.release()
        self._report(block.meta.block_hash)
        raise errors.LocalDataCorrupt(what)

    def release(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            self._blocks = []
            stack.close()
            self._files.release()

    def cancel(self) -> None:
        # Only a flag: the thread iterating may be copying from the snapshot now.
        self._cancelled = True

    def __del__(self) -> None:
        self.release()


class LocalReads:
    """A client's same-host fast path: negotiated lazily, re-negotiated after changes.

    Never waits on another thread's negotiation: while one runs, other calls
    answer None (the caller uses gRPC).
    """

    def __init__(
        self,
        access: Callable[[], pb.LocalAccessResponse],
        report: Callable[[bytes, bytes], None],
        data_dir: str | Path | None = None,
        retry_interval: float = 30.0,
    ) -> None:
        """`access` calls the daemon's LocalAccess (with a short deadline); `report(namespace,
        block_hash)` has the daemon read one block (it verifies, removes and counts a bad
        one); `data_dir` overrides where this process sees the daemon's data directory
        (e.g. a volume mounted at another path)."""
        self._access = access
        self._report = report
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._retry_interval = retry_interval
        self._lock = threading.Lock()
        self._files: _Files | None = None
        self._prefix = b""  # this client's tenant prefix, from LocalAccess
        self._fleet = False  # the daemon has a fleet tier (LocalAccess)
        self._negotiating = False
        self._next_try = 0.0
        self._reason: str | None = None  # why the path is off, logged once per reason
        self._closed = False

    @property
    def data_dir(self) -> Path | None:
        """Where blocks are read from now, or None while the fast path is off."""
        files = self._files
        return files.data_dir if files is not None else None

    def lookup(self, namespaces: Sequence[bytes], hashes: Sequence[bytes]) -> int | None:
        """The prefix of `hashes` stored in every one of `namespaces`, or None: ask the daemon."""
        if len(namespaces) > wire.MAX_LOOKUP_NAMESPACES:
            return None
        files = self._acquire(namespaces, hashes)
        if files is None:
            return None
        try:
            n = len(hashes)
            for namespace in namespaces:
                n = files.reader.stored_prefix([(self._prefix + namespace, h) for h in hashes[:n]])
        except StorageError as exc:
            files.release()
            self._broken(files, f"local lookup failed: {exc}")
            return None
        files.release()
        if self._fleet and n < len(hashes):
            return None  # the rest may be in the fleet: the daemon knows
        return n

    def stream_source(
        self, namespace: bytes, hashes: Sequence[bytes], subset: Sequence[int] = ()
    ) -> LocalSource | None:
        """A verified snapshot of the stored prefix of `hashes` (of layer subset `subset`
        only, when given), or None: use Get."""
        files = self._acquire([namespace], hashes)
        if files is None:
            return None
        stack = ExitStack()
        try:
            keys = [(self._prefix + namespace, h) for h in hashes]
            # NOTE: checksums are verified per chunk, just before the caller copies it
            # (LocalSource.chunks), so the bytes are read from memory once, not twice.
            prefix = leading_blocks(stack.enter_context(files.reader.read(keys)), verify=False)
            good = prefix.blocks
        except StorageError as exc:
            stack.close()
            files.release()
            self._broken(files, f"local read failed: {exc}")
            return None
        if self._fleet and len(good) < len(hashes):  # the rest may be in the fleet
            stack.close()
            files.release()
            return None
        try:
            return LocalSource(
                files, stack, good, functools.partial(self._report, namespace), subset, prefix.stop_reason()
            )
        except ValueError:
            stack.close()
            files.release()
            raise

    def _acquire(self, namespaces: Sequence[bytes], hashes: Sequence[bytes]) -> _Files | None:
        """The files, held for one read; None: use gRPC (which also answers bad input)."""
        if (
            len(hashes) > wire.MAX_BLOCKS_PER_LOOKUP
            or any(len(h) != wire.HASH_BYTES for h in hashes)
            or not all(0 < len(ns) <= wire.MAX_NAMESPACE_BYTES for ns in namespaces)
        ):
            return None
        files = self._current()
        return files if files is not None and files.acquire() else None

    def _current(self) -> _Files | None:
        with self._lock:
            if self._closed:
                return None
            files = self._files
            if files is not None:
                if not files.retired and files.current():
                    return files
                self._files = None  # the daemon restarted (or a read broke): ask again now
                self._next_try = 0.0
                _OPEN_FILES.let_go(files)
            if self._negotiating or time.monotonic() < self._next_try:
                return None
            self._negotiating = True
            self._next_try = time.monotonic() + self._retry_interval
        opened, prefix = None, b""
        try:
            opened, prefix = self._open()
        except LocalUnavailable as exc:
            self._note(str(exc))
        with self._lock:
            self._negotiating = False
            if opened is not None and self._closed:
                _OPEN_FILES.let_go(opened)
                return None
            self._files, self._prefix = opened, prefix
        if opened is not None:
            self._reason = None
            log.info("reading stored blocks directly from %s (same host)", opened.data_dir)
        return opened

    def _open(self) -> tuple[_Files, bytes]:
        try:
            resp = self._access()
        except errors.KVStoreError as exc:
            raise LocalUnavailable(f"the daemon does not offer local reads: {exc}") from exc
        data_dir = self._data_dir or Path(resp.data_dir)
        try:
            seen = (data_dir / STORE_ID_FILE).read_text()
        except OSError as exc:
            raise LocalUnavailable(f"cannot read {data_dir / STORE_ID_FILE}: {exc}") from exc
        if seen != resp.store_id:
            raise LocalUnavailable(
                f"{data_dir} belongs to another daemon run than the one at this address "
                "(another host, or another directory)"
            )
        if resp.backend == "lmdb" and resp.pid_namespace != pid_namespace():
            raise LocalUnavailable(
                "the daemon runs in another PID namespace, where LMDB cannot track this reader "
                '(containers: share it, e.g. pid: "service:kvstore")'
            )
        self._fleet = resp.fleet
        kind, store_id = resp.backend, resp.store_id
        try:
            files = _OPEN_FILES.hold(
                (kind, str(data_dir.resolve()), store_id),
                lambda: _Files(open_reader(kind, data_dir), data_dir, store_id),
            )
        except (StorageError, ValueError) as exc:
            raise LocalUnavailable(str(exc)) from exc
        return files, bytes(resp.namespace_prefix)

    def _note(self, reason: str) -> None:
        if reason != self._reason:
            self._reason = reason
            log.info("local reads off, using Get: %s", reason)

    def _broken(self, files: _Files, reason: str) -> None:
        log.warning("%s; using Get", reason)
        with self._lock:
            mine = self._files is files  # else another thread already let go of it
            if mine:
                self._files = None
                self._next_try = time.monotonic() + self._retry_interval
        if mine:
            _OPEN_FILES.let_go(files, broken=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            files, self._files = self._files, None
        if files is not None:
            _OPEN_FILES.let_go(files)

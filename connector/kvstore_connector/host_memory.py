"""The daemon's arena, as the connector copies through it: pre-faulted, and on CUDA
registered with the driver.

The client maps the arena (kvstore_client.arena) and leaves its pages alone. A worker
that copies KV through it wants them ready first: on CUDA the mapping is registered
with the driver once per process (cudaHostRegister, in chunks: one registration of
512 GiB or more fails; it faults every page in, too), so copies between the GPU and
the arena run at pinned-memory speed; on CPU it is pre-faulted on a background thread
(the daemon allocated the pages, but each first touch here would still cost a fault:
a first copy into a fresh 64 MiB extent ran at a fifth of the speed of a second).

A mapping is prepared once, however many clients in the process use it; a daemon
restart brings a new mapping, prepared when the transport first meets it. When the
mapping's last client lets go, the registration ends with it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

from kvstore.memory import populate_mapping
from kvstore_client import KVStoreClient
from kvstore_client.arena import Mapping

log = logging.getLogger("vllm." + __name__)

# cudaHostRegister of 512 GiB or more at once fails on current drivers.
_CUDA_REGISTER_CHUNK = 256 << 30


class _Prepared:
    """What this process did to one mapping: its pre-fault thread, its CUDA registrations."""

    def __init__(self, mapping: Mapping) -> None:
        # not the mapping itself: _PREPARED holds this strongly, and must not keep its key
        self._base = mapping.tensor().data_ptr()
        self._size = mapping.size
        self._prefaulter: threading.Thread | None = None
        self._cuda = False
        self._registered: list[tuple[int, int]] = []  # (address, size) registered with CUDA
        self._closed = False
        self._lock = threading.Lock()
        self._cuda_lock = threading.Lock()  # not _lock: the pre-fault can start during a registration

    def prefault(self) -> None:
        def run() -> None:
            started = time.perf_counter()
            if populate_mapping(self._base, self._size, stop=lambda: self._closed):
                log.debug("arena pre-faulted in %.2fs", time.perf_counter() - started)

        with self._lock:
            if self._prefaulter is not None or self._closed:
                return
            self._prefaulter = threading.Thread(target=run, name="kvstore-arena-prefault", daemon=True)
            self._prefaulter.start()

    def register_cuda(self) -> None:
        """A failure is logged; copies then still work, slower."""
        with self._cuda_lock:
            if self._cuda or self._closed:
                return
            self._cuda = True
            cudart = torch.cuda.cudart()
            started = time.perf_counter()
            for offset in range(0, self._size, _CUDA_REGISTER_CHUNK):
                size = min(_CUDA_REGISTER_CHUNK, self._size - offset)
                err = cudart.cudaHostRegister(self._base + offset, size, 0)
                if int(err) != 0:
                    log.warning("cudaHostRegister of the arena failed (%s); copies will be slower", err)
                    return
                self._registered.append((self._base + offset, size))
        log.info(
            "registered the %d MiB arena with CUDA in %.2fs", self._size >> 20, time.perf_counter() - started
        )

    def close(self) -> None:
        """The mapping's last client let go: stop pre-faulting and unregister it from CUDA
        (copies through views still alive then run at pageable speed)."""
        with self._lock:
            self._closed = True
            prefaulter = self._prefaulter
        if prefaulter is not None:
            prefaulter.join()  # it stops after the chunk in progress
        with self._cuda_lock:
            registered, self._registered = self._registered, []
        if registered:
            cudart = torch.cuda.cudart()
            for address, _size in registered:
                err = cudart.cudaHostUnregister(address)
                if int(err) != 0:
                    log.warning("cudaHostUnregister of the arena failed (%s)", err)


_PREPARED: weakref.WeakKeyDictionary[Mapping, _Prepared] = weakref.WeakKeyDictionary()
_PREPARED_LOCK = threading.Lock()


def prepare(mapping: Mapping, *, cuda: bool) -> None:
    """Make `mapping` ready for copies, once per process: registered with CUDA (`cuda`),
    else pre-faulted in the background. A mapping already closed is left alone."""
    with _PREPARED_LOCK:
        prepared = _PREPARED.get(mapping)
        if prepared is None:
            prepared = _Prepared(mapping)
            if not mapping.on_close(prepared.close):  # its last client let go meanwhile
                return
            _PREPARED[mapping] = prepared
    if cuda:
        prepared.register_cuda()  # which faults every page in, too
    else:
        prepared.prefault()


def prepare_arena(client: KVStoreClient, *, cuda: bool) -> bool:
    """Whether the client's KV can move through the daemon's arena now (mapping it if not
    yet); if so, the mapping is prepared (see `prepare`)."""
    mapping = client.arena_mapping()
    if mapping is None:
        return False
    prepare(mapping, cuda=cuda)
    return True

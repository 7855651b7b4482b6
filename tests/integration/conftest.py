"""Which server a test gets, and on which backend.

- `server` / `make_server`: a real server on a real port and real backend files, in
  this process (tests/support/inproc.py); a fresh one per test (about 5 ms to start
  and stop). The default for everything that needs no process of its own.
- `daemon` / `make_daemon` (tests/conftest.py): a `kvstore-server` subprocess, for what
  needs the process: signals (SIGTERM, SIGKILL, SIGSTOP pauses), restarts after a kill,
  the stdout ready line, command-line start-up failures, an installed command talking
  to a daemon, and same-host local reads (a second process reading the store's files:
  LMDB may be opened only once per process).
- `kv`: a client of `server` over gRPC (arena=False: these tests are about the RPCs and the
  persistent tier's files); tests/integration/test_memory_tier.py covers the same calls
  through the arena.

`backend` is "lmdb" here; a test whose behaviour depends on the backend (files on disk,
durability, corruption, capacity accounting, what a block reads back as) runs on both
with `@both_backends` (tests/integration/helpers.py), which overrides this fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.inproc import InProcServer

from kvstore_client import KVStoreClient


@pytest.fixture
def backend() -> str:
    """The default backend; `@both_backends` parametrizes it over every backend."""
    return "lmdb"


@pytest.fixture
def server(tmp_path: Path, backend: str) -> Iterator[InProcServer]:
    """A running in-process server on a free port with a fresh data dir."""
    s = InProcServer(tmp_path / "data", backend=backend).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def make_server(tmp_path: Path, backend: str) -> Iterator[Callable[..., InProcServer]]:
    """Factory for in-process servers: make("name", capacity=..., other ServerConfig
    fields as keywords); all are stopped at teardown."""
    started: list[InProcServer] = []

    def make(name: str = "data", *, capacity: str | int = "1GiB", **settings: object) -> InProcServer:
        s = InProcServer(tmp_path / name, backend=backend, capacity=capacity, settings=settings)
        started.append(s)
        return s.start()

    yield make
    for s in reversed(started):
        s.stop()


@pytest.fixture
def kv(server: InProcServer) -> Iterator[KVStoreClient]:
    """A client of the per-test in-process server, over gRPC."""
    with KVStoreClient(server.address, timeout=20.0, arena=False) as client:
        yield client


@pytest.fixture
def daemon_kv(daemon) -> Iterator[KVStoreClient]:
    """A client of the per-test subprocess daemon (for tests that need its process), over gRPC."""
    with KVStoreClient(daemon.address, timeout=20.0, arena=False) as client:
        yield client

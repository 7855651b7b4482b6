from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from support.daemon import Daemon
from support.redis_cluster import Cluster

# Property tests: no per-example deadline (a shared 2-core machine stalls at times);
# under CI the examples are derandomized, so a run is repeatable from its commit.
settings.register_profile("kvstore", deadline=None, derandomize=os.environ.get("CI") == "true")
settings.load_profile("kvstore")


@pytest.fixture(scope="session", autouse=True)
def _vllm_files_in_a_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """vLLM engines (here and in their subprocesses) make their IPC sockets, torch's
    file stores and inductor's cache in the session's temp dir, not /tmp, where about
    a hundred files and 300 MB would stay behind per run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-ipc")))
        tmp = tmp_path_factory.mktemp("tmp")
        mp.setenv("TMPDIR", str(tmp))  # read by subprocesses' tempfile
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor"))  # read when used, here too
        yield


@pytest.fixture(params=["lmdb", "disk"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def daemon(tmp_path: Path, backend: str) -> Iterator[Daemon]:
    """A running daemon on a free port with a fresh data dir, for each backend."""
    d = Daemon(tmp_path / "data", backend=backend).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def make_daemon(tmp_path: Path, backend: str) -> Iterator:
    """Factory for daemons with custom settings; all are stopped at teardown."""
    started: list[Daemon] = []

    def make(name: str = "data", **kwargs: object) -> Daemon:
        d = Daemon(tmp_path / name, backend=backend, **kwargs)  # type: ignore[arg-type]
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A real 3-master Redis Cluster for the fleet tier, shared by the session (tests use
    their own key prefixes, or flush it)."""
    c = Cluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield c
    finally:
        c.stop()

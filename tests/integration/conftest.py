from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore_client import KVStoreClient


@pytest.fixture
def kv(daemon) -> Iterator[KVStoreClient]:  # noqa: ANN001 - the `daemon` fixture of tests/conftest.py
    """A client of the per-test daemon (both backends)."""
    with KVStoreClient(daemon.address, timeout=20.0) as client:
        yield client

# --- TEMP DIAGNOSTIC
import os, signal, subprocess
os.environ["PYTHONFAULTHANDLER"] = "1"
import daemon as _dm
_orig_stop = _dm.Daemon.stop
def _stop(self, sig=signal.SIGTERM, timeout=30.0):
    if self.proc is not None and self.proc.poll() is None and sig == signal.SIGTERM:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT); self.proc.wait()
            open("/tmp/hang.log", "a").write("=====HANG " + str(self.data_dir) + "\n" + self.log())
    return _orig_stop(self, sig, timeout)
_dm.Daemon.stop = _stop

"""Start a real kvstore-server process for tests and benches: free port, temp data dir."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY_TIMEOUT = 30.0


def stop_daemon(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Send `sig` to a daemon process and wait for its exit status (SIGKILL if it has not
    exited within `timeout`); its stdout pipe is closed."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Daemon:
    """A kvstore-server subprocess. `address` is valid once started."""

    data_dir: Path
    backend: str = "lmdb"
    capacity: str = "1GiB"
    # the memory tier: small, and in the test's own directory (never the host's /dev/shm,
    # where arena files outlive the daemons); "0" turns it off
    memory_size: str = "64MiB"
    memory_dir: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    wrap: list[str] = field(default_factory=list)  # command prefix, e.g. ["unshare", ...]
    proc: subprocess.Popen[str] | None = None
    address: str = ""
    ready_line: str = ""
    # with extra_args ["--metrics-port", "0"]: the endpoint from the ready line
    metrics_url: str = ""

    def start(self) -> Daemon:
        cmd = [
            *self.wrap,
            sys.executable,
            "-m",
            "kvstore_server",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(self.data_dir),
            "--backend",
            self.backend,
            "--capacity",
            self.capacity,
            "--memory",
            self.memory_size,
            "--memory-dir",
            str(self.memory_dir or self.data_dir.parent / f"{self.data_dir.name}-shm"),
            *self.extra_args,
        ]
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        log = open(self.log_path, "a")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **self.env}
        )
        log.close()
        # The daemon prints exactly one line on stdout when it serves; reading it
        # is the synchronisation (no sleeps, no polling).
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("kvstore-server ready on "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"daemon did not start: {line!r}; log:\n{self.log_path.read_text()}")
        self.ready_line = line.strip()
        self.address = line.split()[3]
        metrics = re.search(r"metrics=(http://\S+?)\)?$", self.ready_line)
        self.metrics_url = metrics.group(1) if metrics else ""
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        rc = stop_daemon(self.proc, sig, timeout)
        self.proc = None
        return rc

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> Daemon:
        self.stop()
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text()

    def pause(self) -> None:
        """SIGSTOP, and return once every thread has stopped: kill() only queues the
        signal, and a thread that runs on for a moment could still answer a call."""
        if self.proc is None:
            raise RuntimeError("the daemon is not running")
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        eventually(lambda: all(_thread_state(pid, task) == "T" for task in os.listdir(f"/proc/{pid}/task")))

    def resume(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def memory(self) -> dict[str, int]:
        """The process's VmRSS, VmHWM (peak RSS), RssAnon and RssFile, in bytes."""
        if self.proc is None:
            raise RuntimeError("the daemon is not running")
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
        return out


def _thread_state(pid: int, task: str) -> str:
    """One thread's state letter (R, S, T, ...); a thread that has exited counts as stopped."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "T"


def eventually(check: Callable[[], bool], deadline_s: float = 20.0) -> None:
    """For what the daemon does after a client's call returned (a cancelled stream's
    cleanup, a Lookup a same-host client sends in the background): poll until true."""
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, "condition not reached"


def settled(kv: Any) -> None:
    """Write-behind holds the extents it writes out: before asserting that nothing is
    pinned, wait until it has written what was saved and let go."""
    eventually(lambda: (s := kv.stats())["write_behind_blocks"] == 0 and s["pinned_bytes"] == 0)

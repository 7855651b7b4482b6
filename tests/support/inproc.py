"""A real kvstore server inside the test process: same gRPC server, Store and backend
files as the daemon, bound to 127.0.0.1:0, without the process around it.

`InProcServer` does what `kvstore_server.main.main()` does between its ready line and
its exit: it takes the data directory's lock (DataDir: one server per directory, the
clean/unclean STATE record), opens the backend and the Store, builds the server with
`create_server` (STORE_ID published for local reads, the event log, the idle reclaim
thread, metrics when `metrics_port` is set, tokens and TLS from the config), starts the
Prometheus endpoint if asked, and on `stop()` shuts down in the daemon's order
(NOT_SERVING, DropSelect waiters released, Watch streams ended, the gRPC server stopped
with the configured grace, then the reclaim thread, the metrics endpoint, the store and
the data directory, recorded as a clean stop).

What it leaves to the subprocess `tests/support/daemon.Daemon`: signals (SIGTERM/SIGKILL/
SIGSTOP), the stdout ready line, command-line parsing, start-up failures as exit codes,
the process's memory and malloc tuning (process-wide settings are not applied here),
and anything where a second process must read the files (LMDB may be opened only once
per process, so same-host local reads of an LMDB store need the daemon in its own
process).

`log()` returns what the server logged (the `kvstore_server` and `grpc` loggers, in the
daemon's log format) while it ran; with two servers running at once in one test, each
one's log holds both servers' lines.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_server.config import ServerConfig
from kvstore_server.datadir import DataDir
from kvstore_server.main import Running, create_server, open_store
from kvstore_server.metrics import MetricsServer

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_LOGGERS = ("kvstore_server", "grpc")


class _Collect(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter(_LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _raise_open_files_limit() -> None:
    """As the daemon does: the disk backend maps each block file a Get reads."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class InProcServer:
    """A server in this process. `address` is valid once started; `settings` are any
    other ServerConfig fields (e.g. max_put_bytes="4KiB", token_file=path)."""

    data_dir: Path
    backend: str = "lmdb"
    capacity: str | int = "1GiB"  # the Daemon helper's default
    settings: dict[str, Any] = field(default_factory=dict)
    config: ServerConfig | None = None
    running: Running | None = None
    address: str = ""
    metrics_url: str = ""
    _datadir: DataDir | None = None
    _metrics_http: MetricsServer | None = None
    _log: _Collect | None = None
    _levels: dict[str, int] = field(default_factory=dict)
    _lines: list[str] = field(default_factory=list)

    def start(self) -> InProcServer:
        if self.running is not None:
            raise RuntimeError("the server is already running")
        settings = {
            # the memory tier: small, and in the test's own directory (never the host's
            # /dev/shm, where arena files outlive their daemons)
            "memory": "64MiB",
            "memory_dir": self.data_dir.parent / f"{self.data_dir.name}-shm",
            **self.settings,
        }
        config = ServerConfig(
            listen="127.0.0.1:0",
            data_dir=self.data_dir,
            backend=self.backend,
            capacity=self.capacity,  # type: ignore[arg-type]  # parsed by ServerConfig
            **settings,
        )
        problem = config.exposure_problem()
        if problem is not None:
            raise ValueError(problem)
        self.config = config
        self._capture_log(config.log_level)
        _raise_open_files_limit()
        datadir = DataDir(config.data_dir, sync=config.sync)
        try:
            store = open_store(config, rebooted=datadir.rebooted)
        except BaseException:
            datadir.close(sync=config.sync, clean=False)
            self._release_log()
            raise
        try:
            running = create_server(config, store)
        except BaseException:
            store.close()
            datadir.close(sync=config.sync)
            self._release_log()
            raise
        try:
            if running.metrics is not None and config.metrics_port is not None:
                self._metrics_http = MetricsServer.start(
                    running.metrics.registry, config.metrics_host, config.metrics_port
                )
                self.metrics_url = self._metrics_http.url
        except BaseException:
            running.close()
            store.close()
            datadir.close(sync=config.sync)
            self._release_log()
            raise
        running.server.start()
        self.running = running
        self._datadir = datadir
        self.address = f"127.0.0.1:{running.port}"
        return self

    def is_serving(self) -> bool:
        """Started and not stopped (what `Daemon.proc.poll() is None` says of a process)."""
        return self.running is not None

    def stop(self) -> None:
        """The daemon's shutdown after SIGTERM; a stopped server is left as it is."""
        running, config, datadir = self.running, self.config, self._datadir
        if running is None or config is None or datadir is None:
            return
        self.running = None
        try:
            running.stop(config.grace_seconds)
            running.close()
            if self._metrics_http is not None:
                self._metrics_http.close()
                self._metrics_http = None
            running.store.close()
            datadir.close(sync=config.sync)
        finally:
            self._datadir = None
            self._release_log()

    def restart(self) -> InProcServer:
        """A new server run on the same directory and settings (a new STORE_ID)."""
        self.stop()
        return self.start()

    def log(self) -> str:
        """Everything logged while this server ran (all its runs so far)."""
        current = self._log.lines if self._log is not None else []
        return "".join(line + "\n" for line in [*self._lines, *current])

    def _capture_log(self, level_name: str) -> None:
        level = logging.getLevelName(level_name.upper())
        self._log = _Collect(level)
        for name in _LOGGERS:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(level)
            logger.addHandler(self._log)

    def _release_log(self) -> None:
        if self._log is None:
            return
        for name in _LOGGERS:
            logger = logging.getLogger(name)
            logger.removeHandler(self._log)
            logger.setLevel(self._levels.pop(name, logging.NOTSET))
        self._lines += self._log.lines
        self._log = None

"""Entry point of `kvstore-server`.

    kvstore-server [--listen HOST:PORT] [--data-dir DIR] [--backend lmdb|disk]
                   [--capacity SIZE] [--sync] [--metrics-port PORT] [--token-file FILE]
                   [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]] [--insecure]
                   [--config FILE] [--print-config]

`create_server(config, store)` builds a server bound to its port without
starting signal handling, so tests can run one in-process on port 0: the run's parts
(kvstore_server.daemon.RunParts: the store id, the event log, the KV events publisher,
the idle reclaim) are made there and handed to the Servicer. `main()` closes all it
opened with one ExitStack.

Stdout carries exactly one line, once the daemon serves:
    kvstore-server ready on HOST:PORT (backend=..., data_dir=..., capacity=...[, metrics=URL])
Everything else goes to the log (stderr).

NOTE: over 500 lines: the daemon's run from flags to clean stop, in start order
(config, process settings, data directory, store, server, signals, shutdown); `_serve`
undoes what open_store and create_server open, in reverse, with one ExitStack.
"""

from __future__ import annotations

import argparse
import errno
import gc
import grp
import logging
import resource
import signal
import socket
import sys
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import wire
from kvstore.arena_format import socket_path
from kvstore.memory import limit_arenas, tune_malloc
from kvstore.service import SERVICE_NAME
from kvstore.sizes import attach_values, format_size, parse_size
from kvstore_server import __version__
from kvstore_server.auth import TokenTable
from kvstore_server.config import SIZE_SETTINGS, ServerConfig
from kvstore_server.daemon import RunParts
from kvstore_server.datadir import DataDir, publish_store_id
from kvstore_server.errors import DataDirInUse, ListenError
from kvstore_server.events import EventLog
from kvstore_server.metrics import Metrics, MetricsServer
from kvstore_server.rpc import Servicer, generic_handler
from kvstore_server.rpc.auth import AuthInterceptor, Scope
from kvstore_server.rpc.control import ControlSocket
from kvstore_server.rpc.metrics import MetricsInterceptor
from kvstore_server.store import Store
from kvstore_server.tiers import StorageError, open_backend
from kvstore_server.tiers.arena import discard_memory_tier, open_memory_tier, sweep_memory_dir
from kvstore_server.tiers.fleet import FleetSettings, FleetTier

log = logging.getLogger("kvstore_server")

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_MALLOC_ARENAS = 2
_READ_AHEAD = 2 << 20
# CPython's switch interval (5 ms by default): how long a thread that wants the GIL waits
# before the thread running Python must let it go. Each of the persistent tier's I/O
# threads wants it back once per read; a promotion of 128 blocks (268 MB) from the page
# cache on a 16-core H100 host read its last block after 16.6 ms at 5 ms, 13.3 ms at
# 1 ms (bench/bench_promotion.py, results/promotion_h100_run1.txt)
_SWITCH_INTERVAL_S = 0.001
# Freed heap kept for reuse under load (the rest goes back to the kernel at once).
_MALLOC_KEEP_FREE = 64 << 20


@dataclass
class Running:
    """A server made by create_server: bound, not yet started. `stop` then `close` end it;
    `close` alone, one never started."""

    server: grpc.Server
    port: int
    health: health.HealthServicer
    store: Store
    parts: RunParts  # the store id, the event log, the KV events publisher, the idle reclaim
    servicer: Servicer
    # None unless config.metrics_port is set; serving them over HTTP is main()'s job
    metrics: Metrics | None = None

    @property
    def control_socket(self) -> ControlSocket | None:
        """Where clients are offered the arena (the servicer offers it in ArenaAccess)."""
        return self.servicer.control

    @property
    def events(self) -> EventLog:
        return self.parts.events

    def stop(self, grace: float) -> None:
        """The daemon's shutdown: NOT_SERVING, DropSelect waiters and Watch streams released,
        then the server stopped once in-flight calls finish (at most `grace` seconds)."""
        self.health.enter_graceful_shutdown()
        self.store.begin_shutdown()
        self.parts.events.close()  # Watch streams end now (UNAVAILABLE), not at the grace deadline
        self.server.stop(grace).wait()
        if self.control_socket is not None:
            self.control_socket.close()

    def close(self) -> None:
        """The run's threads and sockets (idle reclaim, KV events, the control socket); the
        store is the caller's."""
        if self.control_socket is not None:
            self.control_socket.close()
        self.parts.close()


# Why a bind fails, by errno, as the daemon says it.
_BIND_ERRORS = {
    errno.EADDRINUSE: "the address is already in use (another kvstore-server?)",
    errno.EADDRNOTAVAIL: "no network interface of this host has that address",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def listen_problem(listen: str) -> str | None:
    """Why `listen` (HOST:PORT) cannot be bound now, as one line naming --listen, or None
    when it can: at least one of the addresses HOST resolves to binds (gRPC serves on
    those that do), or the port is 0 (any free one).

    NOTE: probed with a socket of our own, closed at once: gRPC's bind failure says only
    "Failed to bind ...; set GRPC_VERBOSITY=debug", and the errno goes to its own log."""
    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]")
    port = int(port_text)
    try:
        infos = socket.getaddrinfo(
            None if host in ("", "*") else host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return f"cannot listen on {listen}: the host {host!r} does not resolve ({exc.strerror}); fix --listen"
    if port == 0:
        return None
    failures: list[OSError] = []
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners
            try:
                sock.bind(address)
            except OSError as exc:
                failures.append(exc)
                continue
        return None
    if not failures:
        return None
    first = failures[0]
    reason = _BIND_ERRORS.get(first.errno or 0, first.strerror or str(first))
    return f"cannot listen on {listen}: {reason}; choose another with --listen"


def create_server(config: ServerConfig, store: Store, tokens: TokenTable | None = None) -> Running:
    """A bound, not yet started server for `store`, with its run's parts (RunParts);
    port 0 binds a free port.

    `tokens` (else loaded from config.token_file) turns on bearer-token auth and tenants.
    Raises ListenError when the address cannot be bound.
    """
    metrics = Metrics() if config.metrics_port is not None else None
    if tokens is None and config.token_file is not None:
        tokens = TokenTable.load(config.token_file)
    interceptors: list[grpc.ServerInterceptor] = []
    if metrics is not None:
        interceptors.append(MetricsInterceptor(metrics))  # first: refused calls are counted too
    if tokens is not None:
        interceptors.append(AuthInterceptor(tokens))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="kvstore-rpc"),
        interceptors=interceptors or None,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # NOTE: a fixed read-ahead per stream instead of BDP probing, which grows
            # each stream's flow-control window to megabytes: gRPC buffers that much of
            # every incoming Put before the daemon reads it (measured: 40 concurrent
            # Puts held ~300 MiB beyond max_inflight_put_bytes). A stream then buffers
            # at most the message being read and _READ_AHEAD, which keeps one stream of
            # 4 MiB messages as fast as with probing (bench_store.py).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", _READ_AHEAD),
            *wire.SERVER_KEEPALIVE,
        ],
    )
    parts = RunParts.create(config, store)
    with ExitStack() as undo:
        # a server that cannot bind leaves no thread or socket of its run behind
        undo.callback(parts.close)
        servicer = Servicer(store, config, parts, Scope(tokens))
        publish_store_id(config.data_dir, parts.store_id if config.offers_local_reads() else None)
        if store.memory is not None:
            store.memory.file.publish(parts.store_id)
        if metrics is not None:
            metrics.watch(store, servicer)
        handler = generic_handler(servicer)
        server.add_generic_rpc_handlers((handler,))
        control_socket = _open_control_socket(config, store, handler, interceptors, parts.store_id)
        if control_socket is not None:
            undo.callback(control_socket.close)
            servicer.control = control_socket
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        credentials = None
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
                root_certificates=config.tls_client_ca.read_bytes() if config.tls_client_ca else None,
                require_client_auth=config.tls_client_ca is not None,
            )
        try:
            if credentials is not None:
                port = server.add_secure_port(config.listen, credentials)
            else:
                port = server.add_insecure_port(config.listen)
        except RuntimeError as exc:  # "Failed to bind to address ...": find out why
            raise ListenError(
                listen_problem(config.listen) or f"cannot listen on {config.listen}: {exc}; check --listen"
            ) from exc
        if port == 0:
            raise ListenError(
                listen_problem(config.listen) or f"cannot listen on {config.listen}: gRPC bound no address"
            )
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        undo.pop_all()
    return Running(server, port, health_servicer, store, parts, servicer, metrics)


def _open_control_socket(
    config: ServerConfig,
    store: Store,
    handler: grpc.GenericRpcHandler,
    interceptors: list[grpc.ServerInterceptor],
    store_id: str,
) -> ControlSocket | None:
    """The control socket beside the arena file, where clients are offered the arena; None
    without (or when it cannot be made: clients then use gRPC for every call)."""
    if store.memory is None or not config.offers_memory():
        return None
    path = socket_path(store.memory.file.path.resolve())
    try:
        return ControlSocket(
            path, handler, interceptors, store_id,
            group=_group_id(config.memory_group), max_connections=config.workers,
        )  # fmt: skip
    except OSError as exc:
        log.warning("no control socket at %s (%s): same-host clients use gRPC for every call", path, exc)
        return None


def open_store(config: ServerConfig, *, rebooted: bool = False) -> Store:
    """The backend and, unless `memory` is 0, the memory tier in front of it; `rebooted`
    (DataDir.rebooted): an arena that outlived a reboot is discarded, not recovered.
    Raises StorageError (or OSError) when either cannot be opened."""
    backend = open_backend(config.backend, config.data_dir, capacity_bytes=config.capacity, sync=config.sync)
    memory = None
    size = config.memory_bytes()
    if rebooted:
        discard_memory_tier(config.memory_dir, config.data_dir)
    sweep_memory_dir(config.memory_dir, config.data_dir, enabled=bool(size))
    if size:
        try:
            memory = open_memory_tier(
                config.memory_dir,
                config.data_dir,
                size,
                "",
                lease_seconds=config.lease_seconds,
                write_behind_bytes=config.write_behind_bytes or size // 2,
                persist=config.persist,
                group=_group_id(config.memory_group),
            )
        except (StorageError, OSError, KeyError) as exc:
            if config.memory is not None:  # asked for: a hard error
                backend.close()
                raise StorageError(f"memory tier: {exc}") from exc
            log.warning("running without a memory tier: %s (set memory = 0 to say so)", exc)
    fleet = None
    if config.fleet is not None:
        fleet = FleetTier(
            FleetSettings(
                config.fleet,
                prefix=config.fleet_prefix.encode(),
                user=config.fleet_user,
                password_file=config.fleet_password_file,
                tls_ca=config.fleet_tls_ca,
                lookup_timeout_s=config.fleet_lookup_seconds,
                timeout_s=config.fleet_timeout_seconds,
            )
        )
    try:
        store = Store(
            backend,
            config.capacity,
            memory=memory,
            fleet=fleet,
            fleet_queue_bytes=config.fleet_queue_bytes,
            partial_bytes=config.max_partial_bytes,
            partial_timeout_s=config.lease_seconds,
        )
    except Exception:  # the caller reports it; the files are closed first
        backend.close()
        if memory is not None:
            memory.close()
        if fleet is not None:
            fleet.close()
        raise
    if memory is not None:
        log.info(
            "memory tier: %s in %s (%s)",
            format_size(memory.file.size),
            memory.file.path,
            "recovered" if not memory.file.fresh else "new",
        )
    return store


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    return grp.getgrnam(group).gr_gid  # KeyError: no such group


def _raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one: the disk backend maps each block
    file a Get reads (a mapping holds a descriptor), and a Get may read 65536 blocks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.debug("open files limit raised from %d to %d", soft, hard)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="KV-cache store daemon for disaggregated LLM serving (gRPC).",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", type=Path, help="TOML file with any of the settings below")
    p.add_argument("--listen", help="HOST:PORT to serve on (default 127.0.0.1:50051)")
    p.add_argument(
        "--data-dir", dest="data_dir", type=Path, help="data directory (default ~/.local/share/kvstore)"
    )
    p.add_argument("--backend", choices=("lmdb", "disk"), help="storage backend (default lmdb)")
    p.add_argument(
        "--capacity",
        help="byte budget on disk, e.g. 512MiB, 64GiB (default auto: a quarter of the data dir's free space)",
    )
    p.add_argument("--sync", action="store_true", help="fsync every commit (survives power loss)")
    p.add_argument("--workers", type=int, help="gRPC worker threads (default 64)")
    p.add_argument("--max-put-bytes", dest="max_put_bytes", help="largest single put (default 2GiB)")
    p.add_argument("--max-inflight-put-bytes", dest="max_inflight_put_bytes", help="default 4GiB")
    p.add_argument(
        "--max-partial-bytes", dest="max_partial_bytes",
        help="blocks put in part (tensor-parallel ranks' heads) waiting for the rest (default 2GiB)",
    )  # fmt: skip
    p.add_argument("--grace-seconds", dest="grace_seconds", type=float, help="shutdown grace (default 10)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="serve Prometheus metrics (0: any)")
    p.add_argument("--metrics-host", dest="metrics_host", help="metrics address (default 127.0.0.1)")
    p.add_argument("--event-window", dest="event_window", type=int, help="events kept for Watch (100000)")
    p.add_argument("--max-watchers", dest="max_watchers", type=int, help="Watch streams at once (16)")
    p.add_argument(
        "--token-file", dest="token_file", type=Path, help="bearer tokens, tenants and roles (TOML)"
    )
    p.add_argument("--tls-cert", dest="tls_cert", type=Path, help="PEM certificate chain: serve over TLS")
    p.add_argument("--tls-key", dest="tls_key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-client-ca", dest="tls_client_ca", type=Path, help="require client certs from this CA"
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback listen address without tokens or TLS"
    )
    p.add_argument(
        "--local-reads",
        dest="local_reads",
        action=argparse.BooleanOptionalAction,
        help="let same-host clients read data_dir directly (default: on unless --token-file)",
    )
    p.add_argument("--memory", help="memory tier size, e.g. 16GiB; 0: off (default a tenth of RAM, 1-64GiB)")
    p.add_argument("--memory-dir", dest="memory_dir", type=Path, help="where the arena file lives (/dev/shm)")
    p.add_argument("--memory-group", dest="memory_group", help="group that may map the arena (mode 0660)")
    p.add_argument(
        "--memory-clients",
        dest="memory_clients",
        action=argparse.BooleanOptionalAction,
        help="let same-host clients map the arena (default: on unless --token-file)",
    )
    p.add_argument("--lease-seconds", dest="lease_seconds", type=float, help="reservation/pin lease (30)")
    p.add_argument("--write-behind-bytes", dest="write_behind_bytes", help="write-behind queue bound")
    p.add_argument(
        "--persist",
        choices=("every", "reused"),
        help="blocks written behind to the persistent tier: every one (default) or those loaded again",
    )
    p.add_argument("--fleet", help="fleet tier: redis://HOST:PORT or redis+cluster://H1:P1,H2:P2,...")
    p.add_argument("--fleet-prefix", dest="fleet_prefix", help="prefix of every fleet key (deployments)")
    p.add_argument("--fleet-user", dest="fleet_user", help="Redis ACL user for the fleet")
    p.add_argument("--fleet-password-file", dest="fleet_password_file", type=Path, help="its password")
    p.add_argument("--fleet-tls-ca", dest="fleet_tls_ca", type=Path, help="CA bundle for rediss://")
    p.add_argument("--fleet-queue-bytes", dest="fleet_queue_bytes", help="fleet write-behind bound (256MiB)")
    p.add_argument(
        "--kv-events-endpoint",
        dest="kv_events_endpoint",
        help="publish vLLM-format KV events on this ZMQ endpoint (tcp://127.0.0.1:5557)",
    )
    p.add_argument("--kv-events-replay-endpoint", dest="kv_events_replay_endpoint",
                   help="replay recent KV event batches on this ZMQ endpoint")  # fmt: skip
    p.add_argument("--kv-events-topic", dest="kv_events_topic", help="topic of the KV events (kvstore)")
    p.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    p.add_argument("--version", action="version", version=f"kvstore-server {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    flags = {name: "--" + name.replace("_", "-") for name in SIZE_SETTINGS}
    # `--memory -1GiB` reaches parse_size (which says what is wrong) instead of argparse's
    # "expected one argument" and its whole usage
    given = attach_values(sys.argv[1:] if argv is None else argv, flags.values())
    args: dict[str, Any] = vars(_parser().parse_args(given))
    config_path = args.pop("config", None)
    print_config = args.pop("print_config", False)
    try:
        for name, flag in flags.items():  # sizes from flags: errors name the flag
            if name in args and not (name == "capacity" and args[name] == "auto"):
                args[name] = parse_size(args[name], flag)
        config = ServerConfig.load(config_path, args)
    except (ValueError, OSError) as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    if print_config:
        sys.stdout.write(config.to_toml())
        return 0
    problem = config.exposure_problem()
    if problem is not None:
        print(f"kvstore-server: {problem}", file=sys.stderr)
        return 2
    try:
        tokens = TokenTable.load(config.token_file) if config.token_file is not None else None
        for path in (config.tls_cert, config.tls_key, config.tls_client_ca,
                     config.fleet_password_file, config.fleet_tls_ca):  # fmt: skip
            if path is not None:
                path.read_bytes()
    except (ValueError, OSError) as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tune_malloc(trim_bytes=_MALLOC_KEEP_FREE)
    _raise_open_files_limit()
    # Before gRPC starts its threads: one arena per allocating thread would keep each
    # thread's freed buffers out of the others' reach (see kvstore.memory).
    limit_arenas(_MALLOC_ARENAS)
    return _serve(config, tokens)


def _freeze_survivors(phase: str, info: dict[str, int]) -> None:
    """After a full collection, what survived it joins the permanent generation (gc.freeze):
    the daemon's objects are long-lived index entries and records, and a full collection
    that walks them all pauses every request. (Frozen objects are still freed when their
    last reference goes; only a cycle among them would stay.)"""
    if phase == "stop" and info.get("generation") == 2:
        gc.freeze()


class _StopSignals:
    """SIGTERM and SIGINT blocked in every thread while the daemon runs; `wait` takes one.

    NOTE: blocked before any thread starts (the store's write-behind, gRPC's), so they
    all inherit the mask and the main thread alone takes the signals, in sigwait; a
    Python handler never runs if a C thread received the signal. Unblocked again on the
    way out only if none was taken (a start-up failure, and main() may run in a test's
    process); after one was, a second that arrives during the shutdown stays pending
    instead of killing the process before it records its clean stop."""

    def __enter__(self) -> _StopSignals:
        self._previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        self._taken = False
        return self

    def wait(self) -> int:
        signum = signal.sigwait(_STOP_SIGNALS)
        self._taken = True
        return signum

    def __exit__(self, *exc: object) -> None:
        if not self._taken:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous)


def _serve(config: ServerConfig, tokens: TokenTable | None) -> int:
    """Run the daemon until SIGTERM or SIGINT: 0 once stopped cleanly, 1 when it cannot
    start. What it opens is closed by one ExitStack, in reverse order, on every way out."""
    # before the data directory's lock and the store: a taken port fails at once, in one line
    bind_problem = listen_problem(config.listen)
    if bind_problem is not None:
        log.error("%s", bind_problem)
        return 1
    with ExitStack() as cleanup:
        try:
            datadir = DataDir(config.data_dir, sync=config.sync)
        except DataDirInUse as exc:
            log.error("%s", exc)
            return 1
        except OSError as exc:
            log.error("cannot use the data directory %s: %s", config.data_dir, exc)
            return 1
        store: Store | None = None
        # runs last: a clean stop once the store opened (and closed, before this), else not
        cleanup.callback(lambda: datadir.close(sync=config.sync, clean=store is not None))
        signals = cleanup.enter_context(_StopSignals())
        try:
            store = open_store(config, rebooted=datadir.rebooted)
        except (OSError, StorageError) as exc:
            log.error("cannot open the %s backend in %s: %s", config.backend, config.data_dir, exc)
            return 1
        cleanup.callback(store.close)
        # The index of a large store is millions of long-lived objects: out of the cyclic
        # collector's reach from now on, so a full collection does not pause on them; and
        # so are those that survive each later full collection (the blocks saved since):
        # otherwise every full collection walks every block saved since the start (128 ms
        # in the middle of a cold load was seen)
        gc.freeze()
        gc.callbacks.append(_freeze_survivors)
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        try:
            running = create_server(config, store, tokens)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, ListenError):  # its message names the address and --listen
                log.error("%s", exc)
            else:
                log.error("cannot listen on %s: %s", config.listen, exc)
            return 1
        cleanup.callback(running.close)
        metrics_http = None
        if running.metrics is not None and config.metrics_port is not None:
            try:
                metrics_http = MetricsServer.start(
                    running.metrics.registry, config.metrics_host, config.metrics_port
                )
            except OSError as exc:
                log.error("cannot serve metrics on %s:%d: %s", config.metrics_host, config.metrics_port, exc)
                return 1
            cleanup.callback(metrics_http.close)
            log.info("serving Prometheus metrics on %s", metrics_http.url)
        _warn_of_settings(config, store)
        running.server.start()
        host = config.listen.rpartition(":")[0]
        metrics_note = f", metrics={metrics_http.url}" if metrics_http is not None else ""
        print(
            f"kvstore-server ready on {host}:{running.port} (backend={config.backend}, "
            f"data_dir={config.data_dir}, capacity={format_size(config.capacity)}, "
            f"memory={format_size(store.memory.file.size) if store.memory is not None else 'off'}"
            f"{metrics_note})",
            flush=True,
        )
        signum = signals.wait()
        log.info(
            "%s: NOT_SERVING, finishing in-flight calls (grace %.1fs)",
            signal.Signals(signum).name,
            config.grace_seconds,
        )
        running.stop(config.grace_seconds)
    log.info("stopped cleanly")
    return 0


def _warn_of_settings(config: ServerConfig, store: Store) -> None:
    """What the log should say of the settings before the daemon serves."""
    if config.max_watchers + config.max_waiting_drop_selects >= config.workers:
        log.warning(
            "max_watchers (%d) + max_waiting_drop_selects (%d) leave no worker thread of %d for other calls",
            config.max_watchers,
            config.max_waiting_drop_selects,
            config.workers,
        )
    if config.capacity_auto:
        log.info(
            "capacity %s (auto: a quarter of the free space of %s; --capacity sets it)",
            format_size(config.capacity),
            config.data_dir,
        )
    if config.memory is None and store.memory is not None:
        log.info(
            "memory tier %s (auto: a tenth of RAM, within half the room of %s; --memory sets it)",
            format_size(store.memory.file.size),
            config.memory_dir,
        )


if __name__ == "__main__":
    sys.exit(main())

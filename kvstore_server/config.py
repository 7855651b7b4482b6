"""Typed daemon configuration: defaults, a TOML file, then flags.

Precedence: built-in defaults < `--config FILE` (TOML, keys as below with `_`
or `-`) < command-line flags actually given. `kvstore-server --print-config`
prints the effective result as TOML.

Sizes (SIZE_SETTINGS) are byte counts or strings such as "64GiB" (parse_size); a bad
one is an error that names the flag or the file's key, and the forms accepted.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvstore.sizes import parse_size
from kvstore_server.tiers import BACKENDS
from kvstore_server.tiers.arena.tier import PERSIST_POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# What a setting may be in the TOML file, and how to say so.
_STR = ((str,), "a string")
_INT = ((int,), "an integer")
_SIZE = ((int, str), 'a byte count or a size string such as "64GiB"')
_TOML_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "listen": _STR,
    "data_dir": _STR,
    "backend": _STR,
    "capacity": _SIZE,
    "sync": ((bool,), "true or false"),
    "workers": _INT,
    "max_concurrent_rpcs": _INT,
    "max_put_bytes": _SIZE,
    "max_inflight_put_bytes": _SIZE,
    "max_partial_bytes": _SIZE,
    "max_waiting_drop_selects": _INT,
    "grace_seconds": ((int, float), "a number"),
    "log_level": _STR,
    "metrics_port": _INT,
    "metrics_host": _STR,
    "event_window": _INT,
    "max_watchers": _INT,
    "token_file": _STR,
    "tls_cert": _STR,
    "tls_key": _STR,
    "tls_client_ca": _STR,
    "insecure": ((bool,), "true or false"),
    "local_reads": ((bool,), "true or false"),
    "memory": _SIZE,
    "memory_dir": _STR,
    "memory_group": ((str, int), "a group name or id"),
    "memory_clients": ((bool,), "true or false"),
    "lease_seconds": ((int, float), "a number"),
    "write_behind_bytes": _SIZE,
    "persist": _STR,
    "fleet": _STR,
    "fleet_prefix": _STR,
    "fleet_user": _STR,
    "fleet_password_file": _STR,
    "fleet_tls_ca": _STR,
    "fleet_lookup_seconds": ((int, float), "a number"),
    "fleet_timeout_seconds": ((int, float), "a number"),
    "fleet_queue_bytes": _SIZE,
    "kv_events_endpoint": _STR,
    "kv_events_replay_endpoint": _STR,
    "kv_events_topic": _STR,
}
SIZE_SETTINGS: tuple[str, ...] = tuple(name for name, kind in _TOML_TYPES.items() if kind is _SIZE)
"""The settings that are sizes; each one's flag is --NAME-WITH-DASHES."""

DEFAULT_MEMORY = 1 << 30  # the least an automatic memory tier is
_MAX_AUTO_MEMORY = 64 << 30
_MIN_AUTO_CAPACITY = 8 << 30
_MAX_AUTO_CAPACITY = 1 << 40


def _free_space(path: Path) -> int:
    """Bytes free for an unprivileged writer on the filesystem of `path` (or its nearest
    existing parent)."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return 0


def auto_capacity(data_dir: Path) -> int:
    """The default --capacity: a quarter of the data directory's free space, at least
    8 GiB where half the free space allows, at most 1 TiB."""
    free = _free_space(data_dir)
    return max(min(free // 4, _MAX_AUTO_CAPACITY), min(_MIN_AUTO_CAPACITY, free // 2), 1 << 20)


def auto_memory(memory_dir: Path) -> int:
    """The default --memory: a tenth of the host's RAM, at least 1 GiB and at most 64 GiB,
    and at most half the room memory_dir has (1 GiB there when it has less: an arena that
    does not fit is then refused at start, and the daemon runs without one)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    size = min(max(DEFAULT_MEMORY, ram // 10), _MAX_AUTO_MEMORY)
    room = _free_space(memory_dir) // 2
    return max(min(size, room), DEFAULT_MEMORY) if room else DEFAULT_MEMORY


def _loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or *): it may resolve to anything


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvstore"


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    """HOST:PORT to serve gRPC on; port 0 picks a free port (printed in the ready line)."""
    data_dir: Path = field(default_factory=default_data_dir)
    """Where the backend keeps its files; created if missing; one daemon per directory."""
    backend: str = "lmdb"
    """'lmdb' (embedded, default) or 'disk' (one safetensors file per block)."""
    capacity: int = -1
    """Byte budget of the persistent tier on disk, its index included (units accepted:
    512MiB, 64GiB). Eviction keeps usage under it. "auto" (the default): a quarter of the
    data directory's free space at start, at least 8 GiB where half the free space allows,
    at most 1 TiB (segment files are made as they fill, so it costs nothing until used).
    -1 in code means "auto"."""
    sync: bool = False
    """fsync every commit, so acknowledged blocks survive power loss too (slower).
    Without it they survive any process crash; after an OS crash the store starts empty."""
    workers: int = 64
    """gRPC worker threads."""
    max_concurrent_rpcs: int = 512
    """Calls beyond this are refused with RESOURCE_EXHAUSTED."""
    max_put_bytes: int = 2 << 30
    """Largest single Put (all its blocks and layers)."""
    max_inflight_put_bytes: int = 4 << 30
    """Bytes of Puts buffered at once across all clients; beyond it Puts get RESOURCE_EXHAUSTED."""
    max_partial_bytes: int = 2 << 30
    """Bytes of blocks put in part (each tensor-parallel rank puts its own KV heads) that wait
    for their other parts; beyond it partial puts get RESOURCE_EXHAUSTED. A block's parts
    wait at most lease_seconds."""
    max_waiting_drop_selects: int = 32
    """DropSelect calls allowed to wait at once (each holds a worker thread)."""
    grace_seconds: float = 10.0
    """On SIGTERM/SIGINT, how long in-flight calls may take to finish."""
    log_level: str = "INFO"
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port (0: a free one, shown in the ready
    line); not set: no metrics endpoint."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds ("0.0.0.0" for every interface)."""
    event_window: int = 100_000
    """Recent events kept for Watch replay. Memory: about 32 bytes per block hash plus
    ~200 bytes per event (100k events of 128 blocks: ~430 MB)."""
    max_watchers: int = 16
    """Watch streams open at once (each holds a worker thread); beyond it RESOURCE_EXHAUSTED."""
    token_file: Path | None = None
    """TOML file of bearer tokens, each with a tenant and a role (see kvstore_server.auth).
    Set: every KVStore call needs a token, and tenants are isolated."""
    tls_cert: Path | None = None
    """PEM certificate chain: serve gRPC over TLS (needs tls_key)."""
    tls_key: Path | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: Path | None = None
    """PEM CA bundle: require client certificates signed by it (mutual TLS)."""
    insecure: bool = False
    """Allow listening on a non-loopback address with neither tokens nor TLS."""
    local_reads: bool | None = None
    """Offer the same-host fast path (LocalAccess): clients that can open data_dir read
    blocks from its files directly. Not set: on without token_file, off with it, since a
    process that can read the files can read every tenant's KV."""

    memory: int | None = None
    """Size of the memory tier: an arena in a file under memory_dir that same-host clients
    map (saves and loads move no bytes through gRPC), in front of the backend. 0 turns it
    off. Not set: a tenth of the host's RAM, at least 1 GiB and at most 64 GiB, and at
    most half the room memory_dir has (allocated at start); off with a warning where
    memory_dir has no room for 1 GiB."""
    memory_dir: Path = Path("/dev/shm")
    """Where the arena file lives: a shared-memory filesystem (tmpfs). The file outlives
    the daemon process (a restarted daemon recovers its committed blocks), not a reboot."""
    memory_group: str | None = None
    """Group that may map the arena too (file mode 0660); not set: the daemon's user only (0600)."""
    memory_clients: bool | None = None
    """Offer the arena to same-host clients (ArenaAccess). Not set: on without token_file,
    off with it, since a process that maps the arena can read and write every tenant's KV."""
    lease_seconds: float = 30.0
    """How long a reservation (a save in progress) or a pin (a load) lasts unless ended."""
    write_behind_bytes: int | None = None
    """Bytes of committed blocks waiting to be written behind to the backend; beyond it, new
    commits stay in memory only (counted as write_behind_dropped). Not set: half of memory."""
    persist: str = "every"
    """Which blocks saved through the memory tier are written behind to the backend:
    "every" block, or only those "reused": loaded again while still in memory (a prefix
    used once then costs the disk nothing, as Dynamo's frequency filter spares SSDs; one
    evicted from memory before its first reuse leaves the store). Blocks put over gRPC
    without the memory tier always go to the backend."""

    fleet: str | None = None
    """The fleet tier, shared by every host's daemon: redis://HOST:PORT[/DB] or
    redis+cluster://H1:P1,H2:P2,... (rediss:// for TLS). Blocks stored here are copied to
    it in the background; blocks the local tiers lack are looked up and fetched from it.
    Not set: no fleet tier."""
    fleet_prefix: str = ""
    """Prefix of every fleet key, so several deployments can share one Redis."""
    fleet_user: str | None = None
    """Redis ACL user for the fleet."""
    fleet_password_file: Path | None = None
    """File holding the fleet user's password (never on the command line)."""
    fleet_tls_ca: Path | None = None
    """PEM CA bundle to verify the fleet's TLS certificates (rediss://)."""
    fleet_lookup_seconds: float = 0.05
    """Deadline of a fleet lookup; a fleet slower than this is a miss."""
    fleet_timeout_seconds: float = 2.0
    """Deadline of a fleet read or write."""
    fleet_queue_bytes: int = 256 << 20
    """Bytes of blocks waiting to be copied to the fleet; beyond it, copies are dropped
    (counted as fleet_dropped) and saves never wait."""
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint (tcp://HOST:PORT, ipc://PATH) for the store's events in vLLM's KV
    events format (see kvstore_server/kv_events.py). Not set: none are published."""
    kv_events_replay_endpoint: str | None = None
    """ZMQ ROUTER endpoint that replays recent batches from a sequence."""
    kv_events_topic: str = "kvstore"

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        self.memory_dir = Path(self.memory_dir).expanduser()
        if self.memory is not None:
            self.memory = parse_size(self.memory, "memory")
        if self.write_behind_bytes is not None:
            self.write_behind_bytes = parse_size(self.write_behind_bytes, "write_behind_bytes")
        if self.memory_group is not None:
            self.memory_group = str(self.memory_group)
        if not self.lease_seconds > 0:
            raise ValueError("lease_seconds must be positive")
        self.fleet_queue_bytes = parse_size(self.fleet_queue_bytes, "fleet_queue_bytes")
        if self.fleet is not None:
            from kvstore_server.tiers.fleet import parse_url

            parse_url(self.fleet)  # raises ValueError naming what is wrong
        for name in ("fleet_lookup_seconds", "fleet_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        raw: object = self.capacity
        self.capacity_auto = raw in ("auto", -1)
        if self.capacity_auto:
            self.capacity = auto_capacity(self.data_dir)
        else:
            self.capacity = parse_size(self.capacity, "capacity")
        self.max_put_bytes = parse_size(self.max_put_bytes, "max_put_bytes")
        self.max_inflight_put_bytes = parse_size(self.max_inflight_put_bytes, "max_inflight_put_bytes")
        self.max_partial_bytes = parse_size(self.max_partial_bytes, "max_partial_bytes")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.persist not in PERSIST_POLICIES:
            raise ValueError(f"persist must be one of {', '.join(PERSIST_POLICIES)}, not {self.persist!r}")
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"listen must be HOST:PORT, not {self.listen!r}")
        for name in (
            "workers", "max_concurrent_rpcs", "max_waiting_drop_selects", "event_window", "max_watchers"
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds must not be negative")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("log_level must be DEBUG, INFO, WARNING or ERROR")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0..65535, not {self.metrics_port}")
        if not self.metrics_host:
            raise ValueError("metrics_host must not be empty")
        for name in (
            "token_file",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "fleet_password_file",
            "fleet_tls_ca",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value).expanduser())
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be tcp://HOST:PORT or ipc://PATH, not {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")

    def memory_bytes(self) -> int:
        return auto_memory(self.memory_dir) if self.memory is None else self.memory

    def offers_memory(self) -> bool:
        if self.memory_clients is not None:
            return self.memory_clients
        return self.token_file is None

    def offers_local_reads(self) -> bool:
        if self.local_reads is not None:
            return self.local_reads
        return self.token_file is None

    def exposure_problem(self) -> str | None:
        """Why serving this config would be unsafe, or None. The daemon refuses to start on it."""
        if self.kv_events_endpoint is not None and self.token_file is not None:
            return (
                "refusing KV events with --token-file: they carry every tenant's block hashes and "
                "token ids (prompts) to anyone who subscribes; run them on a daemon without tenants"
            )
        for endpoint in (self.kv_events_endpoint, self.kv_events_replay_endpoint):
            if endpoint is not None and endpoint.startswith("tcp://") and not self.insecure:
                host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
                if not _loopback(host):
                    return (
                        f"refusing KV events on {endpoint}: they carry token ids (prompts) unauthenticated; "
                        "bind them to a loopback address, or give --insecure on a private network"
                    )
        if self.is_loopback() or self.token_file or self.tls_cert or self.insecure:
            return None
        return (
            f"refusing to listen on {self.listen} without --token-file or --tls-cert: anyone who can "
            "reach it could read and overwrite KV; give one of them, or --insecure on a private network"
        )

    def is_loopback(self) -> bool:
        """Whether `listen` is reachable from this machine only."""
        return _loopback(self.listen.rpartition(":")[0].strip("[]"))

    @classmethod
    def load(cls, path: Path | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
        values: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
            known = {f.name for f in fields(cls)}
            for key, value in doc.items():
                name = key.replace("-", "_")
                if name not in known:
                    raise ValueError(f"{path}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
                want, what = _TOML_TYPES.get(name, ((object,), ""))
                if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
                    raise ValueError(f"{path}: {key} must be {what}, not {value!r}")
                if name in SIZE_SETTINGS and isinstance(value, (int, str)):
                    value = parse_size(value, f"{path}: {key}")
                values[name] = value
        values.update(overrides or {})
        return cls(**values)

    def to_toml(self) -> str:
        lines = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:  # TOML has no null: an unset setting is left out
                lines.append(f"# {f.name} is not set")
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = str(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{f.name} = {text}")
        return "\n".join(lines) + "\n"

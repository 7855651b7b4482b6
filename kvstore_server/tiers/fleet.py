"""The fleet tier: KV blocks in a Redis or Redis Cluster that every host's daemon shares.

One Redis key per block, never two: a Redis that evicts (`allkeys-lru`) can only
make a block missing, never half there. The key carries the store's namespace
(which carries the tenant) and the block hash, in hex, after a deployment prefix
(`--fleet-prefix`, so deployments can share one cluster); no hash tags, so a
chain spreads over the cluster's nodes:

    <prefix>kv1:<namespace hex>:<block hash hex>

The value is a versioned header, the block's metadata record (kvstore.blocks
BlockMeta.to_json: namespace, hash, parent, layer layout, per-layer xxh3) and
the payload, the layers back to back:

    b"KVFL" | version (u8) | metadata length (u32 LE) | metadata | payload

A value that does not parse, names another block, has the wrong length or fails
a checksum is a miss (counted and logged), never bytes handed on.

Failure: every call has a deadline (a short one for lookups). A Redis that is
down, slow or failing over makes lookups and reads misses and writes drops;
the first failure of an outage logs one warning, the first success after it one
line. Reconnection and cluster topology (MOVED/ASK, failover) are redis-py's.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.exceptions import RedisClusterException, RedisError

from kvstore.blocks import XXH3, BlockKey, BlockMeta, StorageError, StoredBlock
from kvstore_server.tiers.base import BlockWrite

log = logging.getLogger(__name__)

MAGIC = b"KVFL"
VERSION = 1
_HEADER = struct.Struct("<4sBI")
_MAX_META = 1 << 20  # a record of 1 MiB is far beyond any layout: a bad value
# what redis-py raises when the fleet is down, slow, failing over or refuses a call
# (RedisClusterException is not a RedisError)
FLEET_ERRORS = (RedisError, RedisClusterException, OSError)
SETTLE_S = 1.0  # an outage ends once the fleet has answered this long with no failure


class FleetObjectError(StorageError):
    """A fleet value that is not a valid object of the block asked for."""


def object_key(prefix: bytes, key: BlockKey) -> bytes:
    namespace, block_hash = key
    return b"%skv1:%s:%s" % (prefix, namespace.hex().encode(), block_hash.hex().encode())


def namespace_pattern(prefix: bytes, namespace: bytes, *, exact: bool = True) -> bytes:
    """A SCAN MATCH pattern for every object of `namespace`, or (exact=False) of every
    namespace that starts with it: the hex of a prefix is a prefix of the hex. Hex has no
    glob characters; the deployment prefix's own are escaped."""
    escaped = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix)
    return b"%skv1:%s%s*" % (escaped, namespace.hex().encode(), b":" if exact else b"")


def encode(write: BlockWrite) -> bytes:
    """The value stored for one block (xxh3 checksums only: what the persistent tier holds)."""
    meta = write.meta
    if meta.checksum_kind != XXH3:
        raise ValueError(f"fleet objects carry xxh3 checksums, not {meta.checksum_kind}")
    record = meta.to_json()
    payload = write.joined if write.joined is not None else b"".join(write.layers)
    return b"".join((_HEADER.pack(MAGIC, VERSION, len(record)), record, payload))


def decode(raw: bytes | memoryview, key: BlockKey) -> StoredBlock:
    """The block in `raw`, verified to be `key`'s with every layer's checksum.
    Raises FleetObjectError."""
    view = memoryview(raw)
    if len(view) < _HEADER.size:
        raise FleetObjectError(f"a fleet object of {len(view)} bytes has no header")
    magic, version, meta_len = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FleetObjectError("not a kvstore fleet object (bad magic)")
    if version != VERSION:
        raise FleetObjectError(f"fleet object version {version} (this daemon reads {VERSION})")
    if meta_len > _MAX_META or _HEADER.size + meta_len > len(view):
        raise FleetObjectError(f"fleet object metadata of {meta_len} bytes does not fit the object")
    start = _HEADER.size + meta_len
    try:
        meta = BlockMeta.from_json(view[_HEADER.size : start])
    except (StorageError, ValueError, KeyError, TypeError) as exc:
        raise FleetObjectError(f"fleet object metadata does not parse: {exc}") from exc
    if meta.key != key:
        raise FleetObjectError("the fleet object is another block's")
    if len(view) - start != meta.size:
        raise FleetObjectError(f"fleet object payload of {len(view) - start} bytes, not {meta.size}")
    layers, at = [], start
    for spec in meta.layers:
        layers.append(view[at : at + spec.nbytes])
        at += spec.nbytes
    block = StoredBlock(meta, layers)
    bad = block.corrupt_layer()
    if bad is not None:
        raise FleetObjectError(f"layer {meta.layers[bad].name!r} fails its checksum")
    return block


@dataclass(frozen=True)
class FleetSettings:
    """Where the fleet is and how to reach it (config `fleet`, `fleet_*`)."""

    url: str  # redis://HOST:PORT[/DB] or redis+cluster://H1:P1,H2:P2 (rediss:// for TLS)
    prefix: bytes = b""
    user: str | None = None
    password_file: Path | None = None
    tls_ca: Path | None = None
    lookup_timeout_s: float = 0.05
    timeout_s: float = 2.0


def parse_url(url: str) -> tuple[bool, bool, list[tuple[str, int]], int]:
    """(cluster, tls, [(host, port)...], db) of a fleet URL. Raises ValueError."""
    parts = urlsplit(url)
    schemes = {"redis": (False, False), "rediss": (False, True),
               "redis+cluster": (True, False), "rediss+cluster": (True, True)}  # fmt: skip
    if parts.scheme not in schemes:
        raise ValueError(f"fleet URL {url!r}: the scheme must be one of {', '.join(schemes)}")
    cluster, tls = schemes[parts.scheme]
    netloc = parts.netloc.rpartition("@")[2]
    hosts = []
    for item in netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"fleet URL {url!r}: {item!r} is not HOST:PORT")
        hosts.append((unquote(host), int(port)))
    if not cluster and len(hosts) != 1:
        raise ValueError(f"fleet URL {url!r}: one HOST:PORT (redis+cluster:// takes several)")
    path = parts.path.strip("/")
    if path and (cluster or not path.isdigit()):
        raise ValueError(f"fleet URL {url!r}: only a plain Redis takes a database number")
    return cluster, tls, hosts, int(path or 0)


def connect(settings: FleetSettings, timeout_s: float) -> Any:
    """A redis-py client for the fleet (RedisCluster for redis+cluster://)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    cluster, tls, hosts, db = parse_url(settings.url)
    password = None
    if settings.password_file is not None:
        password = settings.password_file.read_text().strip()
    common: dict[str, Any] = {
        "username": settings.user,
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # redis-py's default retries back off for seconds: a call is one try within its
        # deadline here (a cluster retries once more, at once, after refreshing its slots)
        "retry": Retry(NoBackoff(), 1 if cluster else 0),
    }
    if tls:
        common["ssl"] = True
        if settings.tls_ca is not None:
            common["ssl_ca_certs"] = str(settings.tls_ca)
    if cluster:
        nodes = [ClusterNode(host, port) for host, port in hosts]
        return RedisCluster(startup_nodes=nodes, **common)
    host, port = hosts[0]
    return redis.Redis(host=host, port=port, db=db, **common)


@dataclass
class FleetCounters:
    fleet_lookups: int = 0
    fleet_hit_blocks: int = 0
    fleet_bytes_fetched: int = 0
    fleet_blocks_written: int = 0
    fleet_bytes_written: int = 0
    fleet_corrupt: int = 0
    fleet_errors: int = 0


class FleetTier:
    """The fleet, a tiers.base.Tier (stored_prefix, read, write, delete, close; local
    removals never call delete: other hosts use the fleet; delete_matching is evict
    --fleet's). Thread-safe: redis-py's clients pool connections."""

    name = "fleet"

    def __init__(self, settings: FleetSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self.prefix = settings.prefix
        self.counters = FleetCounters()
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_failure = 0.0
        # two clients, made on first use (a cluster that is down at start is retried by
        # the next call): lookups give up after a short deadline, data moves take longer
        self._clients: dict[str, Any] = {}
        self._timeouts = {"lookup": settings.lookup_timeout_s, "data": settings.timeout_s}

    def _client(self, kind: str) -> Any:
        """Raises one of FLEET_ERRORS when the fleet cannot be reached."""
        with self._lock:
            client = self._clients.get(kind)
        if client is None:
            client = connect(self.settings, self._timeouts[kind])  # a cluster asks for its slots here
            with self._lock:
                client = self._clients.setdefault(kind, client)
        return client

    def stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` the fleet holds: one pipelined EXISTS per key (a round
        trip per cluster node) within the lookup deadline; 0 when the fleet does not answer."""
        if not keys:
            return 0
        with self._lock:
            self.counters.fleet_lookups += 1
        present = self.present(keys, kind="lookup")
        n = 0
        for found in present or ():
            if not found:
                break
            n += 1
        return n

    def present(self, keys: Sequence[BlockKey], *, kind: str = "data") -> list[bool] | None:
        """Which of `keys` the fleet holds (None: it did not answer)."""
        answers = self._run(kind, "exists", [(self._name(k),) for k in keys])
        if answers is None:
            return None
        return [bool(a) and not isinstance(a, Exception) for a in answers]

    @contextmanager
    def read(self, keys: Sequence[BlockKey]) -> Iterator[list[StoredBlock | None]]:
        """The blocks of `keys`, verified; None for one that is missing, corrupt or
        unreadable (all None when the fleet does not answer). Their bytes are the daemon's
        own copy: they stay valid after the context, which only shapes the call as a Tier's."""
        yield self._fetch(keys)

    def _fetch(self, keys: Sequence[BlockKey]) -> list[StoredBlock | None]:
        if not keys:
            return []
        answers = self._run("data", "get", [(self._name(k),) for k in keys])
        if answers is None:
            return [None] * len(keys)
        out: list[StoredBlock | None] = []
        fetched = hits = corrupt = 0
        for key, raw in zip(keys, answers, strict=True):
            if raw is None or isinstance(raw, Exception):
                out.append(None)
                continue
            try:
                block = decode(raw, key)
            except FleetObjectError as exc:
                log.warning("fleet object of block %s is unusable: %s", key[1].hex(), exc)
                corrupt += 1
                out.append(None)
                continue
            fetched += len(raw)
            hits += 1
            out.append(block)
        with self._lock:
            self.counters.fleet_hit_blocks += hits
            self.counters.fleet_bytes_fetched += fetched
            self.counters.fleet_corrupt += corrupt
        return out

    def write(self, writes: Sequence[BlockWrite], deletes: Sequence[BlockKey] = ()) -> None:
        """Delete `deletes`, then store blocks (one SET each, pipelined). Raises StorageError
        when the fleet refused or did not answer (the blocks are then not in the fleet:
        callers count a drop)."""
        self.delete(deletes)
        if not writes:
            return
        values = [(self._name(w.meta.key), encode(w)) for w in writes]
        nbytes = sum(len(value) for _, value in values)
        answers = self._run("data", "set", values)
        if answers is None:
            raise StorageError("the fleet did not answer")
        refused = [a for a in answers if isinstance(a, Exception)]
        if refused:
            raise StorageError(f"the fleet refused {len(refused)} of {len(values)} blocks: {refused[0]}")
        with self._lock:
            self.counters.fleet_blocks_written += len(writes)
            self.counters.fleet_bytes_written += nbytes

    def delete(self, keys: Sequence[BlockKey]) -> None:
        """UNLINK the objects of `keys` (an operator's; local removals never call it: other
        hosts use the fleet). Raises StorageError when the fleet does not answer."""
        if keys and self._run("data", "unlink", [(self._name(k),) for k in keys]) is None:
            raise StorageError("the fleet did not answer")

    def delete_matching(self, namespace: bytes, *, exact: bool = True) -> int:
        """Remove every object of `namespace` (exact=False: of every namespace starting with
        it) by SCAN over every node, then UNLINK; how many. Raises StorageError when the
        fleet does not answer."""
        pattern = namespace_pattern(self.prefix, namespace, exact=exact)
        removed = 0
        try:
            client = self._client("data")
            batch: list[bytes] = []
            for name in client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 500:
                    removed += self._unlink(client, batch)
                    batch = []
            if batch:
                removed += self._unlink(client, batch)
        except FLEET_ERRORS as exc:
            self._failed("evict", exc)
            raise StorageError(f"the fleet did not answer: {exc}") from exc
        self._answered()
        return removed

    @staticmethod
    def _unlink(client: Any, names: list[bytes]) -> int:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.unlink(name)
        return sum(int(n) for n in pipe.execute())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**vars(self.counters), "fleet_up": self._down_since is None}

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    # ---- one warning per outage
    def _name(self, key: BlockKey) -> bytes:
        return object_key(self.prefix, key)

    def _run(self, kind: str, command: str, calls: Sequence[tuple[bytes, ...]]) -> list[Any] | None:
        """`command` once per argument tuple of `calls`, pipelined on the `kind` client:
        the answers (an Exception in place of a command that failed), or None when the
        fleet did not answer at all."""
        try:
            pipe = self._client(kind).pipeline(transaction=False)
            try:
                queue = getattr(pipe, command)
                for args in calls:
                    queue(*args)
                answers = pipe.execute(raise_on_error=False)
            finally:
                pipe.reset()
        except FLEET_ERRORS as exc:  # connection, timeout, cluster down: no fleet now
            self._failed(command, exc)
            return None
        self._answered()
        return list(answers)

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.counters.fleet_errors += 1
            self._last_failure = self._clock()
            first = self._down_since is None
            if first:
                self._down_since = self._last_failure
        if first:
            log.warning("the fleet (%s) does not answer (%s: %s): its blocks are misses until it is back",
                        self.settings.url, what, exc)  # fmt: skip
        else:
            log.debug("fleet %s failed: %s", what, exc)

    def _answered(self) -> None:
        # NOTE: a cluster with one node down answers the calls that miss that node: the
        # outage ends only once the fleet has answered with no failure for SETTLE_S, or
        # each call would flip it (a warning and a "back" line each time)
        now = self._clock()
        with self._lock:
            since = self._down_since
            if since is None or now - self._last_failure < SETTLE_S:
                return
            self._down_since = None
        log.warning("the fleet (%s) is back after %.1fs", self.settings.url, now - since)

"""Prometheus metrics of the daemon, served as text on `--metrics-port`.

    metrics = Metrics()                                    # a registry of its own
    interceptor = MetricsInterceptor(metrics)              # per-RPC calls, errors, latency
    metrics.watch(store, servicer)                         # store state, read at scrape time
    http = MetricsServer.start(metrics.registry, "127.0.0.1", 0)   # port 0: a free one
    http.address; http.close()

Per RPC of kvstore.v1.KVStore (health and reflection calls are not counted),
recorded when the call ends — for streams, when the stream ends; a call the
client cancels counts as CANCELLED (DEADLINE_EXCEEDED if its deadline passed):

    kvstore_rpc_calls_total{method,code}        finished calls by status code (OK included)
    kvstore_rpc_errors_total{method,code}       the same, for codes other than OK
    kvstore_rpc_duration_seconds{method}        histogram: call start to call end
    kvstore_received_bytes_total                KV payload received in Put streams, as it
                                                arrives (also for puts that fail or repeat
                                                stored blocks)

Read from the store (Store.stats(), the same numbers as the Stats RPC) and the
servicer at scrape time, so there is no second set of books to drift:

    kvstore_blocks, kvstore_stored_bytes, kvstore_capacity_bytes, kvstore_namespaces
    kvstore_lookups_total, kvstore_lookup_hit_blocks_total, kvstore_lookup_miss_blocks_total
    kvstore_puts_total, kvstore_written_blocks_total, kvstore_written_bytes_total
    kvstore_read_bytes_total                    KV payload of Get and DropSelect streams
    kvstore_evictions_total, kvstore_checksum_failures_total
    kvstore_inflight_put_bytes                  Put data buffered now (max_inflight_put_bytes)
    kvstore_active_watchers                     open Watch streams (max_watchers)
    kvstore_events_total                        events recorded for Watch since start
    kvstore_control_connections, kvstore_control_calls_total, kvstore_control_refused_connections_total
                                                the control socket (where the arena is offered)
    kvstore_start_time_seconds                  unix time the daemon started
    kvstore_info{version,backend,store_id}      always 1

The interceptor that records each call is kvstore_server.rpc.metrics (this module
imports no grpc). Calls refused by gRPC itself before reaching a handler (beyond
max_concurrent_rpcs) are not seen here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore_server import __version__

if TYPE_CHECKING:
    from kvstore_server.rpc import Servicer
    from kvstore_server.store import Store

log = logging.getLogger(__name__)

# Lookups take well under a millisecond; a Put of a long prompt or a waiting DropSelect, seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# the fleet tier's metrics: (kind, name, help, stats key)
_FLEET_METRICS = (
    ("gauge", "kvstore_fleet_up", "0 from a failed call until a second with no failure.", "fleet_up"),
    ("counter", "kvstore_fleet_lookups", "Lookups that went on into the fleet.", "fleet_lookups"),
    ("counter", "kvstore_fleet_hit_blocks", "Blocks fetched from the fleet, verified.", "fleet_hit_blocks"),
    ("counter", "kvstore_fleet_fetched_bytes", "Bytes fetched from the fleet.", "fleet_bytes_fetched"),
    ("counter", "kvstore_fleet_written_blocks", "Blocks copied to the fleet.", "fleet_blocks_written"),
    ("counter", "kvstore_fleet_written_bytes", "Bytes copied to the fleet.", "fleet_bytes_written"),
    (
        "counter",
        "kvstore_fleet_corrupt_objects",
        "Fleet objects failing to verify (misses).",
        "fleet_corrupt",
    ),
    ("counter", "kvstore_fleet_errors", "Fleet calls not answered in time, or refused.", "fleet_errors"),
    (
        "gauge",
        "kvstore_fleet_backlog_blocks",
        "Blocks waiting to be copied to the fleet.",
        "fleet_backlog_blocks",
    ),
    ("gauge", "kvstore_fleet_backlog_bytes", "Their bytes.", "fleet_backlog_bytes"),
    (
        "counter",
        "kvstore_fleet_dropped_blocks",
        "Fleet copies dropped (queue full, fleet away).",
        "fleet_dropped",
    ),
    (
        "counter",
        "kvstore_fleet_promoted_blocks",
        "Blocks fetched from the fleet into local tiers.",
        "fleet_promoted_blocks",
    ),
)


class Metrics:
    """The daemon's metrics in a CollectorRegistry of their own (not the global one)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "kvstore_rpc_calls",
            "Finished KVStore calls by method and status code (streams: when the stream ended).",
            ("method", "code"),
            registry=self.registry,
        )
        self.errors = Counter(
            "kvstore_rpc_errors",
            "Finished KVStore calls whose status code was not OK.",
            ("method", "code"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvstore_rpc_duration_seconds",
            "KVStore call time from start to end (streams: to the end of the stream).",
            ("method",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.received_bytes = Counter(
            "kvstore_received_bytes",
            "KV payload bytes received in Put streams, as they arrive.",
            registry=self.registry,
        )

    def watch(self, store: Store, servicer: Servicer | None = None) -> None:
        """Export `store`'s (and `servicer`'s) state, read at each scrape. Call once."""
        self.registry.register(StoreCollector(store, servicer))

    def record(self, method: str, code: str, seconds: float) -> None:
        """A finished call of `method`, by its status code's name ("OK", "CANCELLED", ...)."""
        self.calls.labels(method, code).inc()
        if code != "OK":
            self.errors.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)


class StoreCollector(Collector):
    """Store.stats() and the servicer's gauges as metric families, at scrape time."""

    def __init__(self, store: Store, servicer: Servicer | None = None) -> None:
        self.store = store
        self.servicer = servicer

    def collect(self) -> Iterable[Metric]:
        s = self.store.stats()

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=float(s[key]))

        def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=float(s[key]))

        yield gauge("kvstore_blocks", "Blocks stored.", "blocks")
        yield gauge("kvstore_stored_bytes", "KV bytes stored (counted against capacity).", "bytes_used")
        yield gauge("kvstore_capacity_bytes", "The byte budget for KV data.", "capacity_bytes")
        yield gauge("kvstore_namespaces", "Namespaces with a stored block.", "namespaces")
        yield counter("kvstore_lookups", "Prefix lookups (per namespace asked).", "lookups")
        yield counter("kvstore_probe_lookups", "Lookups of routers asking ahead.", "probe_lookups")
        yield counter("kvstore_lookup_hit_blocks", "Blocks found by lookups (stored prefixes).", "hit_blocks")
        yield counter("kvstore_lookup_miss_blocks", "Blocks asked for by lookups, not found.", "miss_blocks")
        yield counter("kvstore_puts", "Committed puts.", "puts")
        yield counter("kvstore_written_blocks", "Blocks written by puts (repeats skipped).", "blocks_written")
        yield counter("kvstore_written_bytes", "KV bytes written by puts (repeats skipped).", "bytes_written")
        yield counter("kvstore_read_bytes", "KV payload of completed Get/DropSelect streams.", "bytes_read")
        yield counter("kvstore_evictions", "Blocks evicted, for capacity and by Evict calls.", "evictions")
        yield counter("kvstore_checksum_failures", "Layers failing checksums on read.", "checksum_failures")
        if self.store.memory is not None:  # the memory tier
            yield gauge(
                "kvstore_memory_capacity_bytes", "Size of the memory tier (arena).", "memory_capacity_bytes"
            )
            yield gauge(
                "kvstore_memory_used_bytes",
                "Arena bytes in extents (blocks, reservations).",
                "memory_used_bytes",
            )
            yield gauge("kvstore_memory_blocks", "Blocks resident in the memory tier.", "memory_blocks")
            yield gauge("kvstore_memory_bytes", "KV bytes resident in the memory tier.", "memory_bytes")
            yield gauge("kvstore_pinned_bytes", "Arena bytes pinned by loads in progress.", "pinned_bytes")
            yield gauge(
                "kvstore_reserved_bytes", "Arena bytes reserved by saves in progress.", "reserved_bytes"
            )
            yield gauge("kvstore_write_behind_blocks", "Committed blocks waiting for the persistent tier.",
                        "write_behind_blocks")  # fmt: skip
            yield gauge("kvstore_write_behind_bytes", "Their bytes.", "write_behind_bytes")
            yield gauge(
                "kvstore_memory_only_blocks", "Blocks the persistent tier will not get.", "memory_only_blocks"
            )
            yield gauge("kvstore_unused_blocks", "Blocks in memory not loaded since their save "
                        "(persist = reused: written behind at their first load).",
                        "unused_blocks")  # fmt: skip
            yield counter("kvstore_persisted_on_reuse_blocks", "Blocks queued for write-behind at their "
                          "first load (persist = reused).", "persisted_on_reuse")  # fmt: skip
            yield counter("kvstore_written_behind_blocks", "Blocks written behind to the persistent tier.",
                          "written_behind")  # fmt: skip
            yield counter("kvstore_write_behind_dropped_blocks", "Commits kept in memory only.",
                          "write_behind_dropped")  # fmt: skip
            yield counter(
                "kvstore_promotions", "Loads that promoted blocks from the persistent tier.", "promotions"
            )
            yield counter(
                "kvstore_promoted_blocks", "Blocks promoted into the memory tier.", "promoted_blocks"
            )
            yield counter("kvstore_prefetched_blocks", "Promoted blocks read at a Lookup's prefetch.",
                          "prefetched_blocks")  # fmt: skip
            yield counter(
                "kvstore_memory_hit_blocks", "Blocks loaded from the memory tier.", "memory_hit_blocks"
            )
            yield counter("kvstore_persistent_hit_blocks", "Blocks loaded from the persistent tier.",
                          "persistent_hit_blocks")  # fmt: skip
            yield counter("kvstore_commits", "Saves committed through the memory tier.", "commits")
            yield counter(
                "kvstore_leases_expired", "Reservations and pins reclaimed at lease end.", "leases_expired"
            )
            yield counter(
                "kvstore_memory_evicted_blocks", "Blocks that left the memory tier.", "memory_evictions"
            )
        if self.store.fleet is not None:  # the fleet tier
            for make, name, doc, key in _FLEET_METRICS:
                yield (gauge if make == "gauge" else counter)(name, doc, key)
        yield GaugeMetricFamily(
            "kvstore_start_time_seconds", "Unix time the daemon started.", value=self.store.started_at
        )
        info = InfoMetricFamily("kvstore", "The daemon: version, backend and store id (random per start).")
        labels = {"version": __version__, "backend": str(s["backend"]), "store_id": ""}
        if self.servicer is not None:
            events = self.servicer.events
            yield GaugeMetricFamily(
                "kvstore_inflight_put_bytes",
                "Bytes of Put data buffered now, across clients.",
                value=self.servicer.inflight_put_bytes,
            )
            yield GaugeMetricFamily("kvstore_active_watchers", "Open Watch streams.", value=events.watchers)
            yield CounterMetricFamily(
                "kvstore_events", "Events recorded for Watch since start.", value=events.next_sequence - 1
            )
            labels["store_id"] = self.servicer.store_id
            control = self.servicer.control
            if control is not None:
                yield GaugeMetricFamily(
                    "kvstore_control_connections", "Open connections to the control socket.",
                    value=control.connections(),
                )  # fmt: skip
                yield CounterMetricFamily(
                    "kvstore_control_calls", "Calls answered on the control socket.", value=control.calls
                )
                yield CounterMetricFamily(
                    "kvstore_control_refused_connections",
                    "Control-socket connections closed at once, over the limit (their clients use gRPC).",
                    value=control.refused,
                )
        info.add_metric([], labels)
        yield info


class MetricsServer:
    """The HTTP endpoint serving a registry in the Prometheus text format (any path)."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.host: str = host
        self.port: int = port

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
        """Bind HOST:PORT (port 0: a free port) and serve from a daemon thread. Raises OSError."""
        httpd, thread = start_http_server(port, addr=host, registry=registry)
        return cls(httpd, thread)

    @property
    def address(self) -> str:
        """HOST:PORT actually bound (IPv6 hosts in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        """Stop serving and release the port. Called once."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

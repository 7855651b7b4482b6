"""kvstore_server.metrics without a network: the store collector reads Store.stats() at
scrape time, and per-RPC recording. (The HTTP endpoint and the interceptor on a real
daemon: tests/integration/test_metrics.py.)"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from kvunit import BLOCK_BYTES, LAYERS, NS, block_data, chain, new_backend
from prometheus_client import REGISTRY, generate_latest

from kvstore_server import __version__
from kvstore_server.config import ServerConfig
from kvstore_server.daemon import RunParts
from kvstore_server.metrics import Metrics
from kvstore_server.rpc import Servicer
from kvstore_server.store import Store


def test_store_state_is_read_at_scrape_time(tmp_path: Path, backend_kind: str) -> None:
    capacity = 10 * BLOCK_BYTES
    store = Store(new_backend(backend_kind, tmp_path, capacity_bytes=capacity), capacity)
    with ExitStack() as stack:
        stack.callback(store.close)
        config = ServerConfig(data_dir=tmp_path, capacity=capacity)
        parts = RunParts.create(config, store)
        stack.callback(parts.close)
        servicer = Servicer(store, config, parts)
        metrics = Metrics()
        metrics.watch(store, servicer)
        value = metrics.registry.get_sample_value
        assert value("kvstore_blocks") == 0
        assert value("kvstore_capacity_bytes") == capacity

        a = chain("a", 3)
        store.put(NS, b"", a, LAYERS, block_data(a))
        assert store.lookup(NS, [*a, *chain("b", 2)]) == 3
        # no bookkeeping of its own: the next scrape sees the store as it is now
        assert value("kvstore_blocks") == 3
        assert value("kvstore_stored_bytes") == 3 * BLOCK_BYTES
        assert value("kvstore_namespaces") == 1
        assert value("kvstore_puts_total") == 1
        assert value("kvstore_written_blocks_total") == 3
        assert value("kvstore_written_bytes_total") == 3 * BLOCK_BYTES
        assert value("kvstore_lookups_total") == 1
        assert value("kvstore_lookup_hit_blocks_total") == 3
        assert value("kvstore_lookup_miss_blocks_total") == 2
        assert value("kvstore_evictions_total") == 0
        assert value("kvstore_checksum_failures_total") == 0
        assert value("kvstore_inflight_put_bytes") == 0
        assert value("kvstore_active_watchers") == 0
        assert value("kvstore_events_total") == 1  # the put's stored event
        assert value("kvstore_start_time_seconds") == store.started_at
        info = {"version": __version__, "backend": backend_kind, "store_id": servicer.events.store_id}
        assert value("kvstore_info", info) == 1

        text = generate_latest(metrics.registry).decode()
        assert "# TYPE kvstore_blocks gauge" in text
        assert "# TYPE kvstore_lookups_total counter" in text


def test_calls_errors_and_latency_by_method_and_code() -> None:
    metrics = Metrics()
    metrics.record("Lookup", "OK", 0.0002)
    metrics.record("Lookup", "OK", 0.003)
    metrics.record("Put", "RESOURCE_EXHAUSTED", 0.5)
    value = metrics.registry.get_sample_value
    assert value("kvstore_rpc_calls_total", {"method": "Lookup", "code": "OK"}) == 2
    assert value("kvstore_rpc_errors_total", {"method": "Lookup", "code": "OK"}) is None
    assert value("kvstore_rpc_calls_total", {"method": "Put", "code": "RESOURCE_EXHAUSTED"}) == 1
    assert value("kvstore_rpc_errors_total", {"method": "Put", "code": "RESOURCE_EXHAUSTED"}) == 1
    assert value("kvstore_rpc_duration_seconds_count", {"method": "Lookup"}) == 2
    assert value("kvstore_rpc_duration_seconds_bucket", {"method": "Lookup", "le": "0.0005"}) == 1
    assert value("kvstore_rpc_duration_seconds_bucket", {"method": "Lookup", "le": "0.005"}) == 2


def test_registries_are_private() -> None:
    one, two = Metrics(), Metrics()  # would clash on the global registry
    one.record("Stats", "OK", 0.001)
    assert two.registry.get_sample_value("kvstore_rpc_calls_total", {"method": "Stats", "code": "OK"}) is None
    assert REGISTRY.get_sample_value("kvstore_rpc_calls_total", {"method": "Stats", "code": "OK"}) is None

"""The Prometheus endpoint of a real server (metrics_port 0), scraped over HTTP after real
traffic: every counter moves by exactly what the calls did (in-process servers; the store's
counters on both backends). The ready line's endpoint, and none unless asked: a daemon."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.daemon import eventually

from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, errors

from .helpers import NS, block_bytes, both_backends, chain, make_layers, raw_unary, rows, rpc_code

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
METRICS = {"metrics_port": 0}


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def calls(samples: Samples, method: str, code: str = "OK") -> float:
    return value(samples, "kvstore_rpc_calls_total", method=method, code=code)


def errors_of(samples: Samples, method: str, code: str) -> float:
    return value(samples, "kvstore_rpc_errors_total", method=method, code=code)


def latency_count(samples: Samples, method: str) -> float:
    return value(samples, "kvstore_rpc_duration_seconds_count", method=method)


@both_backends
def test_counters_follow_real_traffic(make_server, backend: str) -> None:
    capacity = 64 * block_bytes(make_layers(1))
    d = make_server(capacity=capacity, **METRICS)
    assert d.metrics_url.startswith("http://127.0.0.1:") and d.metrics_url.endswith("/metrics")
    hashes = chain("metrics", 5)
    layers = make_layers(5, seed=7)
    size = block_bytes(layers)

    with KVStoreClient(d.address, arena=False) as kv:
        before = scrape(d.metrics_url)
        assert value(before, "kvstore_capacity_bytes") == capacity
        assert value(before, "kvstore_blocks") == 0
        info = {"version": "0.1.0", "backend": backend, "store_id": _store_id(before)}
        assert value(before, "kvstore_info", **info) == 1

        kv.put(NS, hashes[:3], rows(layers, 0, 3))
        kv.put(NS, hashes[:3], rows(layers, 0, 3))  # repeated: received again, written once
        assert kv.lookup(NS, hashes) == 3  # 3 hit blocks, 2 missed
        assert kv.lookup(NS, chain("absent", 4)) == 0  # 4 missed
        assert len(kv.select(NS, hashes)) == 2  # a Get stream of 3 blocks
        with pytest.raises(errors.BlockNotFound):
            kv.describe(NS, hashes[4])
        bad = pb.LookupRequest(namespace=NS.encode(), block_hashes=[b"short"])
        assert rpc_code(lambda: raw_unary(d.address, "Lookup", bad, pb.LookupResponse)) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        with pytest.raises(errors.CapacityExceeded):  # larger than the whole store
            kv.put(NS, chain("too-big", 65), make_layers(65))
        after = scrape(d.metrics_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # per RPC, by status code
    assert calls(after, "Put") - calls(before, "Put") == 2
    assert calls(after, "Lookup") - calls(before, "Lookup") == 2
    assert calls(after, "Get") - calls(before, "Get") == 1
    assert calls(after, "Describe", "NOT_FOUND") == 1
    assert errors_of(after, "Describe", "NOT_FOUND") == 1
    assert calls(after, "Lookup", "INVALID_ARGUMENT") == errors_of(after, "Lookup", "INVALID_ARGUMENT") == 1
    assert calls(after, "Put", "RESOURCE_EXHAUSTED") == errors_of(after, "Put", "RESOURCE_EXHAUSTED") == 1
    assert errors_of(after, "Put", "OK") == 0
    assert latency_count(after, "Put") - latency_count(before, "Put") == 3
    assert latency_count(after, "Lookup") - latency_count(before, "Lookup") == 3
    assert latency_count(after, "Get") == 1
    assert value(after, "kvstore_rpc_duration_seconds_sum", method="Get") > 0
    assert value(after, "kvstore_rpc_duration_seconds_bucket", method="Get", le="+Inf") == 1
    # bytes in and out
    # the refused put too: it arrived in full, and the store found at commit it cannot fit
    assert delta("kvstore_received_bytes_total") == (6 + 65) * size
    assert delta("kvstore_written_bytes_total") == 3 * size
    assert delta("kvstore_read_bytes_total") == 3 * size
    # the store, read at scrape time
    assert delta("kvstore_lookups_total") == 2
    assert delta("kvstore_lookup_hit_blocks_total") == 3
    assert delta("kvstore_lookup_miss_blocks_total") == 2 + 4
    assert delta("kvstore_puts_total") == 2
    assert delta("kvstore_written_blocks_total") == 3
    assert value(after, "kvstore_blocks") == 3
    assert value(after, "kvstore_stored_bytes") == 3 * size
    assert value(after, "kvstore_namespaces") == 1
    assert value(after, "kvstore_evictions_total") == 0
    assert value(after, "kvstore_checksum_failures_total") == 0
    assert value(after, "kvstore_inflight_put_bytes") == 0
    assert value(after, "kvstore_events_total") == 1  # one stored event
    assert 0 < value(after, "kvstore_start_time_seconds") <= time.time()
    d.stop()


def test_evictions_and_health_calls(make_server) -> None:
    one = block_bytes(make_layers(1))
    d = make_server(capacity=4 * one, **METRICS)
    with KVStoreClient(d.address, arena=False) as kv:
        kv.put(NS, chain("a", 3), make_layers(3))
        kv.put(NS, chain("b", 3), make_layers(3))  # evicts 2 tails of a
        kv.evict(namespace=NS)  # and the 4 left
        assert kv.health() == "SERVING"
        samples = scrape(d.metrics_url)
    assert value(samples, "kvstore_evictions_total") == 2 + 4
    assert value(samples, "kvstore_blocks") == 0
    assert calls(samples, "Evict") == 1
    # only kvstore.v1.KVStore is counted, not the health service
    assert not any(
        dict(labels).get("method") == "Check" for name, labels in samples if name == "kvstore_rpc_calls_total"
    )


def test_cancelled_stream_and_watchers(make_server) -> None:
    d = make_server(**METRICS)
    with KVStoreClient(d.address, arena=False) as kv:
        watch = kv.watch()  # returns once the daemon holds the subscription
        samples = scrape(d.metrics_url)
        assert value(samples, "kvstore_active_watchers") == 1
        assert calls(samples, "Watch", "CANCELLED") == 0
        watch.cancel()
        # the daemon learns of the cancellation after the client moved on
        eventually(lambda: value(scrape(d.metrics_url), "kvstore_active_watchers") == 0)
        eventually(lambda: calls(scrape(d.metrics_url), "Watch", "CANCELLED") == 1)
        samples = scrape(d.metrics_url)
        assert errors_of(samples, "Watch", "CANCELLED") == 1
        assert latency_count(samples, "Watch") == 1


def test_the_ready_line_names_the_endpoint(make_daemon) -> None:
    d = make_daemon(extra_args=["--metrics-port", "0"])
    assert d.metrics_url.startswith("http://127.0.0.1:") and d.metrics_url.endswith("/metrics")
    assert f"metrics={d.metrics_url})" in d.ready_line
    assert value(scrape(d.metrics_url), "kvstore_blocks") == 0
    assert d.stop() == 0


def test_no_endpoint_unless_asked(daemon) -> None:
    assert daemon.metrics_url == ""
    assert "metrics=" not in daemon.ready_line


def _store_id(samples: Samples) -> str:
    (labels,) = [dict(labels) for name, labels in samples if name == "kvstore_info"]
    return labels["store_id"]


def test_memory_tier_metrics_follow_saves_and_loads_through_the_arena(make_server) -> None:
    d = make_server(**METRICS)
    hashes, layers = chain("metrics-arena", 4), make_layers(4, seed=9)
    before = scrape(d.metrics_url)
    with KVStoreClient(d.address) as kv:  # through the arena
        kv.put(NS, hashes, layers)
        assert kv.select(NS, hashes)
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
    after = scrape(d.metrics_url)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert value(after, "kvstore_memory_capacity_bytes") == 64 * 2**20 - 4096  # the header page
    assert value(after, "kvstore_memory_blocks") == 4
    assert value(after, "kvstore_memory_bytes") == 4 * block_bytes(layers)
    assert (delta("kvstore_commits_total"), delta("kvstore_memory_hit_blocks_total")) == (1, 4)
    assert delta("kvstore_written_behind_blocks_total") == 4
    assert value(after, "kvstore_write_behind_blocks") == 0 and value(after, "kvstore_pinned_bytes") == 0
    assert (
        calls(after, "Reserve")
        == calls(after, "Commit")
        == calls(after, "Pin")
        == calls(after, "Release")
        == 1
    )
    # made on the control socket (the client maps the arena), counted as over gRPC
    assert delta("kvstore_control_calls_total") >= 4
    assert value(after, "kvstore_control_refused_connections_total") == 0

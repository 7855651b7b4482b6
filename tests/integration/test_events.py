"""Watch against a real server: stored/removed events in commit order for every kind of
change, replay after a disconnect, the event window and restarts (in-process servers; the
events come from the store, whatever its backend), and shutdown on SIGTERM (a daemon)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from kvstore_client import Event, KVStoreClient, WatchStream, errors
from kvstore_client.types import EVENT_REMOVED, EVENT_STORED

from .helpers import NS, block_bytes, chain, make_layers

NS2 = "events-ns-2"
ONE_BLOCK = block_bytes(make_layers(1))


def take(stream: WatchStream, n: int) -> list[Event]:
    """The next n events of a stream (blocking: the caller made them happen)."""
    out: list[Event] = []
    events: Iterator[Event] = iter(stream)
    while len(out) < n:
        out.append(next(events))
    return out


def summary(events: list[Event]) -> list[tuple[int, str, bytes, list[bytes]]]:
    return [(e.sequence, e.kind, e.namespace, list(e.block_hashes)) for e in events]


def put(kv: KVStoreClient, hashes: list[bytes], namespace: str = NS, parent: bytes = b"") -> None:
    kv.put(namespace, hashes, make_layers(len(hashes)), parent_hash=parent)


def test_events_in_commit_order_for_every_change(make_server) -> None:
    d = make_server(capacity=str(6 * ONE_BLOCK))
    a, b, c = chain("ev-a", 4), chain("ev-b", 3), chain("ev-c", 2)
    ns = NS.encode()
    with KVStoreClient(d.address) as kv:
        # a fresh server: replaying from 1 sees everything, with no race against the puts
        with kv.watch(from_sequence=1) as stream:
            assert stream.start_sequence == 1
            put(kv, a)  # 1 stored
            put(kv, b)  # 2 removed a[3] (capacity), 3 stored
            kv.evict(namespace=NS, block_hash=a[1])  # 4 removed a[2] and a[1] (Evict)
            kv.drop_select(NS, b, timeout=5)  # 5 removed b (DropSelect)
            put(kv, c, parent=a[0])  # 6 stored, hanging below a[0]
            kv.evict(all=True)  # 7 removed the rest
            events = take(stream, 7)
    assert summary(events) == [
        (1, EVENT_STORED, ns, a),
        (2, EVENT_REMOVED, ns, [a[3]]),
        (3, EVENT_STORED, ns, b),
        (4, EVENT_REMOVED, ns, [a[2], a[1]]),
        (5, EVENT_REMOVED, ns, b),
        (6, EVENT_STORED, ns, c),
        (7, EVENT_REMOVED, ns, [c[1], c[0], a[0]]),  # evicting everything goes newest first
    ]
    assert events[0].parent_hashes == (b"", a[0], a[1], a[2])
    assert events[5].parent_hashes == (a[0], c[0])
    assert all(e.parent_hashes == () for e in events if e.kind == EVENT_REMOVED)
    assert len({e.store_id for e in events}) == 1 and events[0].store_id == stream.store_id
    stamps = [e.timestamp for e in events]
    assert stamps == sorted(stamps) and abs(stamps[-1] - time.time()) < 60


def test_replay_after_a_disconnect_delivers_exactly_the_missed_events(kv: KVStoreClient) -> None:
    chains = [chain(f"replay-{i}", 2) for i in range(5)]
    first = kv.watch()  # only new events; subscribed once it returns
    put(kv, chains[0])
    put(kv, chains[1])
    seen = take(first, 2)
    first.cancel()
    assert list(first) == []  # a cancelled stream just ends
    last = seen[-1].sequence

    put(kv, chains[2])  # while nobody watches
    kv.evict(namespace=NS, block_hash=chains[0][0])
    put(kv, chains[3])
    with kv.watch(from_sequence=last + 1) as again:
        assert again.start_sequence == last + 1
        assert again.store_id == seen[0].store_id
        missed = take(again, 3)
        put(kv, chains[4])
        (live,) = take(again, 1)
    assert [e.sequence for e in seen + missed + [live]] == list(range(seen[0].sequence, live.sequence + 1))
    assert [(e.kind, list(e.block_hashes)) for e in missed] == [
        (EVENT_STORED, chains[2]),
        (EVENT_REMOVED, [chains[0][1], chains[0][0]]),
        (EVENT_STORED, chains[3]),
    ]
    assert list(live.block_hashes) == chains[4]


def test_namespace_filter(kv: KVStoreClient) -> None:
    with kv.watch(from_sequence=1, namespace=NS2) as stream:
        put(kv, chain("f-1", 1))
        put(kv, chain("f-2", 2, NS2), namespace=NS2)
        put(kv, chain("f-3", 1))
        put(kv, chain("f-4", 1, NS2), namespace=NS2)
        events = take(stream, 2)
    assert [(e.sequence, e.namespace) for e in events] == [(2, NS2.encode()), (4, NS2.encode())]


def test_a_sequence_older_than_the_window_is_out_of_range(make_server) -> None:
    d = make_server(event_window=3)
    with KVStoreClient(d.address) as kv:
        for i in range(5):
            put(kv, chain(f"window-{i}", 1))  # sequences 1..5; the daemon holds 3..5
        lost = r"OUT_OF_RANGE: sequence 2 .*window.*resync"
        with pytest.raises(errors.EventsOutOfRange, match=lost) as info:
            kv.watch(from_sequence=2)
        assert info.value.code == "OUT_OF_RANGE"
        with kv.watch(from_sequence=3) as stream:
            assert [e.sequence for e in take(stream, 3)] == [3, 4, 5]
        with kv.watch(from_sequence=6) as stream:  # the next one: nothing missed yet
            assert stream.start_sequence == 6
        with pytest.raises(errors.EventsOutOfRange, match="has not happened yet"):
            kv.watch(from_sequence=7)


def test_a_restart_changes_the_store_id_and_restarts_sequences(make_server) -> None:
    d = make_server()
    with KVStoreClient(d.address) as kv:
        with kv.watch(from_sequence=1) as stream:
            put(kv, chain("restart", 3))
            (before,) = take(stream, 1)
    d.restart()
    with KVStoreClient(d.address) as kv:
        # a router resuming where it left off is told its sequence means nothing here
        with pytest.raises(errors.EventsOutOfRange):
            kv.watch(from_sequence=before.sequence + 1)
        with kv.watch(from_sequence=1) as stream:
            assert stream.store_id != before.store_id
            put(kv, chain("after-restart", 1))
            (after,) = take(stream, 1)
    assert after.sequence == 1
    assert after.store_id == stream.store_id != before.store_id


def test_watchers_are_capped(make_server) -> None:
    d = make_server(max_watchers=2)
    with KVStoreClient(d.address) as kv:
        one, two = kv.watch(), kv.watch()
        with pytest.raises(errors.CapacityExceeded, match="max_watchers"):
            kv.watch()
        two.cancel()
        end = time.monotonic() + 20
        while True:  # the daemon frees the slot once it notices the cancellation
            try:
                three = kv.watch()
                break
            except errors.CapacityExceeded:
                assert time.monotonic() < end, "the cancelled watcher's slot was never freed"
        one.cancel()
        three.cancel()
        with pytest.raises(errors.InvalidRequest):
            kv.watch(namespace="x" * 300)


def test_shutdown_ends_watch_streams_and_exits_0(make_daemon) -> None:
    d = make_daemon(extra_args=["--grace-seconds", "60"])
    with KVStoreClient(d.address) as kv:
        stream = kv.watch()
        put(kv, chain("shutdown", 1))
        take(stream, 1)
        started = time.monotonic()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(errors.StoreUnavailable, match="shutting down"):
            take(stream, 1)
        assert d.stop() == 0
    # the open stream did not hold the daemon for its 60 s grace
    assert time.monotonic() - started < 30
    assert "stopped cleanly" in d.log()

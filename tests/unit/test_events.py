"""kvstore_server.events.EventLog: sequences, the window, filters, waking readers; and the
store feeding it (every removal path emits an event)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kvunit import (
    LAYERS,
    NS,
    NS2,
    backend_file_with,
    block_data,
    chain,
    flip_byte_in_file,
    h,
    layer_bytes,
    new_backend,
)

from kvstore_server import eviction
from kvstore_server.daemon import new_store_id
from kvstore_server.events import MAX_EVENT_BLOCKS, REMOVED, STORED, Event, EventLog, EventsOutOfRange
from kvstore_server.store import Store


def fill(log: EventLog, n: int, ns: bytes = NS) -> None:
    for i in range(n):
        log.record(STORED, ns, [h(f"{ns!r}-{i}")], [b""])


def sequences(events: list[Event] | None) -> list[int]:
    assert events is not None
    return [e.sequence for e in events]


def test_sequences_start_at_1_and_increase_by_one() -> None:
    log = EventLog(10, clock=lambda: 1234.5)
    assert log.next_sequence == 1
    a, b = chain("a", 3), chain("b", 2)
    log.record(STORED, NS, a, [b"", a[0], a[1]])
    log.record(REMOVED, NS2, b, [])
    cursor = log.subscribe(1)
    got = log.read(cursor, timeout=0)
    assert sequences(got) == [1, 2]
    assert got is not None
    first, second = got
    assert (first.kind, first.namespace, first.block_hashes(), first.parent_hashes()) == (
        STORED, NS, a, [b"", a[0], a[1]],
    )  # fmt: skip
    assert first.timestamp == 1234.5
    assert (second.kind, second.namespace, second.block_hashes()) == (REMOVED, NS2, b)
    assert second.parent_hashes() == []
    assert log.next_sequence == 3


def test_parents_that_are_not_a_plain_chain_are_kept_as_given() -> None:
    # an overlapping put stores only its new blocks: their parents are not each other
    a = chain("a", 4)
    log = EventLog(10)
    log.record(STORED, NS, [a[1], a[3]], [a[0], a[2]])
    log.record(STORED, NS, [a[0]], [h("elsewhere")])
    events = log.read(log.subscribe(1), timeout=0)
    assert events is not None
    assert [e.parent_hashes() for e in events] == [[a[0], a[2]], [h("elsewhere")]]


def test_empty_changes_record_nothing() -> None:
    log = EventLog(10)
    log.record(STORED, NS, [], [])
    assert log.next_sequence == 1


def test_large_changes_are_split_into_bounded_events() -> None:
    log = EventLog(10)
    hashes = [h(i) for i in range(2 * MAX_EVENT_BLOCKS + 5)]
    log.record(REMOVED, NS, hashes, [])
    events = log.read(log.subscribe(1), timeout=0)
    assert sequences(events) == [1, 2, 3]
    assert events is not None
    assert [e.num_blocks for e in events] == [MAX_EVENT_BLOCKS, MAX_EVENT_BLOCKS, 5]
    assert [x for e in events for x in e.block_hashes()] == hashes
    stored = [h(f"s{i}") for i in range(MAX_EVENT_BLOCKS + 1)]
    log.record(STORED, NS, stored, [b"", *stored[:-1]])
    tail = log.read(log.subscribe(4), timeout=0)
    assert tail is not None
    # the second part's first parent is the first part's last block
    assert [e.parent_hashes()[0] for e in tail] == [b"", stored[MAX_EVENT_BLOCKS - 1]]


def test_subscribe_from_zero_sees_only_new_events() -> None:
    log = EventLog(10)
    fill(log, 3)
    cursor = log.subscribe(0)
    assert log.read(cursor, timeout=0) == []
    fill(log, 1, NS2)
    assert sequences(log.read(cursor, timeout=0)) == [4]


def test_window_keeps_the_newest_events() -> None:
    log = EventLog(5)
    fill(log, 12)
    assert log.next_sequence == 13
    assert sequences(log.read(log.subscribe(8), timeout=0)) == [8, 9, 10, 11, 12]
    assert sequences(log.read(log.subscribe(10), timeout=0)) == [10, 11, 12]
    assert log.read(log.subscribe(13), timeout=0) == []  # the next one: valid, nothing yet
    with pytest.raises(EventsOutOfRange, match=r"older than .* window .*oldest held: 8.*resync with List"):
        log.subscribe(7)
    with pytest.raises(EventsOutOfRange, match="has not happened yet.*restarted"):
        log.subscribe(14)


def test_a_reader_that_falls_behind_the_window_is_told() -> None:
    log = EventLog(4)
    fill(log, 2)
    cursor = log.subscribe(1)
    assert sequences(log.read(cursor, timeout=0, limit=1)) == [1]
    fill(log, 4)  # sequence 2 is gone now
    with pytest.raises(EventsOutOfRange, match="fell behind"):
        log.read(cursor, timeout=0)


def test_read_limit_and_namespace_filter() -> None:
    log = EventLog(100)
    for i in range(10):
        fill(log, 1, NS if i % 3 == 0 else NS2)
    everything = log.subscribe(1)
    assert sequences(log.read(everything, timeout=0, limit=4)) == [1, 2, 3, 4]
    assert sequences(log.read(everything, timeout=0, limit=4)) == [5, 6, 7, 8]
    only_ns = log.subscribe(1, NS)
    assert sequences(log.read(only_ns, timeout=0)) == [1, 4, 7, 10]
    assert log.read(only_ns, timeout=0) == []


def test_filtered_reads_skip_long_stretches_of_other_namespaces() -> None:
    log = EventLog(10_000)
    fill(log, 5000, NS2)
    fill(log, 1, NS)
    cursor = log.subscribe(1, NS)
    got: list[int] = []
    while not got:  # each read scans a bounded stretch; the cursor moves on regardless
        batch = log.read(cursor, timeout=0, limit=16)
        got = sequences(batch)
    assert got == [5001]


def test_read_waits_for_the_next_event() -> None:
    log = EventLog(10)
    cursor = log.subscribe(0)
    result: list[list[int]] = []
    reader = threading.Thread(target=lambda: result.append(sequences(log.read(cursor, timeout=60))))
    reader.start()
    fill(log, 1)
    reader.join(timeout=30)
    assert result == [[1]]


def test_read_times_out_empty() -> None:
    log = EventLog(10)
    assert log.read(log.subscribe(0), timeout=0.01) == []


def test_cancel_and_close_wake_a_waiting_reader() -> None:
    log = EventLog(10)
    cursor = log.subscribe(0)
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(log.read(cursor, timeout=60)))
    reader.start()
    log.cancel(cursor)
    reader.join(timeout=30)
    assert result == [[]]

    other = log.subscribe(0)
    reader = threading.Thread(target=lambda: result.append(log.read(other, timeout=60)))
    reader.start()
    log.close()
    reader.join(timeout=30)
    assert result == [[], None]
    assert log.read(log.subscribe(0), timeout=60) is None  # closed: at once, from then on


def test_watcher_count() -> None:
    log = EventLog(10)
    a, b = log.subscribe(0), log.subscribe(0, NS)
    assert log.watchers == 2
    log.unsubscribe(a)
    log.unsubscribe(b)
    assert log.watchers == 0


def test_store_id_is_the_runs_and_random_per_run() -> None:
    assert new_store_id() != new_store_id()
    assert len(new_store_id()) == 32  # publish_store_id overwrites in place
    assert EventLog(1, store_id="fixed").store_id == "fixed"


def test_window_must_hold_an_event() -> None:
    with pytest.raises(ValueError):
        EventLog(0)


# ---- fed by a real store: every path that changes the index emits an event ------------
def test_every_store_change_is_an_event(tmp_path: Path, backend_kind: str) -> None:
    capacity = 4 * sum(layer.nbytes for layer in LAYERS)
    store = Store(new_backend(backend_kind, tmp_path, capacity_bytes=capacity), capacity)
    log = EventLog(100)
    store.add_listener(log.record)
    cursor = log.subscribe(1)
    try:
        a, b, c = chain("a", 3), chain("b", 2), chain("c", 1)
        store.put(NS, b"", a, LAYERS, block_data(a))  # 1 stored
        store.put(NS, b"", b, LAYERS, block_data(b))  # 2 removed a[2] (capacity), 3 stored
        with store.take(NS, b, 0.0, lambda: True):  # 4 removed (DropSelect)
            pass
        store.evict(lambda index: eviction.subtree(index, NS, a[1]))  # 5 removed (Evict)
        store.put(NS2, b"", c, LAYERS, block_data(c))  # 6 stored
        flip_byte_in_file(backend_file_with(backend_kind, tmp_path, NS2, c[0]), layer_bytes(c[0], LAYERS[0]))
        with store.read(NS2, c) as result:  # 7 removed (checksum failure)
            assert result.num_blocks == 0
        events = log.read(cursor, timeout=0)
        assert events is not None
        assert [(e.sequence, e.kind, e.namespace, e.block_hashes()) for e in events] == [
            (1, STORED, NS, a),
            (2, REMOVED, NS, [a[2]]),
            (3, STORED, NS, b),
            (4, REMOVED, NS, b),
            (5, REMOVED, NS, [a[1]]),
            (6, STORED, NS2, c),
            (7, REMOVED, NS2, c),
        ]
    finally:
        store.close()

"""The persistent tier's I/O pool: order, the byte budget in flight, failures, close."""

from __future__ import annotations

import threading
import weakref

import pytest

from kvstore_server.tiers.iopool import IOPool


class Tracker:
    """Which tasks are running, and the most that ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[str] = set()
        self.most = 0
        self.log: list[tuple[str, frozenset[str]]] = []  # (task, the others running as it started)

    def task(self, name: str, body=None):
        def run() -> None:
            with self.lock:
                self.log.append((name, frozenset(self.active)))
                self.active.add(name)
                self.most = max(self.most, len(self.active))
            try:
                if body is not None:
                    body()
            finally:
                with self.lock:
                    self.active.discard(name)

        return run


def test_tasks_within_the_budget_run_together_and_the_next_waits_for_room() -> None:
    pool = IOPool(threads=4, inflight_bytes=10)
    t = Tracker()
    both = threading.Barrier(2)  # a and b pass it only if they run at once
    try:
        futures = pool.submit_many(
            [
                (4, t.task("a", lambda: both.wait(10))),
                (4, t.task("b", lambda: both.wait(10))),
                (4, t.task("c")),
            ]
        )
        for f in futures:
            f.result(10)
    finally:
        pool.close()
    started = dict(t.log)
    assert t.most == 2  # a and b together; c (8 + 4 > 10) only once one of them was done
    assert len(started["c"]) <= 1


def test_a_task_over_the_budget_runs_alone_and_later_ones_keep_their_order() -> None:
    pool = IOPool(threads=4, inflight_bytes=10)
    t = Tracker()
    a_started, gate = threading.Event(), threading.Event()

    def a_body() -> None:
        a_started.set()
        gate.wait(10)

    try:
        fa, fb, fc = pool.submit_many([(4, t.task("a", a_body)), (25, t.task("b")), (1, t.task("c"))])
        assert a_started.wait(10)
        assert not fb.running() and not fc.running()  # b waits for room; c may not pass it
        gate.set()
        for f in (fa, fb, fc):
            f.result(10)
    finally:
        pool.close()
    started = dict(t.log)
    assert started["b"] == frozenset()  # alone
    assert [name for name, _ in t.log] == ["a", "b", "c"]


def test_a_failing_task_fails_its_future_only() -> None:
    pool = IOPool(threads=2)

    def boom() -> None:
        raise OSError(5, "Input/output error")

    try:
        bad, good = pool.submit_many([(1, boom), (1, lambda: None)])
        with pytest.raises(OSError, match="Input/output"):
            bad.result(10)
        assert good.result(10) is None
    finally:
        pool.close()


def test_close_runs_what_is_queued_then_refuses_more() -> None:
    pool = IOPool(threads=1)
    t = Tracker()
    gate = threading.Event()
    futures = pool.submit_many(
        [(1, t.task("first", lambda: gate.wait(10)))] + [(1, t.task(f"t{i}")) for i in range(5)]
    )
    gate.set()
    pool.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert [name for name, _ in t.log] == ["first", "t0", "t1", "t2", "t3", "t4"]
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(1, lambda: None)


def test_an_idle_worker_keeps_nothing_of_its_last_task_alive() -> None:
    """A task's closure holds its buffers (a put's heap copies): once it ran, they go,
    though the worker that ran it waits idle for the next."""

    class Buffers:
        pass

    pool = IOPool(threads=2)
    freed = threading.Event()
    held = Buffers()
    gone = weakref.ref(held, lambda _ref: freed.set())
    try:
        pool.submit(1, lambda held=held: None).result(10)
        del held
        assert freed.wait(10), "the idle worker still holds its last task"
        assert gone() is None
    finally:
        pool.close()

"""kvstore_client._shared.Shared: one value per key, made once, counted, closed by its last
holder (outside the lock); a newer key replaces the ones it supersedes; `broken` drops one."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from kvstore_client._shared import Shared


class Resource:
    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key


class Registry:
    """A Shared of Resources by (place, run), a newer run of a place replacing older ones,
    recording what it made and closed."""

    def __init__(self) -> None:
        self.made: list[Resource] = []
        self.closed: list[Resource] = []
        self.shared: Shared[tuple[str, int], Resource] = Shared(
            self._close, replaces=lambda new, old: new[0] == old[0]
        )

    def _close(self, value: Resource) -> None:
        assert not self.shared._lock.locked()  # closed outside the registry's lock
        self.closed.append(value)

    def hold(self, place: str, run: int = 1) -> Resource:
        def make() -> Resource:
            self.made.append(Resource((place, run)))
            return self.made[-1]

        return self.shared.hold((place, run), make)


def test_holders_of_a_key_share_one_value_closed_once_by_the_last() -> None:
    r = Registry()
    a, b = r.hold("x"), r.hold("x")
    assert a is b and r.made == [a]
    assert r.hold("y") is not a  # another key: its own value
    r.shared.let_go(a)
    assert r.closed == []  # b still holds it
    r.shared.let_go(b)
    assert r.closed == [a]
    again = r.hold("x")  # nobody held it: made anew
    assert again is not a and r.made[-1] is again
    with pytest.raises(ValueError):
        r.shared.let_go(a)  # let go of more often than held
    assert r.closed == [a]


def test_a_newer_key_replaces_the_older_one_while_its_holders_keep_it() -> None:
    r = Registry()
    old = r.hold("x", run=1)
    new = r.hold("x", run=2)  # the daemon restarted at the same place
    assert new is not old and r.closed == []
    assert r.hold("x", run=2) is new and r.hold("z", run=1) not in (old, new)  # z: another place
    r.shared.let_go(old)  # its last holder closes it
    assert r.closed == [old]
    assert r.hold("x", run=2) is new  # z replaced nothing
    for _ in range(3):
        r.shared.let_go(new)
    assert r.closed == [old, new]


def test_broken_drops_the_value_for_everyone_and_closes_it_once() -> None:
    r = Registry()
    a, b = r.hold("x"), r.hold("x")
    r.shared.let_go(a, broken=True)
    assert r.closed == [a]  # closed at once, though b holds it
    fresh = r.hold("x")
    assert fresh is not a  # new holders get a new value
    r.shared.let_go(b)  # the other holder lets go: not closed again
    assert r.closed == [a]
    r.shared.let_go(fresh)
    assert r.closed == [a, fresh]


def test_threads_make_one_value_per_key_and_close_each_once() -> None:
    r = Registry()
    start = threading.Barrier(8)

    def use(thread: int) -> None:
        start.wait()
        for i in range(500):
            place = "ab"[(thread + i) % 2]
            value = r.hold(place)
            assert value.key == (place, 1) and value not in r.closed  # never handed out closed
            r.shared.let_go(value)

    threads = [threading.Thread(target=use, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(id(v) for v in r.closed) == Counter(id(v) for v in r.made)  # each made one closed once
    assert not r.shared._current and not r.shared._held  # nothing left held


def test_racing_holders_make_one_value() -> None:
    r = Registry()
    held, start = threading.Barrier(8), threading.Barrier(8)
    got: list[Resource] = []

    def use() -> None:
        start.wait()
        got.append(r.hold("x"))
        held.wait()  # all hold it at once
        r.shared.let_go(got[-1])

    threads = [threading.Thread(target=use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(r.made) == 1 and all(v is r.made[0] for v in got) and r.closed == r.made


def test_a_failed_make_leaves_nothing_held() -> None:
    shared: Shared[str, object] = Shared(lambda value: None)

    def fail() -> object:
        raise OSError("cannot open")

    with pytest.raises(OSError):
        shared.hold("x", fail)
    made = object()
    assert shared.hold("x", lambda: made) is made

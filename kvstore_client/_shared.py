"""`Shared`: resources opened once per process and shared by every client in it that
holds them, counted, and closed when the last holder lets go.

The client keeps two, each tied to one daemon run: the arena file's mapping
(kvstore_client.arena.mapping.MAPPINGS) and the daemon's backend opened read-only for
same-host reads (kvstore_client.local.reads._OPEN_FILES). A vLLM engine has a client in its
scheduler and one in its worker; they share one of each.

    FILES: Shared[Key, Files] = Shared(Files.close)
    files = FILES.hold(key, lambda: Files(...))   # made by the first holder only
    ...
    FILES.let_go(files)                           # the last one closes it
    FILES.let_go(files, broken=True)              # or: nobody should use it any more
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Entry(Generic[K, V]):
    __slots__ = ("closed", "holders", "key", "value")

    def __init__(self, key: K, value: V) -> None:
        self.key = key
        self.value = value
        self.holders = 0
        self.closed = False


class Shared(Generic[K, V]):
    """One value per key, shared by the process's holders and counted (thread-safe).

    `hold(key, make)` hands out the value kept under `key`, made by `make()` when there is
    none (under the registry's lock: racing threads make it once); each hold is matched by
    one `let_go(value)`. The last holder's `let_go` takes the value out of the registry and
    closes it (`close(value)`, outside the lock). `let_go(value, broken=True)`: nobody
    should use it any more: it leaves the registry and is closed at once; its other
    holders still let go of it (it is not closed again), and the next `hold` of its key
    makes a new one.

    `replaces(new_key, old_key)`: when a value is made for `new_key`, the entries of the
    keys it replaces leave the registry (e.g. a newer daemon run's resource at the same
    place as an older run's): new holders get the new value, while the old value's
    holders keep theirs until they let go (the last one closes it).
    """

    def __init__(self, close: Callable[[V], None], *, replaces: Callable[[K, K], bool] | None = None) -> None:
        self._close = close
        self._replaces = replaces
        self._lock = threading.Lock()
        self._current: dict[K, _Entry[K, V]] = {}  # what hold() hands out, by key
        self._held: dict[int, _Entry[K, V]] = {}  # every value still held (current or not), by id

    def hold(self, key: K, make: Callable[[], V]) -> V:
        """The value kept under `key`, made now by `make()` (whatever it raises, raised) if
        there is none; the caller lets go of it when done."""
        with self._lock:
            entry = self._current.get(key)
            if entry is None:
                if self._replaces is not None:
                    for old in [k for k in self._current if self._replaces(key, k)]:
                        del self._current[old]
                value = make()
                entry = self._current[key] = self._held[id(value)] = _Entry(key, value)
            entry.holders += 1
            return entry.value

    def let_go(self, value: V, *, broken: bool = False) -> None:
        """One holder is done with `value`; `broken`: nobody should use it (see the class).
        Raises ValueError for a value not held."""
        with self._lock:
            entry = self._held.get(id(value))
            if entry is None or entry.value is not value:
                raise ValueError("let go of a value that is not held")
            entry.holders -= 1
            if entry.holders == 0:
                del self._held[id(value)]
            close = (entry.holders == 0 or broken) and not entry.closed
            if close:
                entry.closed = True
                if self._current.get(entry.key) is entry:
                    del self._current[entry.key]
        if close:
            self._close(value)

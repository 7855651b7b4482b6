"""The event log behind Watch: blocks stored and removed, numbered in commit order.

    log = EventLog(window=100_000, store_id=store_id)
    store.add_listener(log.record)          # called under the store's lock, in commit order
    cursor = log.subscribe(from_sequence)   # raises EventsOutOfRange for a sequence not held
    batch = log.read(cursor, timeout=1.0)   # events for this cursor, waiting for new ones
    log.close()                             # at shutdown: every read returns at once, closed

Sequences are 1, 2, 3, ... per daemon run; `store_id` is the run's id (random per
run, minted by kvstore_server.daemon), so a watcher that reconnects to a restarted
daemon sees that its sequence numbers mean nothing there. The log keeps the last
`window` events in a ring buffer (O(1) to append and to find a sequence); a watcher
that asks for an older one, or falls that far behind, must resynchronise from List.

`record` runs inside the store's commit, so it does constant work per event
(plus one copy of the hashes), never blocks on a watcher and never raises.
Hashes are kept joined into one bytes object per event, and a stored chain's
parents (each block's parent is the block before it) are kept as just the
first one: a window of 100k events of 128 blocks is ~430 MB, not ~2 GB.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore_server.errors import EventsOutOfRange

STORED = "stored"
REMOVED = "removed"
# Largest number of blocks in one event: a bigger change (evicting everything)
# is split, so no event outgrows a gRPC message (8192 * 2 * 32 bytes = 512 KiB).
MAX_EVENT_BLOCKS = 8192


@dataclass(frozen=True, slots=True)
class Event:
    """One committed change of one namespace. Immutable; shared by every watcher."""

    sequence: int
    kind: str  # STORED or REMOVED
    namespace: bytes
    timestamp: float
    _hashes: bytes
    _width: int
    # None: a chain (each block's parent is the block before it; the first
    # block's is _first_parent); else one parent per block (overlapping puts)
    _parents: tuple[bytes, ...] | None
    _first_parent: bytes

    @property
    def num_blocks(self) -> int:
        return len(self._hashes) // self._width if self._width else 0

    def block_hashes(self) -> list[bytes]:
        w = self._width
        return [self._hashes[i : i + w] for i in range(0, len(self._hashes), w)]

    def parent_hashes(self) -> list[bytes]:
        """One per block for STORED events (b"" where a chain starts); [] for REMOVED."""
        if self.kind != STORED:
            return []
        if self._parents is not None:
            return list(self._parents)
        hashes = self.block_hashes()
        return [self._first_parent, *hashes[:-1]]


def _pack(
    kind: str, hashes: Sequence[bytes], parents: Sequence[bytes]
) -> tuple[bytes, int, tuple[bytes, ...] | None, bytes]:
    """(joined hashes, hash width, parents or None for a plain chain, first parent).

    Hashes of one event have one width (the daemon only accepts 32-byte hashes).
    """
    width = len(hashes[0])
    joined = b"".join(hashes)
    if kind != STORED or not parents:
        return joined, width, None, b""
    if all(parents[i] == hashes[i - 1] for i in range(1, len(hashes))):
        return joined, width, None, parents[0]
    return joined, width, tuple(parents), parents[0]


class Cursor:
    """One watcher's position in the log: the next sequence it wants, and its filter."""

    __slots__ = ("next_sequence", "namespace", "tenant", "cancelled")

    def __init__(self, next_sequence: int, namespace: bytes | None, tenant: bytes = b"") -> None:
        self.next_sequence = next_sequence
        self.namespace = namespace  # exact match, or None for every namespace ...
        self.tenant = tenant  # ... of this tenant (that starts with its bytes)
        self.cancelled = False

    def matches(self, namespace: bytes) -> bool:
        if self.namespace is not None:
            return namespace == self.namespace
        return namespace.startswith(self.tenant)


class EventLog:
    """A bounded window of recent events, appended by the store, read by watchers."""

    def __init__(
        self, window: int = 100_000, *, store_id: str = "", clock: Callable[[], float] = time.time
    ) -> None:
        if window < 1:
            raise ValueError("the event window must hold at least one event")
        self.window = window
        self.store_id = store_id  # the daemon run these sequences belong to
        self._clock = clock
        self._ring: list[Event | None] = [None] * window
        self._next = 1  # the sequence of the next event
        self._closed = False
        self._cond = threading.Condition(threading.Lock())
        self._watchers = 0

    # ---- the store's side
    def record(self, kind: str, namespace: bytes, hashes: Sequence[bytes], parents: Sequence[bytes],
               tokens: Sequence[Sequence[int]] | None = None, tier: str | None = None) -> None:  # fmt: skip
        """Store listener: append the change as one event (or several, if large). Watch
        carries no token ids and no tier: `tokens` and `tier` are for the KV events publisher."""
        if not hashes:
            return
        now = self._clock()
        with self._cond:
            for start in range(0, len(hashes), MAX_EVENT_BLOCKS):
                part = hashes[start : start + MAX_EVENT_BLOCKS]
                part_parents = parents[start : start + MAX_EVENT_BLOCKS] if parents else ()
                joined, width, joined_parents, first = _pack(kind, part, part_parents)
                seq = self._next
                event = Event(seq, kind, namespace, now, joined, width, joined_parents, first)
                self._ring[seq % self.window] = event
                self._next = seq + 1
            self._cond.notify_all()

    # ---- the watchers' side
    @property
    def next_sequence(self) -> int:
        """The sequence the next event will get (1 before any event)."""
        with self._cond:
            return self._next

    def _oldest(self) -> int:
        return max(1, self._next - self.window)

    @property
    def watchers(self) -> int:
        """Cursors subscribed and not yet released."""
        with self._cond:
            return self._watchers

    def subscribe(
        self, from_sequence: int = 0, namespace: bytes | None = None, tenant: bytes = b""
    ) -> Cursor:
        """A cursor at `from_sequence` (0: the next new event). Release it with `unsubscribe`.

        Raises EventsOutOfRange when the sequence is older than the window, or
        newer than any event (it came from another daemon run).
        """
        with self._cond:
            if from_sequence == 0:
                start = self._next
            elif from_sequence < self._oldest():
                raise EventsOutOfRange(
                    f"sequence {from_sequence} is older than the daemon's event window "
                    f"(oldest held: {self._oldest()}); resync with List, then watch from 0"
                )
            elif from_sequence > self._next:
                raise EventsOutOfRange(
                    f"sequence {from_sequence} has not happened yet (next: {self._next}); the daemon "
                    "restarted since (see store_id): resync with List, then watch from 0"
                )
            else:
                start = from_sequence
            self._watchers += 1
            return Cursor(start, namespace, tenant)

    def unsubscribe(self, cursor: Cursor) -> None:
        """Release a cursor; called exactly once per subscribe."""
        with self._cond:
            self._watchers -= 1

    def cancel(self, cursor: Cursor) -> None:
        """Wake the cursor's reader: its next read returns [] at once. Any thread."""
        with self._cond:
            cursor.cancelled = True
            self._cond.notify_all()

    def read(self, cursor: Cursor, timeout: float, limit: int = 256) -> list[Event] | None:
        """Up to `limit` events at or after the cursor (matching its namespace), advancing it.

        Waits up to `timeout` seconds when there is nothing new; then returns [].
        Returns None once the log is closed. Raises EventsOutOfRange if the
        watcher fell behind the window.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                if cursor.cancelled:
                    return []
                if cursor.next_sequence < self._oldest():
                    raise EventsOutOfRange(
                        f"the watcher fell behind the daemon's event window at sequence "
                        f"{cursor.next_sequence} (oldest held: {self._oldest()}); resync with List, "
                        "then watch from 0"
                    )
                out: list[Event] = []
                seq = cursor.next_sequence
                # scan a bounded stretch per call when a filter skips most events
                end = min(self._next, seq + 16 * limit)
                while seq < end and len(out) < limit:
                    event = self._ring[seq % self.window]
                    if event is None or event.sequence != seq:
                        raise RuntimeError(f"event log ring is inconsistent at sequence {seq}")
                    if cursor.matches(event.namespace):
                        out.append(event)
                    seq += 1
                cursor.next_sequence = seq
                if out:
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(remaining)

    def close(self) -> None:
        """Daemon shutdown: every reader returns None now and from then on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

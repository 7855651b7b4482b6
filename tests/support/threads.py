"""Run functions on threads at once and collect what they raised (for the test thread to
assert on: an assert inside a thread would only print)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_all(targets: list[Callable[[], None]]) -> list[BaseException]:
    """Start every target on its own thread, wait for all; what each raised, in no order."""
    errors_seen: list[BaseException] = []

    def wrap(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            errors_seen.append(exc)

    threads = [threading.Thread(target=wrap, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors_seen

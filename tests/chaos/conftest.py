"""The chaos suite: black-box faults against the real daemon process.

Every test here is marked `chaos` (skip them locally with `-m "not chaos"`; CI runs
them). Bounded in time and count, traffic on loopback only, every child process
stopped at the end (the daemon fixtures of tests/conftest.py do that).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.chaos)

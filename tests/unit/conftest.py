from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=["lmdb", "disk"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)

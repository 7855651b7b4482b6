from __future__ import annotations

import pytest


@pytest.fixture(params=["lmdb", "disk"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)

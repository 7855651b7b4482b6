"""Every bench script imports: its names from the harnesses and the packages resolve (a
script is run by hand, on the GPU host or in a note's command, never by the suite)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "_paths")


@pytest.fixture(autouse=True)
def bench_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None and Path(module.__file__).parent == BENCH
    if name.startswith("bench_"):
        assert callable(getattr(module, "main", None)), f"{name}.py has no main()"
    sys.modules.pop(name, None)

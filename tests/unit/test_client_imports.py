"""The client's import rules (docs/architecture.md): it never imports the daemon's package, and
only kvstore_client/_rpc.py imports grpc. Read from the source with ast: nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvstore_client"
GRPC_ALLOWED = {"_rpc.py"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (also inside functions and TYPE_CHECKING)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_walk_sees_the_package() -> None:
    found = {p.relative_to(PACKAGE).as_posix() for p in _modules()}
    assert {"client.py", "_rpc.py", "streams.py", "types.py", "local/reads.py", "local/readers.py"} <= found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_client_never_imports_the_daemon(path: Path) -> None:
    assert "kvstore_server" not in _imported(path)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_only_rpc_imports_grpc(path: Path) -> None:
    grpc = {name for name in _imported(path) if name in ("grpc", "grpc_health")}
    if path.relative_to(PACKAGE).as_posix() in GRPC_ALLOWED:
        return
    assert not grpc, f"{path.name} imports {grpc}; grpc belongs in kvstore_client/_rpc.py"


def test_the_detector_sees_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import grpc.aio as g\nfrom kvstore_server.tiers import LayerSpec\n"
        "def f():\n    from kvstore_server import store\n"
    )
    assert _imported(module) == {"grpc", "kvstore_server"}

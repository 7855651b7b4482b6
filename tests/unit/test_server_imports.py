"""The daemon's and the CLI's import rules: in kvstore_server only the gRPC edge (rpc/)
and main.py, which builds the server, import grpc; kvstore-cli never imports the daemon
(the sizes and names it shares with it are in kvstore/). Read from the source with ast."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_client_imports import _imported

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "kvstore_server"
CLI = ROOT / "kvstore_cli"
GRPC = {"grpc", "grpc_health", "grpc_reflection"}


def _relative(path: Path, package: Path) -> str:
    return path.relative_to(package).as_posix()


@pytest.mark.parametrize("path", sorted(SERVER.rglob("*.py")), ids=lambda p: _relative(p, SERVER))
def test_only_the_rpc_edge_and_main_import_grpc(path: Path) -> None:
    name = _relative(path, SERVER)
    if name.startswith("rpc/") or name == "main.py":
        return
    found = _imported(path) & GRPC
    assert not found, f"{name} imports {found}; grpc belongs in kvstore_server/rpc/"


@pytest.mark.parametrize("path", sorted(CLI.rglob("*.py")), ids=lambda p: _relative(p, CLI))
def test_the_cli_never_imports_the_daemon(path: Path) -> None:
    assert "kvstore_server" not in _imported(path)

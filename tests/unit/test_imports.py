"""The import rules between the floors (docs/architecture.md, "The shape", "Import rules"),
read from the source with ast: nothing is imported or run.

Every `import` and `from ... import` counts wherever it stands (in a function, under
TYPE_CHECKING, in a try), and so does `importlib.import_module("name")` with a literal
name. Relative imports stay inside their own package and are not checked.

Each row of RULES is one rule: the files it covers, the top-level modules they may not
import, and the files (or folders, ending in /) allowed to anyway, each with its reason.
A row with `eager_only` looks only at imports that run when the module is imported (not
inside a function, not under `if TYPE_CHECKING:`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# top-level module -> its folder under the root, from the bottom floor up
PACKAGES = {
    "kvstore": "kvstore/",
    "kvstore_client": "kvstore_client/",
    "kvstore_server": "kvstore_server/",
    "kvstore_cli": "kvstore_cli/",
    "kvstore_proxy": "kvstore_proxy/",
    "kvstore_connector": "connector/kvstore_connector/",
}
EVERYWHERE = tuple(PACKAGES.values())
GRPC = frozenset({"grpc", "grpc_health", "grpc_reflection", "grpc_status"})


def _ours_except(*kept: str) -> frozenset[str]:
    return frozenset(PACKAGES) - set(kept)


@dataclass(frozen=True)
class Rule:
    key: str  # the test id
    says: str
    scope: tuple[str, ...]
    banned: frozenset[str]
    allowed: Mapping[str, str] = field(default_factory=dict)  # file or folder/ -> why
    eager_only: bool = False


RULES = (
    # 1. nothing imports upward
    Rule(
        "kvstore",
        "kvstore/ is the bottom floor: it imports no other package of ours",
        scope=("kvstore/",),
        banned=_ours_except("kvstore"),
    ),
    Rule(
        "client",
        "the client imports kvstore/ only: never the daemon, the CLI, the proxy or the connector",
        scope=("kvstore_client/",),
        banned=_ours_except("kvstore", "kvstore_client"),
    ),
    Rule(
        "server",
        "the daemon imports kvstore/ only: never the client, the CLI, the proxy or the connector",
        scope=("kvstore_server/",),
        banned=_ours_except("kvstore", "kvstore_server"),
    ),
    Rule(
        "cli",
        "the CLI imports the client and kvstore/: never the daemon (what it shares with it is in kvstore/)",
        scope=("kvstore_cli/",),
        banned=_ours_except("kvstore", "kvstore_client", "kvstore_cli"),
    ),
    Rule(
        "proxy",
        "the proxy imports the client and kvstore/: never the daemon",
        scope=("kvstore_proxy/",),
        banned=_ours_except("kvstore", "kvstore_client", "kvstore_proxy"),
    ),
    Rule(
        "connector",
        "the connector reaches the daemon only through the client",
        scope=("connector/kvstore_connector/",),
        banned=frozenset({"kvstore_server", "kvstore_cli", "kvstore_proxy"}),
    ),
    # 2. grpc only at the gRPC edges
    Rule(
        "grpc",
        "grpc is imported only at the gRPC edges",
        scope=EVERYWHERE,
        banned=GRPC,
        allowed={
            "kvstore/v1/": "protoc's generated stubs (scripts/gen_protos.py)",
            "kvstore_client/_rpc.py": "the client's gRPC edge: channel, stubs, RpcError -> client errors",
            "kvstore_server/rpc/": "the daemon's gRPC edge: servicer, validation, status codes, auth",
            "kvstore_server/main.py": "builds the grpc server, registers health and reflection",
        },
    ),
    # 3. torch only where tensors are handled, so `pip install .` needs no torch
    Rule(
        "torch",
        "torch is imported only by the connector and the client's tensor modules",
        scope=EVERYWHERE,
        banned=frozenset({"torch"}),
        allowed={
            "connector/kvstore_connector/": "moves KV between vLLM's paged torch buffers and the store",
            "kvstore_client/tensors.py": "dtype names and zero-copy byte views of tensors (lazy)",
            "kvstore_client/arena/mapping.py": "the whole arena as one uint8 tensor (lazy)",
            "kvstore_client/arena/views.py": "typed views over extents (annotations only, under TYPE_CHECKING)",
            "kvstore_client/arena/save.py": "reservations as tensors, tensor writes (lazy)",
            "kvstore_client/arena/load.py": "pinned blocks as tensors (annotations only, under TYPE_CHECKING)",
            "kvstore_client/streams.py": "yields a Get's layers as tensors (lazy)",
            "kvstore_client/client.py": "annotations only, under TYPE_CHECKING",
            "kvstore_client/types.py": "annotations only, under TYPE_CHECKING",
        },
    ),
    Rule(
        "client-torch-lazy",
        "importing the client needs no torch: only inside functions or under TYPE_CHECKING",
        scope=("kvstore_client/",),
        banned=frozenset({"torch"}),
        eager_only=True,
    ),
    # the daemon, the CLI, the proxy and kvstore/ stay free of vLLM (STYLE.md, "Light imports")
    Rule(
        "vllm",
        "vllm is imported only by the connector",
        scope=EVERYWHERE,
        banned=frozenset({"vllm"}),
        allowed={"connector/kvstore_connector/": "it implements vLLM's KVConnectorBase_V1"},
    ),
)


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # dotted, as written
    text: str  # the statement, for messages
    eager: bool  # runs when the module is imported

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(call: ast.Call) -> str | None:
    """The name in `importlib.import_module("x")`, `import_module("x")` or `__import__("x")`."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imports(source: str, filename: str = "<source>") -> list[Import]:
    """Every absolute import in `source`, in order, with whether it runs at import time."""
    found: list[Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(node.lineno, a.name, ast.unparse(node), eager) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(node.lineno, node.module, ast.unparse(node), eager))
        elif isinstance(node, ast.Call) and (name := _dynamic_import(node)):
            found.append(Import(node.lineno, name, ast.unparse(node), eager))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            eager = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                visit(stmt, False)
            for stmt in node.orelse:
                visit(stmt, eager)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(ast.parse(source, filename), True)
    return sorted(found, key=lambda i: i.line)


def _under(path: str, entry: str) -> bool:
    return path.startswith(entry) if entry.endswith("/") else path == entry


def python_files(root: Path, entries: Iterable[str]) -> Iterator[str]:
    """The .py files (paths relative to `root`) of each file or folder/ in `entries`."""
    for entry in entries:
        if entry.endswith("/"):
            yield from sorted(p.relative_to(root).as_posix() for p in (root / entry).rglob("*.py"))
        elif (root / entry).is_file():
            yield entry


def violations(rule: Rule, root: Path = ROOT) -> list[str]:
    """One line per import that breaks `rule`: file, line, statement."""
    found = []
    for path in python_files(root, rule.scope):
        if any(_under(path, entry) for entry in rule.allowed):
            continue
        for imp in imports((root / path).read_text(), path):
            if imp.top in rule.banned and (imp.eager or not rule.eager_only):
                found.append(f"{path}:{imp.line}: `{imp.text}`")
    return found


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.key)
def test_the_tree_keeps_the_rule(rule: Rule) -> None:
    broken = violations(rule)
    assert not broken, f"{rule.says}; these break it:\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.key)
def test_the_rule_names_real_files(rule: Rule) -> None:
    # a moved package would make its rule pass on nothing, a moved module leave a stale exemption
    assert list(python_files(ROOT, rule.scope)), f"{rule.key}: no file under {rule.scope}"
    stale = [entry for entry in rule.allowed if not list(python_files(ROOT, [entry]))]
    assert not stale, f"{rule.key}: allowed but not in the tree: {stale}"


def test_the_walk_sees_the_packages() -> None:
    found = set(python_files(ROOT, EVERYWHERE))
    assert {
        "kvstore/wire.py",
        "kvstore/v1/kvstore_pb2_grpc.py",
        "kvstore_client/client.py",
        "kvstore_client/_rpc.py",
        "kvstore_client/streams.py",
        "kvstore_client/types.py",
        "kvstore_client/local/reads.py",
        "kvstore_client/local/readers.py",
        "kvstore_server/main.py",
        "kvstore_server/rpc/servicer.py",
        "kvstore_server/tiers/base.py",
        "kvstore_cli/main.py",
        "kvstore_proxy/main.py",
        "connector/kvstore_connector/connector.py",
    } <= found


def test_the_detector_sees_every_kind_of_import() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import grpc.aio as g\n"
        "from kvstore_server.tiers import LayerSpec\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "def f():\n"
        "    from kvstore_server import store\n"
        "    return importlib.import_module('vllm.config')\n"
    )
    found = [(i.line, i.top, i.eager) for i in imports(source)]
    assert found == [
        (1, "typing", True),
        (2, "grpc", True),
        (3, "kvstore_server", True),
        (6, "torch", False),
        (8, "kvstore_server", False),
        (9, "vllm", False),
    ]


def test_a_planted_violation_is_reported(tmp_path: Path) -> None:
    planted = {
        # a lazy upward import from the bottom floor
        "kvstore/blocks.py": "import os\n\ndef f():\n    from kvstore_server.store import Store\n",
        # allowed: the client's gRPC edge and its tensor helpers, lazily or for annotations
        "kvstore_client/_rpc.py": "import grpc\n",
        "kvstore_client/tensors.py": "if TYPE_CHECKING:\n    import torch\n\ndef f():\n    import torch\n",
        # grpc outside the edge, torch outside the tensor modules and at import time
        "kvstore_client/helpers.py": "import torch\nfrom grpc_health.v1 import health\n",
        "kvstore_cli/main.py": "from kvstore_client import KVStoreClient\nimport kvstore_server.config\n",
        "kvstore_server/store.py": "import vllm\n",
    }
    for path, text in planted.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    reported = {rule.key: violations(rule, tmp_path) for rule in RULES}
    assert {key: lines for key, lines in reported.items() if lines} == {
        "kvstore": ["kvstore/blocks.py:4: `from kvstore_server.store import Store`"],
        "cli": ["kvstore_cli/main.py:2: `import kvstore_server.config`"],
        "grpc": ["kvstore_client/helpers.py:2: `from grpc_health.v1 import health`"],
        "torch": ["kvstore_client/helpers.py:1: `import torch`"],
        "client-torch-lazy": ["kvstore_client/helpers.py:1: `import torch`"],
        "vllm": ["kvstore_server/store.py:1: `import vllm`"],
    }

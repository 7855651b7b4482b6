"""Check KVStoreConnector against a vLLM source tree's KVConnectorBase_V1, without importing vLLM.

    python scripts/check_vllm_api.py /path/to/vllm        # a checkout, site-packages, or vllm/
    python -m kvstore_connector.api_check /path/to/vllm

Parses the tree's vllm/distributed/kv_transfer/kv_connector/v1/base.py and this
package's connector.py with `ast`, lists every public method and property of
KVConnectorBase_V1 with what the connector does about it, and exits 1 when

- an abstract method is not implemented by KVStoreConnector, or
- a hook is neither implemented nor decided in connector.INHERITED_HOOKS
  (name -> why the base's default is right), or
- a hook is both implemented and listed as inherited.

A new vLLM that adds a hook thus fails the check until someone decides what the
connector should declare. Decisions for hooks the given vLLM lacks (other versions')
are listed, not errors. Private names (a leading underscore) are not hooks.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BASE_CLASS = "KVConnectorBase_V1"
CONNECTOR_CLASS = "KVStoreConnector"
TABLE = "INHERITED_HOOKS"
BASE_PATH = Path("distributed/kv_transfer/kv_connector/v1/base.py")  # inside the vllm package
CONNECTOR_PY = Path(__file__).with_name("connector.py")


@dataclass(frozen=True)
class Hook:
    name: str
    kind: str  # "method", "property", "classmethod", "staticmethod"
    abstract: bool


@dataclass(frozen=True)
class Report:
    hooks: list[Hook]
    implemented: set[str]
    decided: dict[str, str]

    @property
    def missing_abstract(self) -> list[Hook]:
        return [h for h in self.hooks if h.abstract and h.name not in self.implemented]

    @property
    def undecided(self) -> list[Hook]:
        return [
            h
            for h in self.hooks
            if not h.abstract and h.name not in self.implemented and h.name not in self.decided
        ]

    @property
    def contradictory(self) -> list[str]:
        return sorted(self.implemented & set(self.decided))

    @property
    def problems(self) -> int:
        return len(self.missing_abstract) + len(self.undecided) + len(self.contradictory)


def find_base(tree: Path) -> Path:
    """base.py of a vLLM tree: a source checkout or site-packages (holding vllm/), the vllm
    package directory itself, or the file."""
    if tree.is_file():
        return tree
    for candidate in (tree / "vllm" / BASE_PATH, tree / BASE_PATH):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no vllm/{BASE_PATH} under {tree}")


def _class(module: ast.Module, name: str, where: Path) -> ast.ClassDef:
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"no class {name} in {where}")


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)  # abc.abstractmethod, functools.cached_property, x.setter
    return names


def base_hooks(base_py: Path) -> list[Hook]:
    """Public methods and properties of KVConnectorBase_V1, in source order."""
    cls = _class(ast.parse(base_py.read_text(), str(base_py)), BASE_CLASS, base_py)
    hooks: dict[str, Hook] = {}
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        decorators = _decorator_names(node)
        kind = next(
            (k for k in ("property", "cached_property", "classmethod", "staticmethod") if k in decorators),
            "method",
        )
        previous = hooks.get(node.name)  # a property's setter repeats its name
        abstract = "abstractmethod" in decorators or (previous is not None and previous.abstract)
        hooks[node.name] = Hook(node.name, previous.kind if previous else kind, abstract)
    return list(hooks.values())


def connector_side(connector_py: Path = CONNECTOR_PY) -> tuple[set[str], dict[str, str]]:
    """What connector.py's class defines, and its table of inherited hooks."""
    module = ast.parse(connector_py.read_text(), str(connector_py))
    cls = _class(module, CONNECTOR_CLASS, connector_py)
    implemented: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            implemented.add(node.name)
        elif isinstance(node, ast.Assign):
            implemented.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            implemented.add(node.target.id)
    for node in module.body:
        value = None
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == TABLE for t in node.targets
        ):
            value = node.value
        elif (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == TABLE
        ):
            value = node.value
        if value is not None:
            table = ast.literal_eval(value)
            if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
                raise ValueError(f"{TABLE} in {connector_py} must be a dict literal of name -> decision")
            return implemented, {k: str(v) for k, v in table.items()}
    raise LookupError(f"no {TABLE} table in {connector_py}")


def check(tree: Path, connector_py: Path = CONNECTOR_PY) -> Report:
    implemented, decided = connector_side(connector_py)
    return Report(base_hooks(find_base(tree)), implemented, decided)


def _version(base_py: Path) -> str:
    """The tree's vLLM version, where it says (a built tree's vllm/_version.py)."""
    package = base_py.parents[len(BASE_PATH.parts) - 1]
    for name in ("_version.py", "version.py"):
        path = package / name
        if path.is_file():
            # __version__ = version = '0.32.0'
            found = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", path.read_text(),
                              re.MULTILINE)  # fmt: skip
            if found:
                return found.group(1)
    return "version not found"


def render(report: Report, base_py: Path) -> list[str]:
    lines = [
        f"{BASE_CLASS} of {base_py} (vLLM {_version(base_py)}): {len(report.hooks)} methods and properties"
    ]
    for hook in report.hooks:
        what = f"{hook.name} ({'abstract ' if hook.abstract else ''}{hook.kind})"
        if hook.name in report.implemented:
            status = "implemented"
            if hook.name in report.decided:
                status += f"  ERROR: also in {TABLE} as inherited; keep one"
        elif hook.abstract:
            status = f"ERROR: abstract, not implemented by {CONNECTOR_CLASS}"
        elif hook.name in report.decided:
            status = f"inherited: {report.decided[hook.name]}"
        else:
            status = (
                f"ERROR: undecided: neither implemented by {CONNECTOR_CLASS} nor in {TABLE} "
                "(connector.py): implement it, or add it there with why the base's default is right"
            )
        lines.append(f"  {what:<48} {status}")
    names = {h.name for h in report.hooks}
    elsewhere = sorted(set(report.decided) - names)
    if elsewhere:
        lines.append(f"decided for hooks this vLLM does not have: {', '.join(elsewhere)}")
    if report.problems:
        parts = []
        if report.missing_abstract:
            parts.append(f"abstract, not implemented: {', '.join(h.name for h in report.missing_abstract)}")
        if report.undecided:
            parts.append(f"undecided: {', '.join(h.name for h in report.undecided)}")
        if report.contradictory:
            parts.append(f"implemented and listed as inherited: {', '.join(report.contradictory)}")
        lines.append(f"FAILED: {'; '.join(parts)}")
    else:
        lines.append(f"OK: every hook is implemented by {CONNECTOR_CLASS} or decided in {TABLE}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "vllm_tree", type=Path, help="a vLLM checkout, site-packages, the vllm package, or base.py"
    )
    args = parser.parse_args(argv)
    try:
        base_py = find_base(args.vllm_tree)
        report = check(base_py)
    except (OSError, LookupError, SyntaxError, ValueError) as exc:
        print(f"check_vllm_api: {exc}", file=sys.stderr)
        return 2
    for line in render(report, base_py):
        print(line)
    return 1 if report.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())

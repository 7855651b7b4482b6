"""Regenerate the protobuf/gRPC Python code from protos/.

    python scripts/gen_protos.py            # rewrite kvstore/v1/*_pb2*.py
    python scripts/gen_protos.py --check    # exit 1 if the committed code is stale

Needs the `dev` extra (a pinned grpcio-tools, so the output is reproducible).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "kvstore/v1/kvstore.proto"
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # imported here: only the dev extra has it

    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "protos" / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    opts = parser.parse_args(argv)
    target = ROOT / "kvstore" / "v1"
    if not opts.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "kvstore" / "v1"
        stale = [name for name in GENERATED if not filecmp.cmp(fresh / name, target / name, shallow=False)]
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run: python scripts/gen_protos.py", file=sys.stderr)
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

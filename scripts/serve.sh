#!/usr/bin/env bash
# Run the daemon with its embedded defaults (LMDB, 127.0.0.1:50051,
# ~/.local/share/kvstore), installing it into .venv first if needed.
# Arguments go to kvstore-server, e.g. scripts/serve.sh --capacity 64GiB
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
# (re)install when the daemon or one of its dependencies is missing
python -c "import kvstore_server.main" 2>/dev/null || pip install -q -c requirements/constraints.txt -e .
exec kvstore-server "$@"

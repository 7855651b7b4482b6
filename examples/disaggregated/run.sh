#!/usr/bin/env bash
# Disaggregated prefill through the kvstore daemon:
#   1. start kvstore-server (its own process)
#   2. prefill.py (kv_producer) computes the prompts' KV and saves it
#   3. decode.py (kv_consumer, another process) loads it and generates (on this host it
#      reads the daemon's files directly, the same-host fast path; gRPC stays the control plane)
# Usage: examples/disaggregated/run.sh [MODEL]   (default: a random tiny Llama, built offline)
# Needs the repo's .venv with vLLM (scripts/test.sh sets it up).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
. .venv/bin/activate
work=$(mktemp -d)
trap 'kill $server_pid 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT
model=${1:-$(python "$here/make_model.py" "$work/model")}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}

coproc SERVER { exec kvstore-server --listen 127.0.0.1:0 --data-dir "$work/data" --capacity 4GiB 2>"$work/server.log"; }
server_pid=$SERVER_PID
read -r ready <&"${SERVER[0]}"          # "kvstore-server ready on HOST:PORT ..."
KVSTORE_ADDRESS=$(echo "$ready" | awk '{print $4}')
export KVSTORE_ADDRESS
echo "== $ready"

echo "== prefill"
python "$here/prefill.py" "$model" 2>&1 | grep -E "^prefilled|KVStoreConnector" || true
kvstore-cli stats
echo "== decode"
python "$here/decode.py" "$model" 2>&1 | grep -E "prompt:|KV Transfer|kvstore" || true
kvstore-cli stats --json

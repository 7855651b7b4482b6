#!/bin/sh
# Entry point of the kvstore server image: maps environment variables to
# kvstore-server flags, then execs the daemon (PID 1 of the container, so
# `docker stop`'s SIGTERM reaches it: NOT_SERVING, drain, exit 0).
#
#   KVSTORE_LISTEN     HOST:PORT to serve on          (default 0.0.0.0:50051)
#   KVSTORE_DATA_DIR   data directory                 (default /data, the image's volume)
#   KVSTORE_CAPACITY   byte budget, e.g. 64GiB        (default: the daemon's, 8GiB)
#   KVSTORE_BACKEND    lmdb | disk                    (default: the daemon's, lmdb)
#   KVSTORE_MEMORY     memory tier (arena) size, 0: off (default: the daemon's, 1GiB where it fits;
#                      the container's /dev/shm must hold it: compose's shm_size)
#   KVSTORE_SYNC       1: fsync every commit          (default 0)
#   KVSTORE_LOG_LEVEL  DEBUG | INFO | WARNING | ERROR (default: the daemon's, INFO)
#   KVSTORE_INSECURE   1: pass --insecure, allowing a non-loopback listen address
#                      without auth/TLS, on daemons that have that flag (default 0)
#   KVSTORE_FLEET      the fleet tier, e.g. redis+cluster://redis-1:6379,redis-2:6379 (default: none)
#   KVSTORE_FLEET_PREFIX  prefix of every fleet key (default: none)
#
# Arguments given to the container (compose `command:`) come after these, so
# any other flag works (--config FILE, --workers N, ...) and overrides them.
set -eu

# Flags from the environment go first, the container's arguments last (they win).
if [ "${KVSTORE_INSECURE:-0}" = 1 ]; then
    # Daemons that refuse a non-loopback address without auth/TLS take --insecure;
    # older ones don't know the flag (and don't need it), so ask the daemon itself.
    if kvstore-server --help 2>/dev/null | grep -qE -e '(^|[[:space:]])--insecure([[:space:],=]|$)'; then
        set -- --insecure "$@"
    fi
fi
if [ "${KVSTORE_SYNC:-0}" = 1 ]; then
    set -- --sync "$@"
fi
if [ -n "${KVSTORE_LOG_LEVEL:-}" ]; then
    set -- --log-level "$KVSTORE_LOG_LEVEL" "$@"
fi
if [ -n "${KVSTORE_BACKEND:-}" ]; then
    set -- --backend "$KVSTORE_BACKEND" "$@"
fi
if [ -n "${KVSTORE_MEMORY:-}" ]; then
    set -- --memory "$KVSTORE_MEMORY" "$@"
fi
if [ -n "${KVSTORE_FLEET_PREFIX:-}" ]; then
    set -- --fleet-prefix "$KVSTORE_FLEET_PREFIX" "$@"
fi
if [ -n "${KVSTORE_FLEET:-}" ]; then
    set -- --fleet "$KVSTORE_FLEET" "$@"
fi
if [ -n "${KVSTORE_CAPACITY:-}" ]; then
    set -- --capacity "$KVSTORE_CAPACITY" "$@"
fi
set -- --listen "${KVSTORE_LISTEN:-0.0.0.0:50051}" --data-dir "${KVSTORE_DATA_DIR:-/data}" "$@"

exec kvstore-server "$@"

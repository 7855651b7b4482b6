"""The baselines of bench/bench_store.py, each the same work without the daemon: a plain
memcpy of the tensors, raw LMDB in this process, a private redis-server, a bare gRPC stream
on loopback (the transport's ceiling; its server is bench_store.py --_ceiling-server) and
raw parallel disk I/O in the persistent tier's shape (the persistent part's ceilings).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from store_harness import (
    OUR_PIDS,
    IoResult,
    PathResult,
    Workload,
    best_of,
    drop_page_cache,
    join_block,
    layer_views,
    new_hashes,
    rate,
    scatter_blocks,
    timed_pass,
)
from support.ports import free_port

from kvstore.sizes import format_size


# ---------------------------------------------------------------------------- plain memcpy
def bench_memcpy(args: argparse.Namespace, w: Workload) -> PathResult:
    """A plain copy of the same bytes, request by request, into buffers allocated once:
    what moving a request's KV costs with no store at all (the arena rows' yardstick)."""
    import torch

    res = PathResult("plain memcpy (baseline)")
    dests: dict[tuple, torch.Tensor] = {}
    batches = w.batches(new_hashes(w.num_blocks))

    def copy() -> None:
        for _first, _hs, layers in batches:
            for t in layers.values():
                key = (tuple(t.shape), t.dtype)
                dst = dests.get(key)
                if dst is None:
                    dst = dests[key] = torch.empty_like(t)
                dst.copy_(t)

    copy()  # fault the destinations in
    res.store_warm = res.load_warm = best_of(
        "plain memcpy of a pass", w.total_bytes, copy, args.repeat, res.passes
    )
    return res


# ---------------------------------------------------------------------------- raw LMDB
def bench_raw_lmdb(args: argparse.Namespace, w: Workload, root: Path) -> PathResult:
    import lmdb

    res = PathResult("raw LMDB (in-process)")
    path = root / "raw-lmdb"
    path.mkdir()
    env = lmdb.open(
        str(path),
        map_size=4 * w.total_bytes + (1 << 30),
        max_dbs=1,
        sync=args.sync,
        metasync=args.sync,
        readahead=False,
    )
    db = env.open_db(b"data")
    lb = w.layer_block_bytes
    nbytes = w.total_bytes
    state = {"hashes": new_hashes(w.num_blocks)}

    def store() -> None:
        for _first, hs, layers in w.batches(state["hashes"]):
            views = layer_views(layers)
            with env.begin(write=True, db=db) as txn:
                for i, h in enumerate(hs):
                    txn.put(h, join_block(views, i, lb))

    def load() -> None:
        hashes = state["hashes"]
        for first in range(0, len(hashes), w.blocks_per_put):
            hs = hashes[first : first + w.blocks_per_put]
            with env.begin(db=db, buffers=True) as txn:
                values = [txn.get(h) for h in hs]
                if any(v is None for v in values):
                    raise RuntimeError("raw lmdb: missing block")
                scatter_blocks(values, w.layers, lb)

    def fresh() -> None:
        with env.begin(write=True) as txn:
            txn.drop(db, delete=False)
        state["hashes"] = new_hashes(w.num_blocks)

    try:
        res.store_cold = timed_pass("store, cold (fresh env)", nbytes, store, res.passes)
        res.store_warm = best_of("store, warm (after drop)", nbytes, store, args.repeat, res.passes, fresh)
        res.load_first = timed_pass("load, first pass", nbytes, load, res.passes)
        res.load_warm = best_of("load, warm", nbytes, load, args.repeat, res.passes)
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------- redis
def bench_redis(args: argparse.Namespace, w: Workload, root: Path) -> PathResult:
    res = PathResult("redis (pipelined)")
    exe = shutil.which("redis-server")
    if exe is None:
        res.notes.append("skipped: redis-server not installed (apt-get install -y redis-server)")
        print(f"    {res.notes[-1]}")
        return res
    try:
        import redis
    except ImportError:
        res.notes.append("skipped: redis-py not installed")
        print(f"    {res.notes[-1]}")
        return res
    port = free_port()
    rdir = root / "redis"
    rdir.mkdir()
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(rdir),
            "--protected-mode",
            "no",
            "--proto-max-bulk-len",
            "512mb",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    OUR_PIDS["redis"] = proc.pid
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            import hiredis  # noqa: F401

            res.notes.append("redis-py with the hiredis parser")
        except ImportError:
            res.notes.append("redis-py with its pure-Python parser (hiredis not installed)")
        if args.sync:
            res.notes.append("redis runs without persistence even with --sync")
        lb = w.layer_block_bytes
        nbytes = w.total_bytes
        state = {"hashes": new_hashes(w.num_blocks)}

        def store() -> None:
            for _first, hs, layers in w.batches(state["hashes"]):
                views = layer_views(layers)
                pipe = r.pipeline(transaction=False)
                for i, h in enumerate(hs):
                    pipe.set(h, join_block(views, i, lb))
                pipe.execute()

        def load() -> None:
            hashes = state["hashes"]
            for first in range(0, len(hashes), w.blocks_per_put):
                hs = hashes[first : first + w.blocks_per_put]
                pipe = r.pipeline(transaction=False)
                for h in hs:
                    pipe.get(h)
                values = pipe.execute()
                if any(v is None for v in values):
                    raise RuntimeError("redis: missing block")
                scatter_blocks(values, w.layers, lb)

        def fresh() -> None:
            r.flushall()
            state["hashes"] = new_hashes(w.num_blocks)

        res.store_cold = timed_pass("store, cold (fresh server)", nbytes, store, res.passes)
        res.store_warm = best_of(
            "store, warm (after FLUSHALL)", nbytes, store, args.repeat, res.passes, fresh
        )
        res.load_first = timed_pass("load, first pass", nbytes, load, res.passes)
        res.load_warm = best_of("load, warm", nbytes, load, args.repeat, res.passes)
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        OUR_PIDS.pop("redis", None)
    return res


# ---------------------------------------------------------------------------- raw gRPC ceiling
_CEIL_SERVICE = "bench.Ceiling"


def ceiling_server() -> int:
    """Hidden mode: a trivial gRPC server (Sink: stream of bytes in; Source: stream of bytes out)."""
    from concurrent import futures

    import grpc

    from kvstore import wire

    def sink(requests, context):
        n = 0
        for msg in requests:
            n += len(msg)
        return n.to_bytes(8, "little")

    def source(request, context):
        count = int.from_bytes(request[:8], "little")
        size = int.from_bytes(request[8:16], "little")
        payload = os.urandom(1024) * (size // 1024)
        for _ in range(count):
            yield payload

    handlers = {
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(source),
    }
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=[
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
        ],
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_CEIL_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"ready {port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0)
    return 0


def bench_ceiling(args: argparse.Namespace, w: Workload) -> PathResult:
    """Bytes through a trivial Python gRPC stream on loopback, in messages of the size the
    daemon path sends (one layer's slice of a put, capped by chunk_bytes)."""
    import grpc

    from kvstore import wire

    msg = min(args.chunk_bytes, w.blocks_per_put * w.layer_block_bytes)
    msg -= msg % 1024
    res = PathResult(f"raw gRPC, {format_size(msg)} msgs")
    # the server is bench_store.py's hidden mode (its main() dispatches --_ceiling-server)
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("bench_store.py")), "--_ceiling-server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **args.daemon_env},
    )
    OUR_PIDS["server"] = proc.pid
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[
                ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES),
            ],
        )
        sink = channel.stream_unary(f"/{_CEIL_SERVICE}/Sink")
        source = channel.unary_stream(f"/{_CEIL_SERVICE}/Source")
        per_call = max(1, (w.blocks_per_put * w.block_bytes) // msg)
        calls = max(1, min(w.total_bytes, 1 << 30) // (per_call * msg))
        payload = os.urandom(1024) * (msg // 1024)
        nbytes = calls * per_call * len(payload)

        def up() -> None:
            for _ in range(calls):
                got = int.from_bytes(sink(iter([payload] * per_call), timeout=60), "little")
                assert got == per_call * len(payload)

        def down() -> None:
            req = per_call.to_bytes(8, "little") + len(payload).to_bytes(8, "little")
            for _ in range(calls):
                n = 0
                for m in source(req, timeout=60):
                    n += len(m)
                assert n == per_call * len(payload)

        up()  # warm-up
        res.store_warm = best_of("grpc upload (client -> server)", nbytes, up, args.repeat, res.passes)
        down()
        res.load_warm = best_of("grpc download (server -> client)", nbytes, down, args.repeat, res.passes)
        channel.close()
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)
        OUR_PIDS.pop("server", None)
    return res


# ---------------------------------------------------------------------------- raw I/O ceilings
def raw_io_ceilings(directory: Path, res: IoResult) -> None:
    """Parallel pwritev / preadv of res.nbytes in res.request-byte requests from res.threads
    threads on one preallocated file, the persistent tier's own shape (tiers.segments: one
    request per block from IOPool's threads, O_DIRECT writes where the filesystem takes
    them, buffered reads): write + fdatasync; read after drop_caches; read from the page
    cache."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "io-ceiling.bin"
    request, threads = res.request, res.threads
    total = res.nbytes - res.nbytes % request
    # page-aligned, as O_DIRECT wants; all of it: each request moves its own memory, as the
    # tier's do (reusing a few buffers kept them in the CPU's caches, a ceiling no load of
    # distinct memory reaches)
    buf = mmap.mmap(-1, total)
    noise = os.urandom(1 << 16)
    for at in range(0, len(buf), len(noise)):
        buf[at : at + len(noise)] = noise[: len(buf) - at]
    views = [memoryview(buf)[at : at + request] for at in range(0, total, request)]
    offsets = range(0, total, request)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    wfd = -1
    try:
        os.posix_fallocate(fd, 0, total)
        try:  # probe O_DIRECT as Segments does: open it and write one aligned request
            wfd = os.open(path, os.O_RDWR | os.O_DIRECT)
            os.pwritev(wfd, [views[0]], 0)
            res.direct = True
        except (OSError, AttributeError) as exc:
            if wfd >= 0:
                os.close(wfd)
            wfd = os.dup(fd)
            res.notes.append(
                f"O_DIRECT refused here ({exc}): buffered writes, as the persistent tier falls back"
            )

        def run(op: Callable[[int, list[memoryview], int], int], use_fd: int) -> None:
            def one(i: int) -> None:
                op(use_fd, [views[i]], offsets[i])

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(len(offsets))))

        marks: dict[str, float] = {}

        def write() -> None:
            marks["start"] = time.perf_counter()
            run(os.pwritev, wfd)
            marks["written"] = time.perf_counter()
            os.fdatasync(fd)

        mode = "O_DIRECT " if res.direct else ""
        res.write = timed_pass(f"raw pwritev {mode}+ fdatasync", total, write, res.passes)
        res.write_nosync = rate(total, marks["written"] - marks["start"])
        # NOTE: the first read of freshly written extents after a drop ran at half the rate
        # of later ones here (3x the system time): one untimed pass takes that, as the
        # daemon's first cold load does before its dropped-cache one
        if drop_page_cache():
            run(os.preadv, fd)
            drop_page_cache()
            res.read_disk = timed_pass(
                "raw preadv, page cache dropped", total, lambda: run(os.preadv, fd), res.passes
            )
        else:
            res.notes.append("the page cache could not be dropped (needs root): no disk-read rows")
            run(os.preadv, fd)  # into the page cache for the next row
        res.read_cache = timed_pass("raw preadv, page cache", total, lambda: run(os.preadv, fd), res.passes)
        if res.group and res.group < request:  # a promotion reads a block in layer groups
            parts = request // res.group
            groups = [view[k * res.group : (k + 1) * res.group] for view in views for k in range(parts)]

            def read_groups() -> None:
                def one(i: int) -> None:
                    os.preadv(fd, [groups[i % len(groups)]], i * res.group)

                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(one, range(total // res.group)))

            res.read_cache_group = timed_pass(
                f"raw preadv, page cache, {format_size(res.group)} requests", total, read_groups, res.passes
            )
            for view in groups:
                view.release()
    finally:
        if wfd >= 0:
            os.close(wfd)
        os.close(fd)
        path.unlink(missing_ok=True)
        for view in views:
            view.release()
        buf.close()

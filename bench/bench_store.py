#!/usr/bin/env python
"""Store / load throughput of the kvstore daemon next to raw LMDB and redis.

    python bench/bench_store.py [--backend lmdb|disk] [--total 2GiB] [--block-bytes 1MiB]
                                [--layers 32] [--blocks-per-put 64] [--sync]
                                [--chunk-bytes 4MiB] [--chunk-sweep 1MiB,4MiB,16MiB]
                                [--skip-raw] [--skip-redis] [--skip-ceiling]

Prints figures only (never pass/fail). GB/s here means 1e9 bytes per second.

Every path gets the same work: per-layer bf16 tensors [n_blocks, 2, H, D] go in
(one tensor per layer, `--blocks-per-put` blocks per request) and per-layer
tensors come out. Paths:

  daemon    kvstore-server as its own process on loopback, KVStoreClient.put/select
  raw-lmdb  lmdb in this process: one write txn per batch (value = a block's
            layers joined, like the daemon's LMDB backend); reads with
            buffers=True, copied into fresh per-layer arrays
  redis     a private redis-server (no persistence), pipelined SET / GET of
            the same per-block values

Passes per path: "cold" store into a fresh store (first-touch memory, file
growth), then everything is deleted (Evict all / txn.drop / FLUSHALL) and the
same amount is stored again ("warm", pages and buffers reused). Loads read back
every block twice; the second ("warm") pass is the headline figure. Lookup
latency (daemon only) is for a stored prefix of --lookup-blocks blocks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvstore_server.config import format_size, parse_size  # noqa: E402

TARGETS = {"store": 0.8, "load": 1.5, "lookup_p50_ms": 1.0}
GB = 1e9


# ---------------------------------------------------------------------------- workload
@dataclass
class Workload:
    layers: int
    block_bytes: int  # all layers of one block
    blocks_per_put: int
    num_blocks: int
    shape: tuple[int, ...]  # per block, per layer (bf16 elements)
    pool: list[dict[str, "torch.Tensor"]] = field(default_factory=list)  # noqa: F821

    @property
    def layer_block_bytes(self) -> int:
        return self.block_bytes // self.layers

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def batches(self, hashes: Sequence[bytes]) -> list[tuple[int, Sequence[bytes], dict]]:
        """(first block, hashes, layers) per request; source tensors cycle through the pool."""
        out = []
        for n, first in enumerate(range(0, len(hashes), self.blocks_per_put)):
            out.append((first, hashes[first : first + self.blocks_per_put], self.pool[n % len(self.pool)]))
        return out


def layer_shape(layer_block_bytes: int) -> tuple[int, ...]:
    """[2, heads, head_dim] of bf16 for one block of one layer, [2, 16, 512] for 32 KiB."""
    elems = layer_block_bytes // 2
    if layer_block_bytes % 2 or elems % 2:
        raise SystemExit(f"per-layer block size {layer_block_bytes} must be a multiple of 4 bytes")
    half = elems // 2
    for head_dim in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        if half % head_dim == 0:
            return (2, half // head_dim, head_dim)
    return (2, half)  # pragma: no cover


def make_workload(args: argparse.Namespace) -> Workload:
    import torch

    layers = args.layers
    if args.block_bytes % layers:
        raise SystemExit("--block-bytes must be a multiple of --layers")
    shape = layer_shape(args.block_bytes // layers)
    num_blocks = max(args.blocks_per_put, args.total // args.block_bytes)
    num_blocks -= num_blocks % args.blocks_per_put
    w = Workload(layers, args.block_bytes, args.blocks_per_put, num_blocks, shape)
    # A few distinct batches of source tensors (values are random bits; content does
    # not matter to any path: nothing compresses).
    pool_batches = max(1, min(num_blocks // args.blocks_per_put, args.pool_bytes // (args.blocks_per_put * args.block_bytes)))
    gen = torch.Generator().manual_seed(0)
    for _ in range(pool_batches):
        w.pool.append(
            {
                f"layer.{l}": torch.randint(
                    -32768, 32767, (args.blocks_per_put, *shape), dtype=torch.int16, generator=gen
                ).view(torch.bfloat16)
                for l in range(layers)
            }
        )
    return w


def new_hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def layer_views(layers: dict) -> list[memoryview]:
    from kvstore_client.tensors import byte_view

    return [byte_view(t) for t in layers.values()]


def join_block(views: list[memoryview], i: int, lb: int) -> bytes:
    """One block's bytes: its slice of every layer, joined (the daemon stores the same)."""
    return b"".join([v[i * lb : (i + 1) * lb] for v in views])


def scatter_blocks(values: Sequence, layers: int, lb: int) -> np.ndarray:
    """Copy per-block values into fresh per-layer arrays: out[l] is layer l's [n*lb] bytes."""
    out = np.empty((layers, len(values), lb), dtype=np.uint8)
    for i, value in enumerate(values):
        out[:, i, :] = np.frombuffer(value, dtype=np.uint8).reshape(layers, lb)
    return out


# ---------------------------------------------------------------------------- results
@dataclass
class PathResult:
    name: str
    store_cold: float | None = None
    store_warm: float | None = None
    load_first: float | None = None
    load_warm: float | None = None
    lookup_p50_ms: float | None = None
    lookup_p99_ms: float | None = None
    notes: list[str] = field(default_factory=list)


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def timed_pass(label: str, nbytes: int, fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    r = rate(nbytes, dt)
    print(f"    {label:<34} {format_size(nbytes):>10} in {dt:6.2f} s  {r:6.2f} GB/s", flush=True)
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- daemon
class DaemonProc:
    """kvstore-server on 127.0.0.1:0 in a temp data dir (same logic as tests/daemon.py)."""

    def __init__(self, root: Path, backend: str, capacity: int, sync: bool) -> None:
        self.data_dir = root / "daemon-data"
        self.log_path = root / "daemon.log"
        cmd = [sys.executable, "-m", "kvstore_server", "--listen", "127.0.0.1:0",
               "--data-dir", str(self.data_dir), "--backend", backend,
               "--capacity", str(capacity), "--log-level", "WARNING"]  # fmt: skip
        if sync:
            cmd.append("--sync")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("kvstore-server ready on "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"daemon did not start: {line!r}\n{self.log_path.read_text()}")
        self.ready_line = line.strip()
        self.address = line.split()[3]
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def daemon_store_pass(client, ns: str, w: Workload, hashes: list[bytes]) -> None:
    parent = b""
    for _first, hs, layers in w.batches(hashes):
        res = client.put(ns, hs, layers, parent_hash=parent)
        if res.blocks_written != len(hs):
            raise RuntimeError(f"put wrote {res.blocks_written}/{len(hs)} blocks: {res}")
        parent = hs[-1]


def daemon_load_pass(client, ns: str, w: Workload, hashes: list[bytes]) -> None:
    for first in range(0, len(hashes), w.blocks_per_put):
        hs = hashes[first : first + w.blocks_per_put]
        got = client.select(ns, hs)
        if len(got) != w.layers or next(iter(got.values())).shape[0] != len(hs):
            raise RuntimeError(f"select at block {first} returned a short prefix")


def bench_daemon(args: argparse.Namespace, w: Workload, root: Path) -> tuple[PathResult, DaemonProc]:
    from kvstore_client.client import KVStoreClient

    res = PathResult(f"daemon ({args.backend})")
    capacity = max(2 * w.total_bytes + (256 << 20), 1 << 30)
    daemon = DaemonProc(root, args.backend, capacity, args.sync)
    print(f"  {daemon.ready_line}", flush=True)
    if args.profile_dir:
        start_py_spy(args, daemon.pid, "store-cold")
    nbytes = w.total_bytes
    with KVStoreClient(daemon.address, timeout=120.0, chunk_bytes=args.chunk_bytes) as client:
        cold = new_hashes(w.num_blocks)
        res.store_cold = timed_pass("store, cold (fresh daemon)", nbytes, lambda: daemon_store_pass(client, "cold", w, cold))
        stop_py_spy()
        t0 = time.perf_counter()
        ev = client.evict(all=True)
        print(f"    evict all: {ev.blocks_evicted} blocks in {time.perf_counter() - t0:.2f} s", flush=True)
        hashes = new_hashes(w.num_blocks)
        if args.profile_dir:
            start_py_spy(args, daemon.pid, "store-warm")
        res.store_warm = timed_pass("store, warm (after evict)", nbytes, lambda: daemon_store_pass(client, "bench", w, hashes))
        stop_py_spy()
        res.load_first = timed_pass("load, first pass", nbytes, lambda: daemon_load_pass(client, "bench", w, hashes))
        if args.profile_dir:
            start_py_spy(args, daemon.pid, "load-warm")
        res.load_warm = timed_pass("load, warm", nbytes, lambda: daemon_load_pass(client, "bench", w, hashes))
        stop_py_spy()

        prefix = hashes[: args.lookup_blocks]
        if client.lookup("bench", prefix) != len(prefix):
            raise RuntimeError("lookup did not find the stored prefix")
        for _ in range(100):
            client.lookup("bench", prefix)
        lat = np.empty(args.lookups)
        for i in range(args.lookups):
            t0 = time.perf_counter()
            client.lookup("bench", prefix)
            lat[i] = time.perf_counter() - t0
        res.lookup_p50_ms = float(np.percentile(lat, 50) * 1e3)
        res.lookup_p99_ms = float(np.percentile(lat, 99) * 1e3)
        print(
            f"    lookup of {len(prefix)} blocks x{args.lookups}: p50 {res.lookup_p50_ms:.3f} ms  "
            f"p99 {res.lookup_p99_ms:.3f} ms",
            flush=True,
        )

        if args.chunk_sweep:
            print("    chunk-size sweep (warm store into a fresh namespace, then warm load):", flush=True)
            for chunk in args.chunk_sweep:
                client.evict(all=True)
                with KVStoreClient(daemon.address, timeout=120.0, chunk_bytes=chunk) as c2:
                    hs = new_hashes(w.num_blocks)
                    s = timed_pass(f"  chunk {format_size(chunk)} store", nbytes, lambda: daemon_store_pass(c2, "sweep", w, hs))
                    daemon_load_pass(c2, "sweep", w, hs[: 4 * w.blocks_per_put])  # map the pages once
                    ld = timed_pass(f"  chunk {format_size(chunk)} load", nbytes, lambda: daemon_load_pass(c2, "sweep", w, hs))
                    res.notes.append(f"chunk {format_size(chunk)}: store {s:.2f} / load {ld:.2f} GB/s")
    return res, daemon


# ---------------------------------------------------------------------------- py-spy (optional)
_spy: list[subprocess.Popen] = []


def start_py_spy(args: argparse.Namespace, pid: int, label: str) -> None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("    (py-spy not found; --profile-dir ignored)")
        return
    out = Path(args.profile_dir) / f"daemon-{args.backend}-{label}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    # raw "collapsed" stacks with native frames and idle threads excluded
    _spy.append(
        subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--threads", "-o", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    time.sleep(0.5)  # let it attach


def stop_py_spy() -> None:
    while _spy:
        p = _spy.pop()
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------- raw LMDB
def bench_raw_lmdb(args: argparse.Namespace, w: Workload, root: Path) -> PathResult:
    import lmdb

    res = PathResult("raw LMDB (in-process)")
    path = root / "raw-lmdb"
    path.mkdir()
    env = lmdb.open(str(path), map_size=4 * w.total_bytes + (1 << 30), max_dbs=1,
                    sync=args.sync, metasync=args.sync, readahead=False)  # fmt: skip
    db = env.open_db(b"data")
    lb = w.layer_block_bytes
    nbytes = w.total_bytes

    def store(hashes: list[bytes]) -> None:
        for _first, hs, layers in w.batches(hashes):
            views = layer_views(layers)
            with env.begin(write=True, db=db) as txn:
                for i, h in enumerate(hs):
                    txn.put(h, join_block(views, i, lb))

    def load(hashes: list[bytes]) -> None:
        for first in range(0, len(hashes), w.blocks_per_put):
            hs = hashes[first : first + w.blocks_per_put]
            with env.begin(db=db, buffers=True) as txn:
                values = [txn.get(h) for h in hs]
                if any(v is None for v in values):
                    raise RuntimeError("raw lmdb: missing block")
                scatter_blocks(values, w.layers, lb)

    cold = new_hashes(w.num_blocks)
    res.store_cold = timed_pass("store, cold (fresh env)", nbytes, lambda: store(cold))
    with env.begin(write=True) as txn:
        txn.drop(db, delete=False)
    hashes = new_hashes(w.num_blocks)
    res.store_warm = timed_pass("store, warm (after drop)", nbytes, lambda: store(hashes))
    res.load_first = timed_pass("load, first pass", nbytes, lambda: load(hashes))
    res.load_warm = timed_pass("load, warm", nbytes, lambda: load(hashes))
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
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(rdir), "--protected-mode", "no", "--proto-max-bulk-len", "512mb"],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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

            res.notes.append("redis-py with hiredis parser")
        except ImportError:
            res.notes.append("redis-py pure-Python parser (hiredis not installed)")
        if args.sync:
            res.notes.append("redis runs without persistence even with --sync")
        lb = w.layer_block_bytes
        nbytes = w.total_bytes

        def store(hashes: list[bytes]) -> None:
            for _first, hs, layers in w.batches(hashes):
                views = layer_views(layers)
                pipe = r.pipeline(transaction=False)
                for i, h in enumerate(hs):
                    pipe.set(h, join_block(views, i, lb))
                pipe.execute()

        def load(hashes: list[bytes]) -> None:
            for first in range(0, len(hashes), w.blocks_per_put):
                hs = hashes[first : first + w.blocks_per_put]
                pipe = r.pipeline(transaction=False)
                for h in hs:
                    pipe.get(h)
                values = pipe.execute()
                if any(v is None for v in values):
                    raise RuntimeError("redis: missing block")
                scatter_blocks(values, w.layers, lb)

        cold = new_hashes(w.num_blocks)
        res.store_cold = timed_pass("store, cold (fresh server)", nbytes, lambda: store(cold))
        r.flushall()
        hashes = new_hashes(w.num_blocks)
        res.store_warm = timed_pass("store, warm (after FLUSHALL)", nbytes, lambda: store(hashes))
        res.load_first = timed_pass("load, first pass", nbytes, lambda: load(hashes))
        res.load_warm = timed_pass("load, warm", nbytes, lambda: load(hashes))
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
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
        options=[("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES)],  # fmt: skip
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_CEIL_SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"ready {port}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0)
    return 0


def bench_ceiling(args: argparse.Namespace, w: Workload) -> tuple[float, float]:
    import grpc

    from kvstore import wire

    proc = subprocess.Popen(
        [sys.executable, __file__, "--_ceiling-server"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES)],  # fmt: skip
        )
        sink = channel.stream_unary(f"/{_CEIL_SERVICE}/Sink")
        source = channel.unary_stream(f"/{_CEIL_SERVICE}/Source")
        chunk = args.chunk_bytes
        per_call = max(1, (w.blocks_per_put * w.block_bytes) // chunk)
        calls = max(1, min(w.total_bytes, 1 << 30) // (per_call * chunk))
        payload = os.urandom(1024) * (chunk // 1024)
        nbytes = calls * per_call * len(payload)

        def up() -> None:
            for _ in range(calls):
                got = int.from_bytes(sink(iter([payload] * per_call), timeout=60), "little")
                assert got == per_call * len(payload)

        def down() -> None:
            req = per_call.to_bytes(8, "little") + len(payload).to_bytes(8, "little")
            for _ in range(calls):
                n = 0
                for msg in source(req, timeout=60):
                    n += len(msg)
                assert n == per_call * len(payload)

        up()  # warm-up
        up_rate = timed_pass(f"grpc upload, {format_size(len(payload))} msgs", nbytes, up)
        down()
        down_rate = timed_pass(f"grpc download, {format_size(len(payload))} msgs", nbytes, down)
        channel.close()
        return up_rate, down_rate
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------------- report
def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(args: argparse.Namespace, w: Workload, results: list[PathResult], ceiling: tuple[float, float] | None) -> None:
    print()
    print(
        f"== results: backend={args.backend} sync={args.sync} total={format_size(w.total_bytes)} "
        f"block={format_size(w.block_bytes)} ({w.layers} layers x {format_size(w.layer_block_bytes)}, bf16 "
        f"{list(w.shape)}) put={w.blocks_per_put} blocks ({format_size(w.blocks_per_put * w.block_bytes)}) "
        f"chunk={format_size(args.chunk_bytes)} cpus={os.cpu_count()}"
    )
    head = f"{'path':<24} {'store cold':>10} {'store GB/s':>10} {'load 1st':>9} {'load GB/s':>10} {'lookup p50':>11} {'p99 ms':>8}"
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.name:<24} {fmt(r.store_cold):>10} {fmt(r.store_warm):>10} {fmt(r.load_first):>9} "
            f"{fmt(r.load_warm):>10} {fmt(r.lookup_p50_ms, '.3f'):>11} {fmt(r.lookup_p99_ms, '.3f'):>8}"
        )
    print(
        f"{'target (daemon)':<24} {'':>10} {'>= ' + str(TARGETS['store']):>10} {'':>9} "
        f"{'>= ' + str(TARGETS['load']):>10} {'<= ' + str(TARGETS['lookup_p50_ms']):>11}"
    )
    if ceiling:
        print(f"{'raw gRPC stream':<24} {'':>10} {ceiling[0]:>10.2f} {'':>9} {ceiling[1]:>10.2f}   (bytes only, no copies into tensors)")
    d = results[0]
    for other in results[1:]:
        print(
            f"daemon / {other.name:<24} store {ratio(d.store_warm, other.store_warm):>7}  "
            f"load {ratio(d.load_warm, other.load_warm):>7}  (cold store {ratio(d.store_cold, other.store_cold)})"
        )
    if ceiling:
        print(
            f"daemon / raw gRPC stream        store {ratio(d.store_warm, ceiling[0]):>7}  "
            f"load {ratio(d.load_warm, ceiling[1]):>7}"
        )
    for r in results:
        for note in r.notes:
            print(f"note [{r.name}]: {note}")
    print("store/load columns are warm passes; 'store cold' = first pass into a fresh store; 'load 1st' = first read pass")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("lmdb", "disk"), default="lmdb")
    p.add_argument("--total", type=parse_size, default="2GiB", help="bytes stored per pass (default 2GiB)")
    p.add_argument("--block-bytes", type=parse_size, default="1MiB", help="bytes per block, all layers (1MiB)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks-per-put", type=int, default=64, help="blocks per put/select request (64)")
    p.add_argument("--sync", action="store_true", help="daemon --sync; raw LMDB sync=True")
    p.add_argument("--chunk-bytes", type=parse_size, default=None, help="KVStoreClient(chunk_bytes=...) (4MiB)")
    p.add_argument("--chunk-sweep", default="", help="comma list of chunk sizes to try, e.g. 1MiB,4MiB,16MiB")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--lookup-blocks", type=int, default=256)
    p.add_argument("--pool-bytes", type=parse_size, default="256MiB", help="distinct source data (256MiB)")
    p.add_argument("--skip-raw", action="store_true")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument("--profile-dir", default="", help="record py-spy raw stacks of the daemon per phase here")
    p.add_argument("--_ceiling-server", dest="ceiling_server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunk_bytes is None:
        from kvstore import wire

        args.chunk_bytes = wire.DEFAULT_CHUNK_BYTES
    args.chunk_sweep = [parse_size(s) for s in args.chunk_sweep.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ceiling_server:
        return ceiling_server()
    t_start = time.perf_counter()
    print(f"building source tensors (pool {format_size(args.pool_bytes)}) ...", flush=True)
    w = make_workload(args)
    print(
        f"workload: {w.num_blocks} blocks x {format_size(w.block_bytes)} = {format_size(w.total_bytes)} per pass, "
        f"{w.num_blocks // w.blocks_per_put} requests of {w.blocks_per_put} blocks",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    results: list[PathResult] = []
    ceiling = None
    daemon = None
    try:
        print(f"[daemon, backend={args.backend}]", flush=True)
        res, daemon = bench_daemon(args, w, root)
        results.append(res)
        daemon.stop()
        daemon = None
        shutil.rmtree(root / "daemon-data", ignore_errors=True)
        if not args.skip_raw:
            print("[raw LMDB, in-process]", flush=True)
            results.append(bench_raw_lmdb(args, w, root))
        if not args.skip_redis:
            print("[redis]", flush=True)
            results.append(bench_redis(args, w, root))
        if not args.skip_ceiling:
            print("[raw gRPC stream ceiling]", flush=True)
            ceiling = bench_ceiling(args, w)
    finally:
        stop_py_spy()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    report(args, w, results, ceiling)
    print(f"(bench wall time {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

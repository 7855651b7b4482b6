#!/usr/bin/env python
"""Store / load throughput of the kvstore daemon next to raw LMDB and redis.

    python bench/bench_store.py [--backend lmdb|disk] [--total 2GiB] [--block-bytes 1MiB]
                                [--layers 32] [--blocks-per-put 64] [--sync]
                                [--chunk-bytes 4MiB] [--chunk-sweep 1MiB,4MiB,16MiB]
                                [--repeat 2] [--inflight 2] [--untuned-client]
                                [--skip-raw] [--skip-redis] [--skip-ceiling] [--profile-dir DIR]
                                [--skip-persistent] [--persistent-total 1GiB]

Prints figures only (never pass/fail). GB/s here means 1e9 bytes per second.

Every path gets the same work: per-layer bf16 tensors [n_blocks, 2, H, D] go in
(one tensor per layer, `--blocks-per-put` blocks per request) and per-layer
tensors come out. Paths:

  daemon    kvstore-server as its own process on loopback, KVStoreClient.put/select
            over gRPC; "same-host reads": select reading the daemon's files; "arena":
            put/select through the daemon's memory tier (reserve, copy into the mapped
            arena, commit; pin, verify, copy out), and its "load 1st" is a load of
            blocks only the persistent tier holds (promoted by the pin)
  memcpy    a plain copy of the same tensors into buffers allocated once: the
            yardstick of the arena rows
  raw-lmdb  lmdb in this process: one write txn per batch (value = a block's
            layers joined, like the daemon's LMDB backend); reads with
            buffers=True, copied into fresh per-layer arrays
  redis     a private redis-server (no persistence), pipelined SET / GET of
            the same per-block values

Last, the persistent tier against the data dir's filesystem ("persistent" part): raw
parallel pwritev (O_DIRECT where the filesystem takes it) + fdatasync, preadv after
`echo 3 > /proc/sys/vm/drop_caches` (root) and preadv from the page cache, in the tier's
own shape (tiers.segments: one request per block from DEFAULT_THREADS threads); next to
them the daemon's write-behind (from the first put through the arena until
write_behind_blocks is 0) and cold loads (kill -9, arena file deleted, restart, then
pins of blocks only the persistent tier holds), each as % of its ceiling.

Passes per path: "cold" store into a fresh store (first-touch memory, file
growth), then everything is deleted (Evict all / txn.drop / FLUSHALL) and the
same amount is stored again ("warm", pages and buffers reused). Loads read back
every block again; the warm passes are the headline figures (best of --repeat:
noise on a shared VM only ever slows a pass down). Lookup latency (daemon only)
is for a stored prefix of --lookup-blocks blocks. "daemon insert xN" stores the
same data with KVStoreClient.insert and N puts in flight (transfer of one put
overlaps the commit of the previous one).

Each pass line also shows CPU seconds used by the daemon / this process, and
how many cores *other* processes on the machine kept busy meanwhile ("others"):
figures taken while others > ~0.3 cores are disturbed, rerun when quiet.

Both processes keep large buffers in glibc's heap (kvstore.memory.tune_malloc):
the daemon always does, the vLLM connector does by default, and so does this
bench's client unless --untuned-client: on this VM fresh pages cost more than
the copies themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import numpy as np
from kvstore_connector.host_memory import prepare_arena
from support.daemon import Daemon  # the same start-up as the tests use
from support.ports import free_port

from kvstore.sizes import format_size, parse_size

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
    pool: list[dict[str, Any]] = field(default_factory=list)  # per batch: {layer name: tensor}

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
    pool_batches = max(
        1, min(num_blocks // args.blocks_per_put, args.pool_bytes // (args.blocks_per_put * args.block_bytes))
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(pool_batches):
        w.pool.append(
            {
                f"layer.{i}": torch.randint(
                    -32768, 32767, (args.blocks_per_put, *shape), dtype=torch.int16, generator=gen
                ).view(torch.bfloat16)
                for i in range(layers)
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
    passes: list[Pass] = field(default_factory=list)

    @property
    def others(self) -> float | None:
        return max((p.others for p in self.passes), default=None)


def rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


_TICK = os.sysconf("SC_CLK_TCK")
OUR_PIDS: dict[str, int] = {"client": os.getpid()}  # name -> pid whose CPU we account as ours


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[11]) / _TICK, int(fields[12]) / _TICK
    except OSError:
        return 0.0, 0.0


def _machine_busy() -> tuple[float, float]:
    """(busy seconds over all CPUs excluding steal, steal seconds) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK


@dataclass
class Pass:
    gbps: float
    seconds: float
    cpu: dict[str, float]  # process -> CPU seconds (user + system)
    sys: dict[str, float]  # process -> system CPU seconds
    others: float  # cores kept busy by other processes
    steal: float


QUIET = {"wait": 0.0, "cores": 0.25}  # --quiet-wait: seconds to wait for a quiet machine before a pass


def wait_quiet() -> None:
    """Wait up to QUIET['wait'] s until other processes use < QUIET['cores'] cores (0.5 s windows).
    Our own processes are idle between passes, so whatever is busy now is someone else."""
    deadline = time.monotonic() + QUIET["wait"]
    while time.monotonic() < deadline:
        b0, _ = _machine_busy()
        time.sleep(0.5)
        b1, _ = _machine_busy()
        if (b1 - b0) / 0.5 < QUIET["cores"]:
            return


def timed_pass(label: str, nbytes: int, fn: Callable[[], None], sink: list[Pass] | None = None) -> float:
    if QUIET["wait"] > 0:
        wait_quiet()
    pids = dict(OUR_PIDS)
    c0 = {k: _proc_cpu(p) for k, p in pids.items()}
    b0, s0 = _machine_busy()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    b1, s1 = _machine_busy()
    c1 = {k: _proc_cpu(p) for k, p in pids.items()}
    cpu = {k: sum(c1[k]) - sum(c0[k]) for k in pids}
    sys_cpu = {k: c1[k][1] - c0[k][1] for k in pids}
    others = max(0.0, (b1 - b0) - sum(cpu.values())) / dt
    steal = (s1 - s0) / dt
    r = rate(nbytes, dt)
    if sink is not None:
        sink.append(Pass(r, dt, cpu, sys_cpu, others, steal))
    cpus = " ".join(f"{k} {v:.2f}s ({100 * sys_cpu[k] / v if v else 0:.0f}% sys)" for k, v in cpu.items())
    extra = f" steal {steal:.2f}" if steal >= 0.05 else ""
    print(
        f"    {label:<34} {format_size(nbytes):>10} in {dt:6.2f} s  {r:6.2f} GB/s   "
        f"cpu: {cpus}; others {others:.2f} cores{extra}",
        flush=True,
    )
    return r


def best_of(
    label: str,
    nbytes: int,
    fn: Callable[[], None],
    repeat: int,
    sink: list[Pass],
    before: Callable[[], None] | None = None,
    around: Callable[[int], Any] | None = None,
) -> float:
    """Run a pass `repeat` times (calling `before` first each time, untimed) and return the best GB/s.
    `around(i)`, if given, is a context manager entered around pass i only (e.g. a profiler)."""
    best = 0.0
    for i in range(repeat):
        if before is not None:
            before()
        with around(i) if around is not None else contextlib.nullcontext():
            best = max(best, timed_pass(f"{label} #{i + 1}" if repeat > 1 else label, nbytes, fn, sink))
    return best


# ---------------------------------------------------------------------------- daemon
def daemon_store_pass(client, ns: str, w: Workload, hashes: list[bytes], inflight: int = 1) -> None:
    parent = b""
    pending = []
    for _first, hs, layers in w.batches(hashes):
        if inflight > 1:
            pending.append((len(hs), client.insert(ns, hs, layers, parent_hash=parent)))
        else:
            res = client.put(ns, hs, layers, parent_hash=parent)
            if res.blocks_written != len(hs):
                raise RuntimeError(f"put wrote {res.blocks_written}/{len(hs)} blocks: {res}")
        parent = hs[-1]
    for n, fut in pending:
        res = fut.result()
        if res.blocks_written != n:
            raise RuntimeError(f"insert wrote {res.blocks_written}/{n} blocks: {res}")


def daemon_load_pass(client, ns: str, w: Workload, hashes: list[bytes]) -> None:
    for first in range(0, len(hashes), w.blocks_per_put):
        hs = hashes[first : first + w.blocks_per_put]
        got = client.select(ns, hs)
        if len(got) != w.layers or next(iter(got.values())).shape[0] != len(hs):
            raise RuntimeError(f"select at block {first} returned a short prefix")


def lookup_latency(client, prefix: list[bytes], n: int) -> tuple[float, float]:
    """p50 and p99 of client.lookup(prefix) in ms, after a warm-up."""
    if client.lookup("bench", prefix) != len(prefix):
        raise RuntimeError("lookup did not find the stored prefix")
    for _ in range(100):
        client.lookup("bench", prefix)
    lat = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter()
        client.lookup("bench", prefix)
        lat[i] = time.perf_counter() - t0
    p50, p99 = float(np.percentile(lat, 50) * 1e3), float(np.percentile(lat, 99) * 1e3)
    print(f"    lookup of {len(prefix)} blocks x{n}: p50 {p50:.3f} ms  p99 {p99:.3f} ms", flush=True)
    return p50, p99


def bench_daemon(args: argparse.Namespace, w: Workload, root: Path) -> list[PathResult]:
    from kvstore_client import KVStoreClient

    res = PathResult(f"daemon ({args.backend})")
    out = [res]
    capacity = max(2 * w.total_bytes + (256 << 20), 1 << 30)
    extra = ["--log-level", "WARNING", *(["--sync"] if args.sync else [])]
    # the arena in shared memory, as deployed, in a directory of this run's own (removed at
    # the end: a stop keeps an arena that holds memory-only blocks, a crash any arena)
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.memory_dir))
    daemon = Daemon(
        root / "daemon-data",
        backend=args.backend,
        capacity=str(capacity),
        # its size fits a pass
        memory_size=str(w.total_bytes + (256 << 20) if args.memory is None else args.memory),
        memory_dir=memory_dir,
        extra_args=extra,
        env=args.daemon_env,
    )
    try:
        daemon.start()
    except BaseException:
        shutil.rmtree(memory_dir, ignore_errors=True)
        raise
    OUR_PIDS["daemon"] = daemon.proc.pid
    print(f"  {daemon.ready_line}", flush=True)
    nbytes = w.total_bytes
    state = {"hashes": new_hashes(w.num_blocks)}
    try:
        with KVStoreClient(
            daemon.address,
            timeout=120.0,
            chunk_bytes=args.chunk_bytes,
            insert_workers=max(2, args.inflight),
            arena=False,  # this row is the gRPC byte stream; the arena has its own below
        ) as client:

            def fresh() -> None:
                t0 = time.perf_counter()
                ev = client.evict(all=True)
                state["hashes"] = new_hashes(w.num_blocks)
                print(
                    f"    (evict all: {ev.blocks_evicted} blocks in {time.perf_counter() - t0:.2f} s)",
                    flush=True,
                )

            def store(inflight: int = 1) -> Callable[[], None]:
                return lambda: daemon_store_pass(client, "bench", w, state["hashes"], inflight)

            def load() -> None:
                daemon_load_pass(client, "bench", w, state["hashes"])

            with py_spy(args, daemon.proc.pid, "store-cold"):
                res.store_cold = timed_pass("store, cold (fresh daemon)", nbytes, store(), res.passes)
            res.store_warm = best_of(
                "store, warm (after evict)",
                nbytes,
                store(),
                args.repeat,
                res.passes,
                fresh,
                around=lambda i: py_spy(args, daemon.proc.pid, f"store-warm-{i + 1}"),
            )
            res.load_first = timed_pass("load, first pass", nbytes, load, res.passes)
            res.load_warm = best_of(
                "load, warm",
                nbytes,
                load,
                args.repeat,
                res.passes,
                around=lambda i: py_spy(args, daemon.proc.pid, f"load-warm-{i + 1}"),
            )

            prefix = state["hashes"][: args.lookup_blocks]
            res.lookup_p50_ms, res.lookup_p99_ms = lookup_latency(client, prefix, args.lookups)

            # the same-host fast path: the client reads the daemon's files itself
            local = PathResult(f"daemon ({args.backend}), same-host reads")
            with KVStoreClient(daemon.address, timeout=120.0, local_reads=True, arena=False) as lc:

                def local_load() -> None:
                    daemon_load_pass(lc, "bench", w, state["hashes"])

                local.load_first = timed_pass(
                    "load, same-host reads, first pass", nbytes, local_load, local.passes
                )
                local.load_warm = best_of(
                    "load, same-host reads", nbytes, local_load, args.repeat, local.passes
                )
                if lc.local_data_dir is None:
                    raise RuntimeError("the client did not take the same-host path")
                local.lookup_p50_ms, local.lookup_p99_ms = lookup_latency(lc, prefix, args.lookups)
            out.append(local)

            # the memory tier: saves reserve, copy into the mapped arena and commit; loads pin,
            # verify and copy out (the bytes never cross gRPC)
            arena = PathResult(f"daemon ({args.backend}), arena")
            with KVStoreClient(daemon.address, timeout=120.0, arena=args.memory != "0") as ac:
                if args.memory == "0":
                    print("    (--memory 0: no arena rows)", flush=True)
                elif not prepare_arena(ac, cuda=False):  # mapped and pre-faulted, as a worker does
                    raise RuntimeError("the client could not map the daemon's arena")

                def arena_store() -> None:
                    daemon_store_pass(ac, "bench", w, state["hashes"])

                def arena_load() -> None:
                    daemon_load_pass(ac, "bench", w, state["hashes"])

                def drained() -> None:  # evict, and let the write-behind of the last pass finish
                    wait_written_behind(client)
                    fresh()

                if args.memory != "0":
                    drained()
                    arena.store_cold = timed_pass(
                        "store through the arena, first", nbytes, arena_store, arena.passes
                    )
                    arena.store_warm = best_of(
                        "store through the arena", nbytes, arena_store, args.repeat, arena.passes, drained
                    )
                    arena.load_first = timed_pass(
                        "load through the arena, first", nbytes, arena_load, arena.passes
                    )
                    arena.load_warm = best_of(
                        "load through the arena", nbytes, arena_load, args.repeat, arena.passes
                    )
                    wait_written_behind(client)
                    client.evict(all=True)
                    daemon_store_pass(client, "bench", w, state["hashes"])  # over gRPC: persistent tier only
                    arena.notes.append(
                        "load 1st here: blocks only in the persistent tier, promoted into the arena by the pin"
                    )
                    arena.load_first = timed_pass(
                        "load through the arena, promoting from the persistent tier",
                        nbytes,
                        arena_load,
                        arena.passes,
                    )
            if args.memory != "0":
                out.append(arena)
            out.append(bench_memcpy(args, w))

            if args.inflight > 1:
                ins = PathResult(f"daemon insert x{args.inflight}")
                ins.store_warm = best_of(
                    f"store via insert(), {args.inflight} in flight",
                    nbytes,
                    store(args.inflight),
                    args.repeat,
                    ins.passes,
                    fresh,
                )
                out.append(ins)

            for chunk in args.chunk_sweep:
                sw = PathResult(f"  chunk_bytes={format_size(chunk)}")
                with KVStoreClient(daemon.address, timeout=120.0, chunk_bytes=chunk) as c2:

                    def sweep_store(c2=c2) -> None:
                        daemon_store_pass(c2, "bench", w, state["hashes"])

                    def sweep_load(c2=c2) -> None:
                        daemon_load_pass(c2, "bench", w, state["hashes"])

                    sw.store_warm = best_of(
                        f"chunk {format_size(chunk)}: store",
                        nbytes,
                        sweep_store,
                        args.repeat,
                        sw.passes,
                        fresh,
                    )
                    sw.load_warm = best_of(
                        f"chunk {format_size(chunk)}: load", nbytes, sweep_load, args.repeat, sw.passes
                    )
                out.append(sw)
    finally:
        daemon.stop()
        OUR_PIDS.pop("daemon", None)
        shutil.rmtree(memory_dir, ignore_errors=True)
    return out


def wait_written_behind(client, deadline_s: float = 600.0) -> None:
    """Until the daemon's write-behind backlog is empty (the previous pass's blocks are in
    the persistent tier), so one pass's background writes do not run into the next."""
    end = time.monotonic() + deadline_s
    while client.stats()["write_behind_blocks"] and time.monotonic() < end:
        time.sleep(0.2)


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


# ---------------------------------------------------------------------------- py-spy (optional)
class py_spy:
    """With --profile-dir: record the daemon's Python stacks (py-spy raw format) during a phase."""

    def __init__(self, args: argparse.Namespace, pid: int, label: str) -> None:
        self.proc: subprocess.Popen | None = None
        if not args.profile_dir:
            return
        exe = shutil.which("py-spy")
        if exe is None:
            print("    (py-spy not found: pip install py-spy; --profile-dir ignored)")
            return
        out = Path(args.profile_dir) / f"daemon-{args.backend}-{label}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.cmd = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--nonblocking",
            "--format",
            "raw",
            "--threads",
            "-o",
            str(out),
        ]

    def __enter__(self) -> py_spy:
        if getattr(self, "cmd", None):
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # let it attach
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_IDLE_LEAVES = (
    "Condition.wait (threading.py",
    "Event.wait (threading.py",
    "_worker (concurrent/futures/thread.py",
    "_serve (grpc/_server.py",  # the completion-queue poll loop: waiting in C, or gRPC core work
)


def summarize_py_spy(profile_dir: str, top: int = 12) -> None:
    """Print each recorded phase's hottest non-waiting leaf frames and kvstore functions (inclusive)."""
    import collections
    import re

    for path in sorted(Path(profile_dir).glob("daemon-*.txt")):
        rows = []
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                rows.append((stack.split(";")[1:], int(count)))
        busy = [(f, n) for f, n in rows if f and not f[-1].startswith(_IDLE_LEAVES)]
        total = sum(n for _, n in busy)
        if not total:
            continue
        print(f"\n-- py-spy {path.name}: {total} busy samples (of {sum(n for _, n in rows)}); leaf frames:")
        leaves = collections.Counter()
        inclusive = collections.Counter()
        for frames, n in busy:
            leaves[frames[-1]] += n
            for name in {re.sub(r":\d+\)$", ")", f) for f in frames}:
                if "kvstore" in name:
                    inclusive[name] += n
        for name, n in leaves.most_common(top):
            print(f"   {100 * n / total:5.1f}%  {name}")
        print("   inclusive, kvstore code:")
        for name, n in inclusive.most_common(top):
            print(f"   {100 * n / total:5.1f}%  {name}")


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
    proc = subprocess.Popen(
        [sys.executable, __file__, "--_ceiling-server"],
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


# ---------------------------------------------------------------------------- persistent tier vs raw I/O
@dataclass
class IoResult:
    """The data dir's filesystem (raw parallel I/O in the persistent tier's shape) and the
    daemon's persistent tier on it, in GB/s; None: not measured."""

    fs: str = ""
    nbytes: int = 0
    request: int = 0
    threads: int = 0
    direct: bool = False
    write: float | None = None  # pwritev (O_DIRECT where allowed) + fdatasync
    write_nosync: float | None = None  # the same pwritev calls alone, before the fdatasync
    read_disk: float | None = None  # preadv after drop_caches
    read_cache: float | None = None  # preadv from the page cache
    group: int = 0  # the bytes of one promotion read (tiers.chain.layer_groups)
    read_cache_group: float | None = None  # preadv from the page cache, `group`-byte requests
    write_behind: float | None = None  # first put through the arena .. write_behind_blocks == 0
    write_behind_stat: float | None = None  # the daemon's write_behind_rate
    put_only: float | None = None  # the puts alone, into the arena
    load_first: float | None = None  # pins after a restart, the segments written direct
    load_warm: float | None = None  # pins after a restart, the segments in the page cache
    load_dropped: float | None = None  # pins after a restart and drop_caches
    read_stat: dict[str, float] = field(default_factory=dict)  # persistent_read_rate per load pass
    notes: list[str] = field(default_factory=list)
    passes: list[Pass] = field(default_factory=list)


def drop_page_cache() -> bool:
    """sync, then `echo 3 > /proc/sys/vm/drop_caches` (root); False where refused."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError as exc:
        print(f"    (cannot drop the page cache: {exc})", flush=True)
        return False


def fs_of(path: Path) -> str:
    """'ext4 at /': the filesystem type and mount point that hold `path`."""
    best = ("?", "")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if (
                len(fields) > 2
                and str(path.resolve()).startswith(fields[1])
                and len(fields[1]) >= len(best[1])
            ):
                best = (fields[2], fields[1])
    return f"{best[0]} at {best[1]}"


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


def map_arena(client) -> None:
    """Map the daemon's arena in this process and wait for the background pre-fault of the
    mapping to end (a worker maps it once, at start; on 2 cores it would compete with the
    daemon during the timed pass)."""
    import threading

    if not prepare_arena(client, cuda=False):
        raise RuntimeError("the client could not map the daemon's arena")
    for thread in threading.enumerate():
        if thread.name == "kvstore-arena-prefault":
            thread.join()


def pin_pass(client, ns: str, w: Workload, hashes: list[bytes]) -> None:
    """Pin every block through the arena, one request of --blocks-per-put blocks at a time,
    and end each pin (what a load does before and after its copies)."""
    for first in range(0, len(hashes), w.blocks_per_put):
        hs = hashes[first : first + w.blocks_per_put]
        pinned = client.pin(ns, hs)
        if pinned is None:
            raise RuntimeError("the client does not use the daemon's arena")
        if pinned.num_blocks != len(hs):
            raise RuntimeError(f"pin at block {first}: {pinned.num_blocks}/{len(hs)} ({pinned.stop_reason})")
        pinned.finish()


def bench_persistent(args: argparse.Namespace, w: Workload, root: Path) -> IoResult:
    """Raw I/O ceilings on the data dir's filesystem, then the daemon's persistent tier on it:
    the write-behind of blocks put through the arena, and cold loads (pins of blocks only the
    persistent tier holds, after kill -9, the arena file deleted and a restart) with the
    segments in the page cache and with it dropped."""
    from kvstore_client import KVStoreClient
    from kvstore_server.tiers.chain import layer_groups
    from kvstore_server.tiers.iopool import DEFAULT_THREADS

    per_put = w.blocks_per_put * w.block_bytes
    total = max(per_put, args.persistent_total - args.persistent_total % per_put)
    data_root = root / "persistent"
    res = IoResult(fs_of(root), total, w.block_bytes, DEFAULT_THREADS)
    groups = layer_groups([w.layer_block_bytes] * w.layers)
    res.group = w.block_bytes // len(groups) if w.block_bytes % len(groups) == 0 else 0
    print(
        f"  raw I/O on {res.fs} ({data_root}): {format_size(w.block_bytes)} requests, {res.threads} threads",
        flush=True,
    )
    raw_io_ceilings(data_root / "raw", res)

    memory = total + (256 << 20)  # the whole pass fits: nothing is evicted or dropped
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.memory_dir))
    daemon = Daemon(
        data_root / "daemon-data",
        backend=args.backend,
        capacity=str(max(2 * total + (256 << 20), 1 << 30)),
        memory_size=str(memory),
        memory_dir=memory_dir,
        extra_args=[
            "--log-level",
            "WARNING",
            "--write-behind-bytes",
            str(memory),
            *(["--sync"] if args.sync else []),
        ],
        env=args.daemon_env,
    )
    hashes = new_hashes(total // w.block_bytes)
    try:
        daemon.start()
        OUR_PIDS["daemon"] = daemon.proc.pid
        print(f"  {daemon.ready_line}", flush=True)
        with KVStoreClient(daemon.address, timeout=120.0) as client:
            map_arena(client)
            marks: dict[str, float] = {}

            def put_and_write_behind() -> None:
                marks["start"] = time.perf_counter()
                daemon_store_pass(client, "bench", w, hashes)
                marks["put"] = time.perf_counter()
                while client.stats()["write_behind_blocks"]:
                    time.sleep(0.01)

            with py_spy(args, daemon.proc.pid, "write-behind"):
                res.write_behind = timed_pass(
                    "daemon: put via the arena .. written behind", total, put_and_write_behind, res.passes
                )
            res.put_only = rate(total, marks["put"] - marks["start"])
            stats = client.stats()
            res.write_behind_stat = stats["write_behind_rate"] / GB
            puts = len(hashes) // w.blocks_per_put
            if stats["commits"] != puts or stats["written_behind_bytes"] != total:
                res.notes.append(
                    f"write-behind: {stats['commits']} arena commits for {puts} puts, "
                    f"{stats['written_behind_bytes']} of {total} bytes written behind, "
                    f"{stats['write_behind_dropped']} blocks dropped"
                )
        passes = [
            ("load_first", "daemon: cold pins, first read after the writes", False),
            ("load_warm", "daemon: cold pins, page cache warm", False),
            ("load_dropped", "daemon: cold pins, page cache dropped", True),
        ]
        for key, label, drop in passes:
            # kill -9 (nothing waits for write-behind), delete the arena, restart: every pin
            # promotes its blocks from the persistent tier
            daemon.kill()
            shutil.rmtree(memory_dir)  # the arena file and its index
            memory_dir.mkdir()
            if drop and not drop_page_cache():
                res.notes.append("the page cache could not be dropped (needs root): no dropped-cache load")
                continue
            daemon.start()
            OUR_PIDS["daemon"] = daemon.proc.pid
            with KVStoreClient(daemon.address, timeout=120.0) as client, py_spy(args, daemon.proc.pid, key):
                map_arena(client)
                setattr(
                    res,
                    key,
                    timed_pass(label, total, lambda c=client: pin_pass(c, "bench", w, hashes), res.passes),
                )
                stats = client.stats()
                res.read_stat[key] = stats["persistent_read_rate"] / GB
                if stats["persistent_hit_blocks"] != len(hashes):
                    res.notes.append(
                        f"{label}: {stats['persistent_hit_blocks']} of {len(hashes)} blocks came from the persistent tier"
                    )
    finally:
        daemon.stop()
        OUR_PIDS.pop("daemon", None)
        shutil.rmtree(memory_dir, ignore_errors=True)
        shutil.rmtree(data_root, ignore_errors=True)
    return res


def report_persistent(res: IoResult, sync: bool) -> None:
    print()
    print(
        f"== persistent tier vs raw I/O on the data dir's filesystem ({res.fs}): {format_size(res.nbytes)} in "
        f"{format_size(res.request)} requests (one per block) from {res.threads} threads (tiers.segments)"
    )
    head = f"{'':<60} {'GB/s':>6}  {'% of ceiling':>12}"
    print(head)
    print("-" * len(head))

    def row(label: str, value: float | None, ceiling: float | None = None) -> None:
        if value is None:
            return
        share = f"{100 * value / ceiling:11.0f}%" if ceiling else ""
        print(f"{label:<60} {value:6.2f}  {share:>12}")

    mode = "O_DIRECT " if res.direct else ""
    # the daemon fdatasyncs its segments with --sync only
    write = res.write if sync else res.write_nosync
    row(f"raw pwritev {mode}+ fdatasync" + (" (ceiling)" if sync else ""), res.write)
    row(f"raw pwritev {mode}without the fdatasync" + ("" if sync else " (ceiling)"), res.write_nosync)
    row("  daemon write-behind: first put .. write_behind_blocks 0", res.write_behind, write)
    row("  daemon write_behind_rate stat (its batches' own time)", res.write_behind_stat, write)
    row("  (the puts alone, into the arena)", res.put_only)
    row("raw preadv, page cache dropped (ceiling)", res.read_disk)
    row("  daemon cold load (pin), page cache dropped", res.load_dropped, res.read_disk)
    row("  daemon cold load (pin), first read after the writes (*)", res.load_first)
    row("raw preadv, page cache (ceiling)", res.read_cache)
    row("  daemon cold load (pin), page cache warm", res.load_warm, res.read_cache)
    if res.read_cache_group is not None:
        row(
            f"raw preadv, page cache, {format_size(res.group)} reads (ceiling)",
            res.read_cache_group,
        )
        row("  daemon cold load (pin), page cache warm", res.load_warm, res.read_cache_group)
    for key, value in res.read_stat.items():
        print(f"  (persistent_read_rate stat after {key}: {value:.2f} GB/s)")
    print("goal: the daemon's rows >= 70% of their ceiling")
    if res.read_cache_group is not None:
        print(
            f"a promotion reads a block in groups of layers ({format_size(res.group)} each, tiers.chain."
            "layer_groups): its own page-cache ceiling is the second"
        )
    if res.direct:
        print(
            "(*) the segments were written with O_DIRECT, so not from this kernel's page cache; on a VM the "
            "host may still cache them: no ceiling of its own"
        )
    if res.passes:
        print(
            f"others: up to {max(p.others for p in res.passes):.2f} cores during these passes, steal up to "
            f"{max(p.steal for p in res.passes):.2f} (one pass each: > ~0.3 is disturbed, rerun)"
        )
    for note in res.notes:
        print(f"note [persistent]: {note}")


# ---------------------------------------------------------------------------- report
def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def report(
    args: argparse.Namespace, w: Workload, results: list[PathResult], ceiling: PathResult | None
) -> None:
    print()
    print(
        f"== results: backend={args.backend} sync={args.sync} total={format_size(w.total_bytes)} "
        f"block={format_size(w.block_bytes)} ({w.layers} layers x {format_size(w.layer_block_bytes)}, bf16 "
        f"{list(w.shape)}) put/select={w.blocks_per_put} blocks "
        f"({format_size(w.blocks_per_put * w.block_bytes)}) "
        f"chunk_bytes={format_size(args.chunk_bytes)} repeat={args.repeat} cpus={os.cpu_count()}"
        + (" untuned-client" if args.untuned_client else "")
    )
    head = (
        f"{'path':<26} {'store cold':>10} {'store GB/s':>10} {'load 1st':>9} {'load GB/s':>10} "
        f"{'lookup p50':>11} {'p99 ms':>7} {'others':>7}"
    )
    print(head)
    print("-" * len(head))
    rows = results + ([ceiling] if ceiling else [])
    for r in rows:
        print(
            f"{r.name:<26} {fmt(r.store_cold):>10} {fmt(r.store_warm):>10} {fmt(r.load_first):>9} "
            f"{fmt(r.load_warm):>10} {fmt(r.lookup_p50_ms, '.3f'):>11} {fmt(r.lookup_p99_ms, '.3f'):>7} "
            f"{fmt(r.others):>7}"
        )
    print(
        f"{'target (daemon)':<26} {'':>10} {'>= ' + str(TARGETS['store']):>10} {'':>9} "
        f"{'>= ' + str(TARGETS['load']):>10} {'<= ' + str(TARGETS['lookup_p50_ms']):>11}"
    )
    d = results[0]
    for other in results[1:]:
        if other.name.startswith(("daemon", " ")):
            continue
        print(
            f"daemon / {other.name:<24} store {ratio(d.store_warm, other.store_warm):>7}  "
            f"load {ratio(d.load_warm, other.load_warm):>7}  "
            f"(cold store {ratio(d.store_cold, other.store_cold)})"
        )
    if ceiling:
        print(
            f"daemon / {ceiling.name:<24} store {ratio(d.store_warm, ceiling.store_warm):>7}  "
            f"load {ratio(d.load_warm, ceiling.load_warm):>7}"
        )
    cpu = {}
    for label, best in (("store", d.store_warm), ("load", d.load_warm)):
        ps = [p for p in d.passes if p.gbps == best]
        if ps:
            gb = w.total_bytes / GB
            cpu[label] = ", ".join(
                f"{k} {v / gb:.2f} ({100 * ps[0].sys[k] / v if v else 0:.0f}% sys)"
                for k, v in ps[0].cpu.items()
            )
    if cpu:
        print("daemon path CPU seconds per GB (best pass): " + "; ".join(f"{k}: {v}" for k, v in cpu.items()))
    for r in rows:
        for note in r.notes:
            print(f"note [{r.name}]: {note}")
    print(
        "GB/s = 1e9 B/s. store/load GB/s: best warm pass of --repeat; 'store cold' = first pass into a "
        "fresh store; 'load 1st' = first read pass; 'others' = most cores other processes used during that "
        "path's passes (> ~0.3: disturbed, rerun)."
    )


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("lmdb", "disk"), default="lmdb")
    p.add_argument(
        "--memory-dir",
        default="/dev/shm",
        help="a tmpfs; the daemons' arenas go in a private directory there, removed at the end",
    )
    p.add_argument(
        "--memory", default=None, help="the daemon's memory tier size (default: a pass fits; 0: off)"
    )
    p.add_argument("--total", type=parse_size, default="2GiB", help="bytes stored per pass (default 2GiB)")
    p.add_argument(
        "--block-bytes", type=parse_size, default="1MiB", help="bytes per block, all layers (1MiB)"
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks-per-put", type=int, default=64, help="blocks per put/select request (64)")
    p.add_argument("--sync", action="store_true", help="daemon --sync; raw LMDB sync=True")
    p.add_argument(
        "--chunk-bytes", type=parse_size, default=None, help="KVStoreClient(chunk_bytes=...) (4MiB)"
    )
    p.add_argument(
        "--chunk-sweep", default="", help="comma list of chunk sizes to try, e.g. 512KiB,1MiB,2MiB"
    )
    p.add_argument("--repeat", type=int, default=2, help="warm passes per figure; the best is reported (2)")
    p.add_argument("--inflight", type=int, default=2, help="puts in flight for the insert() row; 1: skip (2)")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--lookup-blocks", type=int, default=256)
    p.add_argument("--pool-bytes", type=parse_size, default="256MiB", help="distinct source data (256MiB)")
    p.add_argument(
        "--untuned-client",
        action="store_true",
        help="leave this process's glibc malloc at its defaults (the connector tunes it, see kvstore.memory)",
    )
    p.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the daemon process only (repeatable)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0.0,
        metavar="S",
        help="before each pass wait up to S s for other processes to leave the CPUs idle (shared VMs)",
    )
    p.add_argument("--skip-raw", action="store_true")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument(
        "--skip-persistent",
        action="store_true",
        help="skip the persistent tier vs raw I/O part (write-behind, cold loads, their ceilings)",
    )
    p.add_argument(
        "--persistent-total",
        type=parse_size,
        default="1GiB",
        help="bytes written behind and loaded cold in the persistent tier part (1GiB)",
    )
    p.add_argument("--profile-dir", default="", help="record py-spy raw stacks of the daemon per phase here")
    p.add_argument("--_ceiling-server", dest="ceiling_server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunk_bytes is None:
        from kvstore import wire

        args.chunk_bytes = wire.DEFAULT_CHUNK_BYTES
    args.chunk_sweep = [parse_size(s) for s in args.chunk_sweep.split(",") if s.strip()]
    args.daemon_env = dict(kv.split("=", 1) for kv in args.daemon_env)
    args.repeat = max(1, args.repeat)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ceiling_server:
        return ceiling_server()
    if not args.untuned_client:
        from kvstore.memory import tune_malloc

        tune_malloc()  # as the vLLM connector does in its worker process; the daemon always does
    QUIET["wait"] = args.quiet_wait
    t_start = time.perf_counter()
    print(f"building source tensors (pool {format_size(args.pool_bytes)}) ...", flush=True)
    w = make_workload(args)
    print(
        f"workload: {w.num_blocks} blocks x {format_size(w.block_bytes)} = {format_size(w.total_bytes)} "
        f"per pass, "
        f"{w.num_blocks // w.blocks_per_put} requests of {w.blocks_per_put} blocks; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-"))
    results: list[PathResult] = []
    ceiling = None
    persistent = None
    try:
        print(f"[daemon, backend={args.backend}]", flush=True)
        results.extend(bench_daemon(args, w, root))
        shutil.rmtree(root / "daemon-data", ignore_errors=True)
        if not args.skip_raw:
            print("[raw LMDB, in-process]", flush=True)
            results.append(bench_raw_lmdb(args, w, root))
        if not args.skip_redis:
            print("[redis]", flush=True)
            results.append(bench_redis(args, w, root))
        if not args.skip_ceiling:
            print("[raw gRPC stream on loopback]", flush=True)
            ceiling = bench_ceiling(args, w)
        if not args.skip_persistent:
            print("[persistent tier vs raw I/O on the data dir's filesystem]", flush=True)
            persistent = bench_persistent(args, w, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, w, results, ceiling)
    if persistent is not None:
        report_persistent(persistent, args.sync)
    if args.profile_dir:
        summarize_py_spy(args.profile_dir)
    print(f"(bench wall time {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

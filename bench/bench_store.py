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
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import numpy as np
from kvstore_connector.host_memory import prepare_arena
from store_baselines import (
    bench_ceiling,
    bench_memcpy,
    bench_raw_lmdb,
    bench_redis,
    ceiling_server,
    raw_io_ceilings,
)
from store_harness import (
    GB,
    OUR_PIDS,
    QUIET,
    IoResult,
    PathResult,
    Workload,
    best_of,
    drop_page_cache,
    fs_of,
    make_workload,
    new_hashes,
    py_spy,
    rate,
    report,
    report_persistent,
    summarize_py_spy,
    timed_pass,
)
from support.daemon import Daemon  # the same start-up as the tests use

from kvstore.sizes import format_size, parse_size


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


# ---------------------------------------------------------------------------- persistent tier
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

#!/usr/bin/env python
"""How long a restart takes to rebuild the index from the LMDB persistent tier.

    python bench/bench_restart.py [--blocks 1000000] [--layers 2] [--layer-bytes 64]
                                  [--chain 16] [--namespaces 4] [--profile]

Builds an LMDB persistent tier of --blocks blocks once, in this process
(LmdbBackend.write in batches of --batch blocks; tiny layers, so a million
blocks take a few hundred MB of disk), as chains of --chain blocks spread over
--namespaces namespaces, closes it, then times, each on its own:

  1. LmdbBackend open: its _recover pass reads every record and claims its
     extent in the segments' free space
  2. Store(backend, capacity, memory=None): the prefix index rebuilt from
     backend.scan() (what step 1 found)
  3. a real daemon start on the same data dir (`python -m kvstore_server
     --memory 0`), until its ready line on stdout, and the daemon's peak RSS
     (VmHWM); next to it the same daemon on an empty data dir (the fixed cost)

Each as blocks/s, with the CPU seconds the process spent and how many cores other
processes kept busy meanwhile ("others": on a shared 2-core VM, a phase whose cpu
is well below its wall time waited for a core). The page cache is warm (the
files were just written; nothing here drops it). With
--profile, step 1 is taken apart (the LMDB walk, the records' parsing, the
extents' claims in key order and in offset order, each timed alone) and steps 1
and 2 run once more under cProfile, the top functions printed. Everything lives in a temp dir under $TMPDIR, removed at the end.
Prints figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)

from kvstore.blocks import checksum
from kvstore.layouts import backend_dir
from kvstore.sizes import format_size, parse_size
from kvstore_server.store import Store
from kvstore_server.tiers import BlockMeta, BlockWrite, LayerSpec
from kvstore_server.tiers.lmdb import LmdbBackend

REPO = Path(__file__).resolve().parents[1]


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile (bytes) of a process, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def busy_cpu() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: user nice system irq softirq steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def proc_cpu(pid: int) -> float:
    """utime + stime of a process, seconds (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class _GcClock:
    """Seconds this process spent in the cyclic garbage collector, and its full collections."""

    seconds = 0.0
    full = 0
    _began = 0.0

    @classmethod
    def callback(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            cls._began = time.perf_counter()
        else:
            cls.seconds += time.perf_counter() - cls._began
            cls.full += info["generation"] == 2


gc.callbacks.append(_GcClock.callback)


class Meter:
    """Wall seconds of a phase, the CPU seconds this process used (of which in the garbage
    collector), and how many cores other processes kept busy meanwhile (`others`: above ~0.3
    the figures on 2 cores are disturbed)."""

    def __enter__(self) -> Meter:
        self.busy0, self.cpu0, self.t0 = busy_cpu(), time.process_time(), time.perf_counter()
        self.gc0, self.full0 = _GcClock.seconds, _GcClock.full
        return self

    def stop(self, extra_cpu: float = 0.0) -> None:
        """End the phase; `extra_cpu`: CPU seconds of a process of ours other than this one."""
        self.seconds = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        self.gc, self.full = _GcClock.seconds - self.gc0, _GcClock.full - self.full0
        others = busy_cpu() - self.busy0 - self.cpu - extra_cpu
        self.others = max(0.0, others) / self.seconds if self.seconds > 0 else 0.0

    def __exit__(self, *exc: object) -> None:
        if not hasattr(self, "seconds"):
            self.stop()

    def note(self, cpu: float | None = None) -> str:
        """cpu and others; `cpu`: another process's (then nothing is known of its collector)."""
        gc_note = f" (gc {self.gc:5.2f} s, {self.full} full)" if cpu is None else ""
        return f"   cpu {self.cpu if cpu is None else cpu:6.2f} s{gc_note}, others {self.others:.2f} cores"


def du(path: Path) -> int:
    """Bytes allocated on disk under `path` (st_blocks: preallocated files count whole)."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:>12,.0f} blocks/s" if seconds > 0 else ""


def row(label: str, n: int, seconds: float, extra: str = "") -> None:
    print(f"  {label:<46} {seconds:8.2f} s {rate(n, seconds)}{extra}", flush=True)


def build(root: Path, args: argparse.Namespace) -> None:
    """The persistent tier of args.blocks blocks, written in batches through LmdbBackend.write."""
    layers = tuple(LayerSpec(f"layer.{i}", "uint8", (args.layer_bytes,)) for i in range(args.layers))
    payloads = [bytes([i + 1]) * args.layer_bytes for i in range(args.layers)]
    sums = tuple(checksum(p) for p in payloads)
    namespaces = [f"bench-ns-{i}".encode() for i in range(args.namespaces)]
    with Meter() as m:
        backend = LmdbBackend(root, capacity_bytes=args.capacity, sync=False)
        now = time.time()
        batch: list[BlockWrite] = []
        parent = b""
        for i in range(args.blocks):
            chain, position = divmod(i, args.chain)
            if position == 0:
                parent = b""
            block_hash = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()
            meta = BlockMeta(namespaces[chain % len(namespaces)], block_hash, parent, layers, sums, now)
            batch.append(BlockWrite(meta, payloads))
            parent = block_hash
            if len(batch) == args.batch:
                backend.write(batch)
                batch = []
            if (i + 1) % (args.blocks // 10 or 1) == 0:
                print(f"    ... {i + 1:,} blocks written, {time.perf_counter() - m.t0:.1f} s", flush=True)
        if batch:
            backend.write(batch)
        backend.close()
    row(f"build: {args.blocks:,} blocks, batches of {args.batch}", args.blocks, m.seconds, m.note())


def open_and_index(root: Path, args: argparse.Namespace) -> None:
    """Steps 1 and 2, timed, with this process's RSS around them."""
    rss0 = proc_status()["VmRSS"]
    with Meter() as opening:
        backend = LmdbBackend(root, capacity_bytes=args.capacity, sync=False)
    found = len(backend._recovered or ())  # noqa: SLF001
    rss1 = proc_status()["VmRSS"]
    with Meter() as indexing:
        store = Store(backend, args.capacity, memory=None)
    rss2 = proc_status()["VmRSS"]
    n = store._index.num_blocks  # noqa: SLF001
    row("1. LmdbBackend open (_recover: parse + claim)", found, opening.seconds,
        f"{opening.note()}; RSS +{(rss1 - rss0) / 2**20:,.0f} MiB")  # fmt: skip
    row("2. Store(backend, capacity): index from scan", n, indexing.seconds,
        f"{indexing.note()}; RSS +{(rss2 - rss1) / 2**20:,.0f} MiB")  # fmt: skip
    row("   1 + 2", n, opening.seconds + indexing.seconds, f"   cpu {opening.cpu + indexing.cpu:6.2f} s")
    if n != args.blocks or found != args.blocks:
        print(f"  !! expected {args.blocks:,} blocks: open found {found:,}, the index holds {n:,}")
    start = time.perf_counter()
    gc.collect()
    print(f"  (a full gc.collect() with the index built: {time.perf_counter() - start:.2f} s; "
          f"{len(gc.get_objects()):,} objects tracked)", flush=True)  # fmt: skip
    start = time.perf_counter()
    store.close()
    print(f"  (store.close: {time.perf_counter() - start:.2f} s)", flush=True)


def split_step1(root: Path) -> None:
    """Step 1's parts on their own, without a profiler's overhead: the LMDB cursor walk, the
    walk with records.parse, and the extents' claims on fresh allocators (tiers.arena.Allocator,
    as Segments.claim makes them) in the order _recover claims them (the records' key order:
    by hash, so random in offset) and sorted by (segment, offset)."""
    import lmdb

    from kvstore import records
    from kvstore.blocks import Layout
    from kvstore.layouts import BLOCKS_DB, LAYOUTS_DB, LMDB_MAX_DBS, SEGMENTS_DIR
    from kvstore_server.tiers.arena import Allocator
    from kvstore_server.tiers.segments import aligned

    print("\nstep 1 taken apart (no profiler):", flush=True)
    env = lmdb.open(str(root), readonly=True, lock=False, max_dbs=LMDB_MAX_DBS)
    try:
        blocks_db, layouts_db = env.open_db(BLOCKS_DB, create=False), env.open_db(LAYOUTS_DB, create=False)
        with Meter() as m, env.begin(buffers=True) as txn:
            n = sum(1 for _ in txn.cursor(db=blocks_db))
        row("LMDB cursor walk", n, m.seconds, m.note())
        with Meter() as m, env.begin(buffers=True) as txn:
            layouts = {bytes(d): Layout.parse(raw) for d, raw in txn.cursor(db=layouts_db)}
            where = [records.parse(bytes(k), raw, layouts).where for k, raw in txn.cursor(db=blocks_db)]
        row("walk + records.parse (BlockMeta per block)", n, m.seconds, m.note())
    finally:
        env.close()
    sizes = sorted((root / SEGMENTS_DIR).iterdir())
    for label, order in (
        ("key order", where),
        ("(segment, offset) order", sorted(where, key=lambda w: (w[1], w[0]))),
    ):
        free = [Allocator(0, path.stat().st_size) for path in sizes]
        runs = 0
        with Meter() as m:
            for i, (offset, segment, nbytes) in enumerate(order):
                free[segment].claim(offset, aligned(nbytes))
                if i % 1024 == 0:
                    runs = max(runs, sum(len(a._starts) for a in free))  # noqa: SLF001
        row(f"claims in {label}", n, m.seconds, f"{m.note()}; free runs up to ~{runs:,}")


def profiled(root: Path, args: argparse.Namespace) -> None:
    """Steps 1 and 2 again, each under cProfile: the top functions by own time and by cumulative."""
    for label in ("1. LmdbBackend open", "2. Store(backend, capacity)"):
        prof = cProfile.Profile()
        if label.startswith("1"):
            prof.enable()
            backend = LmdbBackend(root, capacity_bytes=args.capacity, sync=False)
            prof.disable()
            backend.close()
        else:
            backend = LmdbBackend(root, capacity_bytes=args.capacity, sync=False)
            prof.enable()
            store = Store(backend, args.capacity, memory=None)
            prof.disable()
            store.close()
        for sort in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(args.profile_top)
            text = out.getvalue()
            # from the header line of the table on (leaves out pstats' preamble but its totals)
            lines = text.splitlines()
            totals = next((ln.strip() for ln in lines if "function calls" in ln), "")
            table = lines[next(i for i, ln in enumerate(lines) if "ncalls" in ln) :]
            print(f"\n-- cProfile of step {label}, by {sort}: {totals}")
            print("\n".join(ln for ln in table if ln.strip()))


def daemon_start(
    data_dir: Path, args: argparse.Namespace, log_path: Path
) -> tuple[Meter, float, dict[str, int], str]:
    """A daemon started on `data_dir` and stopped once ready: the phase (spawn to the ready line
    on stdout), the daemon's CPU seconds by then, its /proc status then, and its "loaded" log line."""
    cmd = [
        sys.executable, "-m", "kvstore_server", "--data-dir", str(data_dir),
        "--capacity", str(args.capacity), "--memory", "0", "--listen", "127.0.0.1:0",
    ]  # fmt: skip
    with log_path.open("wb") as log, Meter() as m:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            if "ready" not in line:
                proc.wait(timeout=args.daemon_timeout)
                raise RuntimeError(f"the daemon did not start (rc {proc.returncode}): "
                                   + log_path.read_text()[-2000:])  # fmt: skip
            cpu = proc_cpu(proc.pid)
            m.stop(extra_cpu=cpu)
            status = proc_status(proc.pid)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=args.daemon_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    loaded = next((ln for ln in log_path.read_text().splitlines() if "loaded" in ln and "blocks" in ln), "")
    return m, cpu, status, loaded.split(": ", 1)[-1]


def rss_note(status: dict[str, int]) -> str:
    return (f"; peak RSS {status['VmHWM'] / 2**20:,.0f} MiB (at ready: anon {status['RssAnon'] / 2**20:,.0f}"
            f" + file {status['RssFile'] / 2**20:,.0f} MiB)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layer-bytes", type=int, default=64, help="bytes per layer per block (default 64)")
    p.add_argument("--chain", type=int, default=16, help="blocks per chain (default 16)")
    p.add_argument("--namespaces", type=int, default=4)
    p.add_argument("--batch", type=int, default=16384, help="blocks per LmdbBackend.write (build)")
    p.add_argument("--capacity", type=parse_size, default=parse_size("64GiB"))
    p.add_argument("--skip-daemon", action="store_true")
    p.add_argument("--daemon-timeout", type=float, default=600.0)
    p.add_argument("--profile", action="store_true", help="cProfile steps 1 and 2 (an extra pass)")
    p.add_argument("--profile-top", type=int, default=15)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-restart-"))
    try:
        data_dir = tmp / "data"
        root = backend_dir("lmdb", data_dir)
        block_bytes = args.layers * args.layer_bytes
        print(
            f"{args.blocks:,} blocks of {args.layers} x {args.layer_bytes} B, chains of {args.chain} "
            f"in {args.namespaces} namespaces; capacity {format_size(args.capacity)}; {os.cpu_count()} cores; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; in {tmp}",
            flush=True,
        )
        build(root, args)
        segments = sum(1 for _ in (root / "segments").iterdir())
        print(
            f"  on disk: {du(root) / 1e6:,.0f} MB allocated (data.mdb {(root / 'data.mdb').stat().st_size / 1e6:,.0f} MB, "
            f"{segments} segment file(s) preallocated; payload {args.blocks * block_bytes / 1e6:,.0f} MB)",
            flush=True,
        )
        print("restart (page cache warm):", flush=True)
        open_and_index(root, args)
        if not args.skip_daemon:
            m, cpu, status, _ = daemon_start(tmp / "empty", args, tmp / "daemon-empty.log")
            print(f"  {'3. daemon start, empty data dir (fixed cost)':<46} {m.seconds:8.2f} s {'':>21}"
                  f"{m.note(cpu)}{rss_note(status)}", flush=True)  # fmt: skip
            m, cpu, status, loaded = daemon_start(data_dir, args, tmp / "daemon.log")
            row(
                "3. daemon start, until its ready line",
                args.blocks,
                m.seconds,
                m.note(cpu) + rss_note(status),
            )
            print(f"     daemon: {loaded}", flush=True)
        if args.profile:
            split_step1(root)
            profiled(root, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The harness of bench/bench_store.py: the workload (per-layer source tensors, block
hashes), the results of a path and of the persistent part, CPU accounting of our processes
and the `others` load measure around each timed pass, best-of-N passes, the optional py-spy
recorder of the daemon and the printed reports.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import numpy as np

from kvstore.sizes import format_size

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


def handler_seconds(metrics_url: str) -> dict[str, tuple[float, float]]:
    """Each method's (calls, seconds) in a daemon's handlers so far, from its metrics
    (kvstore_rpc_duration_seconds): without the transport or the client's time."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, list[float]] = {}
    for found in re.finditer(
        r'^kvstore_rpc_duration_seconds_(sum|count)\{method="(\w+)"\} (\S+)$', text, re.M
    ):
        what, method, value = found.groups()
        out.setdefault(method, [0.0, 0.0])[0 if what == "count" else 1] = float(value)
    return {method: (calls, seconds) for method, (calls, seconds) in out.items()}

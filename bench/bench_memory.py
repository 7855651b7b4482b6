#!/usr/bin/env python
"""The daemon's resident memory under concurrent put and get load, against its budget.

    python bench/bench_memory.py [--backend lmdb|disk|both] [--budget 256MiB] [--clients 40]
                                 [--rounds 3] [--put-mib 16] [--readers 8] [--read-blocks 64]

Each round, --clients writers put --put-mib MiB each at once (16 layers x 64 KiB
blocks), more than `max_inflight_put_bytes` (--budget) admits, so the rest are
refused with RESOURCE_EXHAUSTED; meanwhile --readers clients read --read-blocks
stored blocks back. Printed per backend: idle RSS, peak RSS (VmHWM) and what it is
above idle + budget (the README's constant bounds it), the peak of the daemon's own
(anonymous) memory, and RSS a few seconds after the load. Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from integration.helpers import NS, chain, make_layers
from support.daemon import Daemon

from kvstore.sizes import parse_size
from kvstore_client import KVStoreClient, errors

MiB = 1 << 20


def run(backend: str, args: argparse.Namespace, tmp: Path) -> str:
    daemon = Daemon(
        tmp / backend,
        backend=backend,
        capacity="8GiB",
        extra_args=["--max-inflight-put-bytes", str(args.budget)],
    ).start()
    try:
        blocks = args.put_mib  # 1 MiB blocks
        layers = make_layers(blocks, num_layers=16, shape=(64, 512), seed=1)
        stored = chain("readable", args.read_blocks)
        with KVStoreClient(daemon.address, timeout=120) as kv:
            for start in range(0, args.read_blocks, blocks):
                part = stored[start : start + blocks]
                kv.put(
                    NS,
                    part,
                    {k: v[: len(part)] for k, v in layers.items()},
                    parent_hash=stored[start - 1] if start else b"",
                )
        time.sleep(2)  # let the idle reclaim run: the figure is a quiet daemon
        idle = daemon.memory()
        outcomes: dict[str, int] = {}
        lock = threading.Lock()
        anon_peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                anon_peak[0] = max(anon_peak[0], daemon.memory()["RssAnon"])

        def writer(i: int, r: int) -> None:
            with KVStoreClient(daemon.address, timeout=120) as kv:
                try:
                    kv.put(NS, chain(f"w{i}-{r}", blocks), layers)
                    outcome = "stored"
                except errors.CapacityExceeded:
                    outcome = "refused"
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        def reader() -> None:
            with KVStoreClient(daemon.address, timeout=120) as kv:
                kv.select(NS, stored)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.perf_counter()
        for r in range(args.rounds):
            threads = [threading.Thread(target=writer, args=(i, r)) for i in range(args.clients)]
            threads += [threading.Thread(target=reader) for _ in range(args.readers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elapsed = time.perf_counter() - started
        done.set()
        sampler.join()
        peak = daemon.memory()["VmHWM"]
        time.sleep(3)  # the daemon reclaims after 1 s without bulk calls
        after = daemon.memory()["VmRSS"]
        return (
            f"{backend:5} {idle['VmRSS'] / MiB:7.0f} {peak / MiB:8.0f} {(peak - idle['VmRSS'] - args.budget) / MiB:+10.0f}"
            f" {(anon_peak[0] - idle['RssAnon'] - args.budget) / MiB:+10.0f} {after / MiB:8.0f} {elapsed:7.1f}s"
            f"  stored {outcomes.get('stored', 0)}, refused {outcomes.get('refused', 0)}"
        )
    finally:
        daemon.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("lmdb", "disk", "both"), default="both")
    p.add_argument("--budget", type=parse_size, default="256MiB", help="max_inflight_put_bytes (256MiB)")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--put-mib", type=int, default=16, help="MiB per put (1 MiB blocks)")
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--read-blocks", type=int, default=64, help="blocks each reader reads back (64)")
    args = p.parse_args()
    backends = ("lmdb", "disk") if args.backend == "both" else (args.backend,)
    print(
        f"budget {args.budget / MiB:.0f} MiB; per round {args.clients} x {args.put_mib} MiB puts at once, "
        f"{args.readers} readers of {args.read_blocks} MiB; {args.rounds} rounds"
    )
    print("      idle MiB peak MiB peak-idle-budget anon-over  after MiB   time")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            print(run(backend, args, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()

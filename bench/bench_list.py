#!/usr/bin/env python
"""List (kvstore-cli ls) on a large store, and what it does to lookups meanwhile.

    python bench/bench_list.py [--blocks 1000000] [--page 1000]

A Store on LMDB whose index holds --blocks entries (added to the index
directly: the backend's contents do not matter to List), one thread paging
through it with list_blocks as the List RPC does, and this thread timing
one-block lookups (the serving path) every 5 ms meanwhile. Prints figures
only, never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)

from kvstore_server.store import Store
from kvstore_server.tiers import open_backend


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--page", type=int, default=1000)
    p.add_argument("--lookups", type=int, default=300)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-bench-list-"))
    try:
        store = Store(open_backend("lmdb", tmp, capacity_bytes=1 << 30, sync=False), 1 << 60)
        for _ in range(args.blocks):
            store._index.add(b"bench", os.urandom(32), b"", 1 << 20, 0.0, 32)  # noqa: SLF001

        pages: list[float] = []
        stop = threading.Event()

        def lister() -> None:
            after = None
            while not stop.is_set():
                start = time.perf_counter()
                _, after = store.list_blocks(None, args.page, after)
                pages.append(time.perf_counter() - start)

        thread = threading.Thread(target=lister)
        thread.start()
        latencies = []
        probe = [os.urandom(32)]
        for _ in range(args.lookups):
            start = time.perf_counter()
            store.lookup(b"bench", probe)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
        stop.set()
        thread.join()
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    print(f"{args.blocks} blocks, pages of {args.page}: {len(pages)} pages listed, "
          f"a page in {statistics.median(pages) * 1e3:.0f} ms (median)")  # fmt: skip
    print(f"one-block lookups meanwhile: p50 {latencies[len(latencies) // 2] * 1e3:.2f} ms, "
          f"p99 {p99 * 1e3:.2f} ms, max {latencies[-1] * 1e3:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

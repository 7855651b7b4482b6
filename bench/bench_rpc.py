"""The arena's calls for one request of Llama-3.1-8B's shape, through a real daemon, without a GPU.

    python bench/bench_rpc.py [--blocks 128] [--layers 256] [--calls 300]

A daemon this bench starts (its own process, a private data dir and arena dir, both removed
at the end; --persist reused, so no save is written behind while the calls are timed) and
one client on its host, over the control socket as the connector's workers call it. A
request is --blocks blocks of --layers store layers (128 x 256: 2048 tokens of
Llama-3.1-8B with a store layer per KV head; 128 bytes a layer here, since these calls
carry the layout and the checksums, never the KV): --calls times, Reserve then Commit
(with packed checksums of a GPU's kind, the request before evicted: the arena's index
keeps its size); then --calls times, a Pin of one stored request and its Release, and a
Lookup that leases it, as the scheduler side asks. Each call's median at the client, and
its handler's mean in the daemon (kvstore_rpc_duration_seconds). Figures only, never
pass/fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from store_harness import handler_seconds  # the daemon's handler times, from its metrics
from support.daemon import Daemon  # the same start-up as the tests use

NS = "bench-rpc"
METHODS = ("Reserve", "Commit", "Pin", "Lookup")


def main() -> int:
    import torch

    from kvstore_client import KVStoreClient, tune_malloc
    from kvstore_client.types import LayerSpec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--blocks", type=int, default=128, help="blocks a request (128: 2048 tokens at 16 a block)"
    )
    p.add_argument(
        "--layers", type=int, default=256, help="store layers a block (256: 32 layers x 8 KV heads)"
    )
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--memory-root", default="/dev/shm", help="a tmpfs; the arena goes in a private dir there")
    args = p.parse_args()
    # as the connector does in a vLLM worker: without it each call's request or answer of
    # hundreds of KiB (the checksums) was a fresh mapping, faulted in page by page (a
    # 512-block Commit's request serialized in 0.95 ms, 0.1 with it, on the 2-core VM)
    tune_malloc()
    torch.set_num_threads(1)  # (see bench_trace.py: OpenMP workers spin on the daemon's core)
    root = Path(tempfile.mkdtemp(prefix="kvstore-rpc-"))
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-rpc-", dir=args.memory_root))
    layer = torch.zeros(args.blocks, 8, 8, dtype=torch.bfloat16)  # 128 bytes a block-layer
    specs = [LayerSpec.of(f"model.layers.{i // 8}.kv.h{i % 8}", layer) for i in range(args.layers)]
    sums = os.urandom(8 * args.blocks * args.layers)
    daemon = Daemon(
        root / "data", capacity="4GiB", memory_size=str(1 << 30), memory_dir=memory_dir,
        extra_args=["--log-level", "WARNING", "--persist", "reused", "--metrics-port", "0"],
    )  # fmt: skip
    client_s: dict[str, list[float]] = {method: [] for method in METHODS}
    try:
        daemon.start()
        with KVStoreClient(daemon.address, timeout=60.0) as kv:
            earlier: list[bytes] = []
            for _ in range(args.calls):
                hashes = [os.urandom(32) for _ in range(args.blocks)]
                t0 = time.perf_counter()
                res = kv.reserve(NS, hashes, specs)
                t1 = time.perf_counter()
                if res is None:
                    raise SystemExit("the client could not map the daemon's arena")
                res.commit(sums, kind="wsum32")
                t2 = time.perf_counter()
                client_s["Reserve"].append(t1 - t0)
                client_s["Commit"].append(t2 - t1)
                if earlier:
                    kv.evict(namespace=NS, block_hash=earlier[0])
                earlier = hashes
            before = handler_seconds(daemon.metrics_url)
            for _ in range(args.calls):
                t0 = time.perf_counter()
                pinned = kv.pin(NS, earlier)
                t1 = time.perf_counter()
                if pinned is None or pinned.num_blocks != args.blocks:
                    raise SystemExit("the request is not in the memory tier")
                pinned.release()
                t2 = time.perf_counter()
                where = kv.where(NS, earlier, lease_from=0)
                t3 = time.perf_counter()
                if where.lease is None:
                    raise SystemExit("the lookup leased nothing")
                kv.release_lease(where.lease)
                client_s["Pin"].append(t1 - t0)
                client_s["Lookup"].append(t3 - t2)
            after = handler_seconds(daemon.metrics_url)
        daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory_dir, ignore_errors=True)
    print(f"{args.blocks} blocks of {args.layers} store layers a request, {args.calls} calls each, over the "
          f"control socket; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print("  call      daemon (handler, mean)   client (median)")
    for method in METHODS:
        if method in ("Reserve", "Commit"):  # the first phase: every call so far
            calls, seconds = before.get(method, (0.0, 0.0))
        else:
            calls = after.get(method, (0.0, 0.0))[0] - before.get(method, (0.0, 0.0))[0]
            seconds = after.get(method, (0.0, 0.0))[1] - before.get(method, (0.0, 0.0))[1]
        daemon_ms = f"{seconds / calls * 1e3:6.2f} ms" if calls else "     -"
        what = " (leasing every block)" if method == "Lookup" else ""
        print(f"  {method:<8}  {daemon_ms:>22}   {statistics.median(client_s[method]) * 1e3:8.2f} ms{what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

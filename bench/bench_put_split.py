"""Small puts through the arena, each call timed apart: Reserve, the copy into the arena,
the checksums, Commit; with the daemon's write-behind running (`--persist every`, every
commit written behind at once) and without it (`--persist reused`: none of these blocks
is loaded again, so none is written behind), in one run. What write-behind's threads cost
the calls that share the daemon's GIL with them. Figures only, never pass/fail.

    python bench/bench_put_split.py [--blocks 30] [--block-bytes 64KiB] [--layers 8] [--puts 300]
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
from store_harness import layer_shape
from support.daemon import Daemon  # the same start-up as the tests use

from kvstore.sizes import format_size, parse_size

PARTS = ("reserve", "copy", "checksums", "commit", "put")


def run(persist: str, args: argparse.Namespace) -> dict[str, list[float]]:
    import torch

    from kvstore_client import KVStoreClient
    from kvstore_client.types import LayerSpec

    root = Path(tempfile.mkdtemp(prefix="kvstore-put-split-"))
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-put-split-", dir=args.memory_root))
    nbytes = args.puts * args.blocks * args.block_bytes
    daemon = Daemon(
        root / "data",
        capacity=str(2 * nbytes),
        memory_size=str(nbytes + (64 << 20)),  # every put stays in memory: no eviction in the calls
        memory_dir=memory_dir,
        extra_args=["--log-level", "WARNING", "--persist", persist],
    )
    shape = layer_shape(args.block_bytes // args.layers)
    layers = {f"layer.{i}": torch.randn(args.blocks, *shape).to(torch.bfloat16) for i in range(args.layers)}
    specs = [LayerSpec.of(name, t) for name, t in layers.items()]
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    try:
        daemon.start()
        with KVStoreClient(daemon.address, timeout=60.0) as client:
            for _ in range(args.puts):
                hashes = [os.urandom(32) for _ in range(args.blocks)]
                t0 = time.perf_counter()
                res = client.reserve("split", hashes, specs)
                if res is None:
                    raise SystemExit("the client could not map the daemon's arena")
                t1 = time.perf_counter()
                for i, tensor in enumerate(layers.values()):
                    res.layer(i).copy_(tensor)
                t2 = time.perf_counter()
                sums = res.checksums()
                t3 = time.perf_counter()
                res.commit(sums)
                t4 = time.perf_counter()
                for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                    times[part].append(seconds)
        daemon.stop()
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory_dir, ignore_errors=True)
    return times


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=30, help="blocks per put (30: the trace's mean request)")
    p.add_argument("--block-bytes", type=parse_size, default="64KiB")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--puts", type=int, default=300)
    p.add_argument("--memory-root", default="/dev/shm", help="a tmpfs; the arena goes in a private dir there")
    args = p.parse_args()
    torch.set_num_threads(1)  # (see bench_trace.py: OpenMP workers spin on the daemon's core)
    print(
        f"{args.puts} puts of {args.blocks} blocks of {format_size(args.block_bytes)} ({args.layers} layers) "
        f"through the arena; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    for persist, what in (("every", "write-behind running"), ("reused", "no write-behind")):
        times = run(persist, args)
        print(f"  --persist {persist:<6} ({what}), ms, p50 / mean:")
        for part in PARTS:
            xs = times[part]
            print(f"    {part:<10} {statistics.median(xs) * 1e3:7.3f} / {statistics.fmean(xs) * 1e3:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

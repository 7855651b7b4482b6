#!/usr/bin/env python3
"""The fleet path through the daemon, next to its alternatives, in one run.

    python bench/bench_fleet.py [--blocks 128] [--layers 32] [--repeat 3]

A private 3-master Redis Cluster (Debian's redis-server on free loopback ports, no
persistence) and two kvstore-server processes standing for two hosts (own data dirs,
ports and arenas; shared: only the cluster). A client puts a chain through daemon A
over gRPC and waits until A copied it to the fleet. Then, in this order:

  lookup (fleet only)   daemon B's Lookup of the whole prefix, which only the fleet has
  B, first load         a Get through daemon B: the blocks come from the fleet (verified)
                        into B's persistent tier, then stream to the client
  B, promoted           the same Get again: now from B's own tiers
  A over gRPC           the same blocks read from daemon A over gRPC (what a host without
                        a fleet would do: ask the daemon that has them)
  raw redis-py GET      the client library alone, pipelined GET of the same objects

Blocks are shaped like Llama-3.1-8B's at block size 16 (per layer [2, 8, 16, 128] bf16:
64 KiB; 2 MiB per block of 32 layers). Figures only, never pass/fail; GB/s = 1e9 B/s of
KV payload. Machines are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import torch
from support.daemon import Daemon, eventually
from support.redis_cluster import Cluster

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes

NS = "bench-fleet"


def timed(repeat: int, run: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    shape = (2, 8, 16, 128)
    layers = {f"layer.{i}": torch.randn((args.blocks, *shape)).to(torch.bfloat16) for i in range(args.layers)}
    payload = sum(t.numel() * t.element_size() for t in layers.values())
    tokens = [int(x) for x in torch.randint(0, 32000, (args.blocks * 16,))]
    hashes = block_hashes(NS, tokens, 16)
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-fleet-") as tmp:
        root = Path(tmp)
        cluster = Cluster(root / "redis").start()
        fleet = ["--fleet", cluster.url, "--fleet-prefix", f"bench-{secrets.token_hex(4)}/"]
        size = ["--capacity", "4GiB"]  # no memory tier: loads over gRPC, the same path for every row
        a = Daemon(root / "host-a", extra_args=[*fleet, *size], memory_size="0").start()
        b = Daemon(root / "host-b", extra_args=[*fleet, *size], memory_size="0").start()
        try:
            with KVStoreClient(a.address, arena=False, local_reads=False, timeout=120) as on_a:
                on_a.put(NS, hashes, layers)
                eventually(lambda: on_a.stats()["fleet_blocks_written"] == args.blocks, deadline_s=300)
                with KVStoreClient(b.address, arena=False, local_reads=False, timeout=120) as on_b:
                    lookups = timed(args.repeat, lambda: on_b.lookup(NS, hashes))
                    if on_b.lookup(NS, hashes) != args.blocks:
                        raise RuntimeError("daemon B does not see the blocks in the fleet")
                    first = timed(1, lambda: on_b.select(NS, hashes))
                    promoted = timed(args.repeat, lambda: on_b.select(NS, hashes))
                    fetched = on_b.stats()["fleet_hit_blocks"]
                grpc_a = timed(args.repeat, lambda: on_a.select(NS, hashes))
            rows.append((f"lookup of {args.blocks} blocks, fleet only", statistics.median(lookups), "median"))
            rows.append(("B, first load (from the fleet)", first[0], "one pass"))
            rows.append(("B, promoted (its own tiers)", min(promoted), "best"))
            rows.append(("A over gRPC (no fleet)", min(grpc_a), "best"))
            from redis.cluster import ClusterNode, RedisCluster

            raw = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes])
            names = [k for k in raw.scan_iter(match=fleet[3].encode() + b"*", count=1000)]

            def get_all() -> None:
                pipe = raw.pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                pipe.execute()

            rows.append(("raw redis-py GET (pipelined)", min(timed(args.repeat, get_all)), "best"))
            raw.close()
        finally:
            a.stop()
            b.stop()
            cluster.stop()
    print(f"{args.blocks} blocks x {args.layers} layers of {shape} bf16 = {payload / 1e6:.0f} MB of KV")
    print(f"(B fetched {fetched} blocks from the fleet)")
    print(f"{'path':40} {'time':>10} {'GB/s':>7}")
    for name, seconds, how in rows:
        rate = "" if name.startswith("lookup") else f"{payload / seconds / 1e9:7.2f}"
        print(f"{name:40} {seconds * 1e3:8.1f}ms {rate:>7}  ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

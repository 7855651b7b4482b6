#!/usr/bin/env python3
"""The fleet tier's choice of Redis client, measured: redis-py's RedisCluster pipeline
against valkey-glide's sync GlideClusterClient (a non-atomic ClusterBatch), SET then GET
of the same MiB values on a private 3-master Redis Cluster (tests/support/redis_cluster.py:
Debian's redis-server on free loopback ports, no persistence), in one run.

    python bench/bench_fleet_clients.py [--values 64] [--value-mib 1] [--repeat 3]
    python bench/bench_fleet_clients.py --sizes 32K,128K,512K,1M,4M [--total-mib 64]

Prints GB/s of each client per operation (best of --repeat) and the ratio glide / redis-py.
With --sizes: the same --total-mib of bytes as objects of each size (is packing small
blocks into 1-4 MiB objects worth it?), GB/s and the ratio to the largest size.
valkey-glide-sync is optional: `pip install valkey-glide-sync` (skipped with a note if absent).
Figures are of this machine and this moment: compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from support.redis_cluster import Cluster

from kvstore.sizes import parse_size


def best(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def bench_redis_py(
    cluster: Cluster, names: list[bytes], values: list[bytes], repeat: int
) -> dict[str, float]:
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode("127.0.0.1", n.port) for n in cluster.nodes]
    client = RedisCluster(startup_nodes=nodes, socket_timeout=30)

    def put() -> None:
        pipe = client.pipeline(transaction=False)
        for name, value in zip(names, values, strict=True):
            pipe.set(name, value)
        pipe.execute()

    def get() -> None:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        got = pipe.execute()
        if any(g is None for g in got):
            raise RuntimeError("redis-py read back a missing value")

    out = {"set": best(repeat, put), "get": best(repeat, get)}
    client.close()
    return out


def bench_glide(
    cluster: Cluster, names: list[bytes], values: list[bytes], repeat: int
) -> dict[str, float] | None:
    try:
        import glide_sync as g
    except ImportError:
        return None
    config = g.GlideClusterClientConfiguration(
        [g.NodeAddress("127.0.0.1", n.port) for n in cluster.nodes], request_timeout=30_000
    )
    client = g.GlideClusterClient.create(config)

    def put() -> None:
        batch = g.ClusterBatch(is_atomic=False)
        for name, value in zip(names, values, strict=True):
            batch.set(name, value)
        client.exec(batch, raise_on_error=True)

    def get() -> None:
        batch = g.ClusterBatch(is_atomic=False)
        for name in names:
            batch.get(name)
        got = client.exec(batch, raise_on_error=True)
        if got is None or any(v is None for v in got):
            raise RuntimeError("glide read back a missing value")

    out = {"set": best(repeat, put), "get": best(repeat, get)}
    client.close()
    return out


def sweep(sizes: list[int], total: int, repeat: int) -> int:
    """The same bytes as objects of each size, on one cluster, in one run."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-fleet-") as root:
        cluster = Cluster(Path(root)).start()
        try:
            for size in sizes:
                count = max(1, total // size)
                names = [b"bench:%d:%d" % (size, i) for i in range(count)]
                values = [os.urandom(size)] * count
                got = {"redis-py": bench_redis_py(cluster, names, values, repeat)}
                glide = bench_glide(cluster, names, values, repeat)
                if glide is not None:
                    got["glide-sync"] = glide
                rows.append((size, count, got))
                cluster.flush()
        finally:
            cluster.stop()
    print(f"{total / (1 << 20):g} MiB as objects of each size on a 3-master Redis Cluster (loopback), "
          f"best of {repeat}; ratio: to the largest size")  # fmt: skip
    print(
        f"{'object':>8} {'count':>6} {'client':11} {'SET GB/s':>9} {'GET GB/s':>9} {'SET x':>6} {'GET x':>6}"
    )

    def rates(size: int, count: int, r: dict[str, float]) -> tuple[float, float]:
        return size * count / r["set"] / 1e9, size * count / r["get"] / 1e9

    largest = {client: rates(rows[-1][0], rows[-1][1], r) for client, r in rows[-1][2].items()}
    for size, count, got in rows:
        for client, r in got.items():
            put, get = rates(size, count, r)
            ref = largest[client]
            print(f"{size >> 10:>7}K {count:>6} {client:11} {put:9.2f} {get:9.2f} "
                  f"{put / ref[0]:6.2f} {get / ref[1]:6.2f}")  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", type=int, default=64)
    p.add_argument("--value-mib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sizes", help="comma-separated object sizes (32K,1M,...): the packing sweep")
    p.add_argument("--total-mib", type=int, default=64)
    args = p.parse_args()
    if args.sizes:
        sizes = sorted(parse_size(s) for s in args.sizes.split(","))
        return sweep(sizes, args.total_mib << 20, args.repeat)
    size = int(args.value_mib * (1 << 20))
    names = [b"bench:%d" % i for i in range(args.values)]
    values = [os.urandom(size) for _ in names]
    total = size * len(values)
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-fleet-") as root:
        cluster = Cluster(Path(root)).start()
        try:
            results = {"redis-py RedisCluster pipeline": bench_redis_py(cluster, names, values, args.repeat)}
            glide = bench_glide(cluster, names, values, args.repeat)
        finally:
            cluster.stop()
    if glide is not None:
        results["glide-sync ClusterBatch"] = glide
    print(
        f"{args.values} values of {args.value_mib:g} MiB on a 3-master Redis Cluster (loopback), best of {args.repeat}"
    )
    print(f"{'client':34} {'SET GB/s':>9} {'GET GB/s':>9}")
    for name, r in results.items():
        print(f"{name:34} {total / r['set'] / 1e9:9.2f} {total / r['get'] / 1e9:9.2f}")
    if glide is None:
        print("glide-sync: not installed (pip install valkey-glide-sync)")
    else:
        base = results["redis-py RedisCluster pipeline"]
        print(
            f"glide / redis-py: SET {base['set'] / glide['set']:.2f}x, GET {base['get'] / glide['get']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

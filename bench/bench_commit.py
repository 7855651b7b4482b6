"""A save's Commit in the daemon's own code, without a GPU or a client, and what room costs
a save in a full arena.

    python bench/bench_commit.py                          # 128 and 512 blocks of 256 layers
    python bench/bench_commit.py --blocks 128 --repeat 40 --extents 4000,20000

1. Commit: the store runs in this process as the daemon runs it (a memory tier under
   /dev/shm, the LMDB backend) and Reserves, then Commits, `--blocks` blocks of
   Llama-3.1-8B's shape with a store layer per KV head (256 layers of 8 KiB, 2 MiB a
   block: 128 blocks are a 2048-token prompt), with packed checksums of a GPU's kind, as
   the connector sends them; an earlier commit's blocks are deleted as each new one
   comes, so the arena's index stays the size it has in use. Printed per size, medians of
   `--repeat`: the Commit, and its parts (the arena index's record, placing the blocks in
   the tier, the prefix index, cutting the checksums per block). What the gRPC or control
   socket call adds is bench_gpu_datapath.py's split.
2. Room: a memory tier full of `--extents` one-block extents (a full arena of promoted
   blocks), and a promotion of one block into it, which evicts the least recently used
   extent: the time to find and free it.

Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import bench_gpu_datapath as g  # its Probe and timed: each part's calls timed

from kvstore import arena_format as fmt
from kvstore.blocks import WSUM32, BlockMeta, LayerSpec, PackedSums, intern_layout
from kvstore_server import admission, eviction
from kvstore_server.index import PrefixIndex
from kvstore_server.store import Store
from kvstore_server.tiers import open_backend
from kvstore_server.tiers.arena import ArenaIndex, MemoryTier, Placed, open_memory_tier

NS = b"bench-commit"
LAYER_BYTES = 8192  # 16 tokens x 128 head dim x 2 (K, V) x bf16: one KV head of a block
LAYERS = 256  # 32 layers x 8 KV heads
PARTS: list[tuple[str, Any, str]] = [
    ("the arena index's record", ArenaIndex, "put"),
    ("placing the blocks in the tier", MemoryTier, "place"),
    ("the prefix index", PrefixIndex, "add_chain"),
    ("the checksums cut per block", admission, "_per_block"),
]


def commits(blocks: int, repeat: int, root: Path, shm: Path) -> None:
    # interned, as the daemon's validation hands a request's layers on: one tuple a layout
    layers = intern_layout(
        tuple(LayerSpec(f"l{i}", "bfloat16", (16, 256), LAYER_BYTES) for i in range(LAYERS))
    )
    backend = open_backend("lmdb", root / "data", capacity_bytes=4 * blocks * LAYERS * LAYER_BYTES + (1 << 30),
                           sync=False)  # fmt: skip
    memory = open_memory_tier(shm, root / "arena", 3 * blocks * LAYERS * LAYER_BYTES + (64 << 20), "bench",
                              lease_seconds=30.0, write_behind_bytes=1 << 20, persist="reused")  # fmt: skip
    store = Store(backend, 1 << 40, memory=memory)
    probe = g.Probe()  # each part's calls timed into it, put back at the end
    plain = [(owner, attr, getattr(owner, attr)) for _, owner, attr in PARTS]
    for (what, owner, attr), (_, _, call) in zip(PARTS, plain, strict=True):
        setattr(owner, attr, g.timed(probe, what, call))
    spent: dict[str, list[float]] = {what: [] for what, _, _ in PARTS}
    total: list[float] = []
    earlier: list[bytes] = []
    try:
        for rep in range(repeat + 2):  # two to warm up
            hashes = [hashlib.sha256(b"%d %d" % (rep, i)).digest() for i in range(blocks)]
            res = store.reserve(b"", NS, b"", hashes, layers)
            if res is None:
                raise SystemExit("nothing was reserved")
            sums = PackedSums(os.urandom(8 * LAYERS * blocks))
            probe.reset()
            start = time.perf_counter()
            store.commit(b"", res.id, sums, WSUM32)
            total.append(time.perf_counter() - start)
            for what, times in spent.items():
                times.append(probe.total(what))
            if earlier:  # the index keeps the size it has in use
                store.evict(functools.partial(eviction.subtree, namespace=NS, block_hash=earlier[0]))
            earlier = hashes
    finally:
        for owner, attr, call in plain:
            setattr(owner, attr, call)
        store.close()
    ms = {name: statistics.median(times[2:]) * 1e3 for name, times in spent.items()}
    print(f"  {blocks:4d} blocks: Commit {statistics.median(total[2:]) * 1e3:6.2f} ms (median of {repeat}); "
          + ", ".join(f"{name} {t:.2f}" for name, t in ms.items()))  # fmt: skip


def room(extents: int, repeat: int, root: Path, shm: Path) -> None:
    each = fmt.extent_bytes(4000, 1)
    (root / f"arena-{extents}").mkdir()
    spec = (LayerSpec("kv", "uint8", (4000,), 4000),)
    tier = open_memory_tier(shm, root / f"arena-{extents}", (extents + 2) * each, "bench",
                            lease_seconds=30.0, write_behind_bytes=1 << 20)  # fmt: skip

    def place(at: int, i: int, now: float) -> None:
        meta = BlockMeta(NS, i.to_bytes(32, "big"), b"", spec, (1,), 1.0)
        with tier.lock:
            tier.place([Placed(meta, at, 1, 0)], now, dirty=False)
            tier.unpin_extents([at])

    try:
        count = tier.allocator.free_bytes // each
        for i, at in enumerate(tier.hold_block_extents(4000, count, 0.0)):
            place(at, i, 100.0 + i)
        times = []
        for k in range(repeat):
            start = time.perf_counter()
            (at,) = tier.hold_block_extents(4000, 1, 1e6 + k)  # evicts the least recently used
            times.append(time.perf_counter() - start)
            place(at, count + k, 1e6 + k)
    finally:
        tier.close()
    print(f"  {count:6d} extents: a promotion of one block evicts one in {statistics.median(times) * 1e3:.3f} ms "
          f"(median of {repeat})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="128,512", help="comma-separated commit sizes, in 2 MiB blocks")
    p.add_argument(
        "--extents", default="4000,20000", help="comma-separated full arenas, in one-block extents"
    )
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--memory-dir", default="/dev/shm", help="where the memory tiers' files go")
    args = p.parse_args()
    print(f"Commit of blocks of {LAYERS} layers of {LAYER_BYTES} bytes, in-process; parts in ms; "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    for blocks in (int(x) for x in args.blocks.split(",")):
        root = Path(tempfile.mkdtemp(prefix="kvstore-commit-"))
        shm = Path(tempfile.mkdtemp(prefix="kvstore-commit-", dir=args.memory_dir))
        (root / "arena").mkdir()
        try:
            commits(blocks, args.repeat, root, shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
    print("room in a full memory tier")
    for extents in (int(x) for x in args.extents.split(",")):
        root = Path(tempfile.mkdtemp(prefix="kvstore-commit-"))
        shm = Path(tempfile.mkdtemp(prefix="kvstore-commit-", dir=args.memory_dir))
        try:
            room(extents, args.repeat * 10, root, shm)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

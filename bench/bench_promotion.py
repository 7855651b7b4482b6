"""A cold load's promotion in the daemon's own code, without a GPU or a client: blocks
only the persistent tier holds, their segments in the page cache, read into a fresh
memory tier by `Store.pin_stream`, next to raw parallel `preadv` of the same bytes.

    python bench/bench_promotion.py                       # 128 and 512 blocks of 2 MiB
    python bench/bench_promotion.py --blocks 128 --threads 16 --switch-intervals 5,1,0.2

The blocks have Llama-3.1-8B's shape with a store layer per KV head (256 layers of 8 KiB,
2 MiB a block: 128 blocks are a 2048-token prompt). The store runs in this process, as
the daemon runs it (the LMDB backend, its I/O pool, a memory tier under /dev/shm),
without gRPC: what is printed is the daemon's part of a cold load (bench_gpu_datapath.py
measures the whole of it on a GPU host). Per case, medians of `--repeat`:

- answer: pin_stream's first answer (the blocks found, extents held, every read issued,
  the pin made), which a client waits for before it copies anything;
- first / last: its first and last progress report (blocks read, which a client copies);
- the first I/O task done, and an eighth of them: the reads' own progress;
- GB/s: the bytes over the time to the last report;
- the last report's blocks (and how long after the report before it came): what a loader
  still copies once the last read ended.

Each case runs under CPython switch intervals (`--switch-intervals`, ms): an I/O thread
returning from its preadv waits for the GIL while another thread runs Python, up to one
interval. With `--ranks N` (N > 1) each case also runs N pin_streams of the same blocks
started together from N threads, as the N tensor-parallel ranks of one engine load one
prompt: the time until every rank's last report, and how many promotions read the
blocks (1: the ranks shared one, the others joined it). Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)

from kvstore.blocks import LayerSpec
from kvstore.sizes import parse_size
from kvstore_server.store import Store
from kvstore_server.tiers import BlockMeta, BlockWrite, checksum, open_backend
from kvstore_server.tiers.arena import open_memory_tier
from kvstore_server.tiers.iopool import IOPool

NS = b"bench-promotion"
LAYER_BYTES = 8192  # 16 tokens x 128 head dim x 2 (K, V) x bf16: one KV head of a block
LAYERS = 256  # 32 layers x 8 KV heads


class TimedPool(IOPool):
    """The backend's I/O pool, noting when each task ends (since `start`)."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.start = 0.0
        self.ended: list[float] = []

    def submit_many(self, tasks: Sequence[tuple[int, Callable[[], None]]]) -> list[Future[None]]:
        futures = super().submit_many(tasks)
        for future in futures:
            future.add_done_callback(lambda _f: self.ended.append(time.perf_counter() - self.start))
        return futures


def write_blocks(backend: object, count: int) -> list[bytes]:
    """`count` chained blocks of one random payload (the bytes do not matter to a read)."""
    layers = tuple(LayerSpec(f"l{i}", "bfloat16", (16, 256), LAYER_BYTES) for i in range(LAYERS))
    payload = os.urandom(LAYER_BYTES * LAYERS)
    datas = [payload[k * LAYER_BYTES : (k + 1) * LAYER_BYTES] for k in range(LAYERS)]
    sums = tuple(checksum(d) for d in datas)
    hashes = [hashlib.sha256(b"promotion %d" % i).digest() for i in range(count)]
    for first in range(0, count, 32):
        batch = [
            BlockWrite(BlockMeta(NS, hashes[i], hashes[i - 1] if i else b"", layers, sums, 1.0), datas)
            for i in range(first, min(count, first + 32))
        ]
        backend.write(batch)  # type: ignore[attr-defined]
    return hashes


def raw_ceiling(path: Path, nbytes: int, request: int, threads: int) -> float:
    """GB/s of `threads` threads reading `nbytes` of `path` in `request`-byte preadv calls
    into anonymous memory (best of three)."""
    fd = os.open(path, os.O_RDONLY)
    buffer = mmap.mmap(-1, nbytes)
    view = memoryview(buffer)
    try:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(
                    pool.map(
                        lambda at: os.preadv(fd, [view[at : at + request]], at), range(0, nbytes, request)
                    )
                )
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9
    finally:
        view.release()
        buffer.close()
        os.close(fd)


@contextlib.contextmanager
def fresh_store(backend: object, shm: Path, root: Path, name: str, blocks: int) -> Iterator[Store]:
    """A Store over `backend` with a fresh memory tier of room for `blocks` blocks (and
    some), closed and its file removed afterwards (the backend serves the next case)."""
    nbytes = blocks * LAYER_BYTES * LAYERS + (64 << 20)
    memory = open_memory_tier(
        shm, root / "arena", nbytes, name, lease_seconds=30.0, write_behind_bytes=1 << 30
    )
    try:
        yield Store(backend, 1 << 40, memory=memory)  # type: ignore[arg-type]
    finally:
        memory.close()  # (not store.close(): the backend serves the next case)
        shutil.rmtree(shm, ignore_errors=True)
        shm.mkdir()


def promote(
    backend: object, pool: TimedPool, hashes: list[bytes], shm: Path, root: Path, rep: int
) -> list[float]:
    """One cold pin_stream of `hashes` into a fresh memory tier: ms to its answer, first
    and last report, the end, the first task and an eighth of the tasks done."""
    with fresh_store(backend, shm, root, f"run{rep}", 2 * len(hashes)) as store:
        pool.ended = []
        pool.start = start = time.perf_counter()
        stream = store.pin_stream(b"", NS, hashes)
        first = next(stream)
        answer = time.perf_counter() - start
        reports, blocks = [], [0]
        for ready in stream:
            reports.append(time.perf_counter() - start)
            blocks.append(getattr(ready, "blocks", blocks[-1]))
        end = time.perf_counter() - start
        store.release(b"", first.pin_id)  # type: ignore[union-attr]
    ended = sorted(pool.ended)
    times = [x * 1e3 for x in (answer, reports[0], reports[-1], end, ended[0], ended[len(ended) // 8])]
    # the last report's blocks: what a loader copies once the last read ended
    return [
        *times,
        float(blocks[-1] - blocks[-2]),
        (reports[-1] - reports[-2]) * 1e3 if len(reports) > 1 else 0.0,
    ]


def promote_ranks(
    backend: object, pool: TimedPool, hashes: list[bytes], shm: Path, root: Path, rep: int, ranks: int
) -> list[float]:
    """`ranks` cold pin_streams of `hashes` into a fresh memory tier, started together from
    as many threads: ms until every one's last report, the promotions made, the I/O tasks."""
    together = threading.Barrier(ranks + 1)
    done: list[float] = []
    failed: list[BaseException] = []

    def rank(store: Store) -> None:
        try:
            together.wait()
            stream = store.pin_stream(b"", NS, hashes)
            first = next(stream)
            for _ready in stream:
                pass
            done.append(time.perf_counter() - pool.start)
            store.release(b"", first.pin_id)  # type: ignore[union-attr]
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(exc)

    with fresh_store(backend, shm, root, f"ranks{rep}", (ranks + 1) * len(hashes)) as store:
        threads = [threading.Thread(target=rank, args=(store,)) for _ in range(ranks)]
        for thread in threads:
            thread.start()
        pool.ended = []
        pool.start = time.perf_counter()
        together.wait()
        for thread in threads:
            thread.join()
        if failed:
            raise failed[0]
        promotions = store.memory.counters.promotions  # type: ignore[union-attr]
    return [max(done) * 1e3, float(promotions), float(len(pool.ended))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="128,512", help="comma-separated promotion sizes, in 2 MiB blocks")
    p.add_argument("--threads", default="16", help="comma-separated I/O pool sizes (the daemon's: 16)")
    p.add_argument("--switch-intervals", default="5,1,0.5", help="comma-separated, ms (CPython's default: 5)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--data-root", default=None, help="where the data dir goes (default: $TMPDIR)")
    p.add_argument("--memory-dir", default="/dev/shm", help="where the memory tiers' files go")
    p.add_argument("--ranks", type=int, default=1, help="also N loads of the same blocks at once (TP ranks)")
    args = p.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    block_bytes = LAYER_BYTES * LAYERS
    root = Path(tempfile.mkdtemp(prefix="kvstore-promotion-", dir=args.data_root))
    shm = Path(tempfile.mkdtemp(prefix="kvstore-promotion-", dir=args.memory_dir))
    (root / "arena").mkdir()  # where a memory tier records its file
    try:
        backend = open_backend("lmdb", root / "data", capacity_bytes=max(sizes) * block_bytes * 2 + parse_size("1GiB"),
                               sync=False)  # fmt: skip
        hashes = write_blocks(backend, max(sizes))
        segments = sorted((root / "data").rglob("seg-*"))
        for segment in segments:  # into the page cache
            with open(segment, "rb") as f:
                while f.read(64 << 20):
                    pass
        print(f"{max(sizes)} blocks of {block_bytes >> 20} MiB ({LAYERS} layers) in the page cache; "
              f"{os.cpu_count()} CPUs")  # fmt: skip
        for n in sizes:
            nbytes = n * block_bytes
            ceilings = ", ".join(
                f"{request >> 20} MiB x {threads}: {raw_ceiling(segments[0], nbytes, request, threads):.1f}"
                for request, threads in ((2 << 20, 16), (8 << 20, 16), (8 << 20, 32))
            )
            print(f"\nraw preadv of {nbytes >> 20} MiB, GB/s: {ceilings}")
            for threads in (int(x) for x in args.threads.split(",")):
                for interval in (float(x) for x in args.switch_intervals.split(",")):
                    sys.setswitchinterval(interval / 1e3)
                    backend.io.close()  # type: ignore[attr-defined]
                    pool = backend.io = TimedPool(threads)  # type: ignore[attr-defined]
                    backend.io_threads = threads  # type: ignore[attr-defined]
                    rows = [promote(backend, pool, hashes[:n], shm, root, rep) for rep in range(args.repeat)]
                    med = [statistics.median(r[k] for r in rows) for k in range(8)]
                    print(f"  {n:4d} blocks, {threads:2d} threads, switch {interval:4.1f} ms: answer {med[0]:5.1f}, "
                          f"first {med[1]:5.1f}, last {med[2]:5.1f}, end {med[3]:5.1f} ms (tasks: first "
                          f"{med[4]:5.1f}, 1/8 {med[5]:5.1f}) -> {nbytes / med[2] / 1e6:5.1f} GB/s; the last report "
                          f"added {med[6]:.0f} blocks, {med[7]:.1f} ms after the one before")  # fmt: skip
                    if args.ranks > 1:
                        rows = [promote_ranks(backend, pool, hashes[:n], shm, root, rep, args.ranks)
                                for rep in range(args.repeat)]  # fmt: skip
                        med = [statistics.median(r[k] for r in rows) for k in range(3)]
                        print(f"  {'':4} {args.ranks} ranks at once: every rank's last report after {med[0]:5.1f} ms "
                              f"-> {nbytes / med[0] / 1e6:5.1f} GB/s of the prompt; promotions {med[1]:.0f} "
                              f"({med[2]:.0f} I/O tasks; promotions per run: "
                              f"{', '.join(f'{r[1]:.0f}' for r in rows)})")  # fmt: skip
        sys.setswitchinterval(0.005)
        backend.close()  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

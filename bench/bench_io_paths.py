"""Where a promotion's reads go: page-cache preadv into private memory vs into a shared
/dev/shm mapping (what the arena is), by request size and buffers per request.

    python bench/bench_io_paths.py [--mib 512] [--threads 8,16] [--requests 2048:8,256:8]

The persistent tier reads a block's layers (256 store layers of 8 KiB for Llama-3.1-8B
at 16 tokens) straight into the arena's extents with one preadv per block and layer
group. This separates what the kernel (or a sandbox's) copy into shared memory costs
from the request size and the number of buffers.

With --writes, also where write-behind's writes come from: O_DIRECT pwritev (then
fdatasync) of the same bytes out of the /dev/shm mapping in 4 MiB requests, (a) from one
buffer per request, (b) from 8 KiB pieces laid out as a layer-major arena extent lays out
a block's 256 store layers (512 iovecs a request, each piece in its own place), as
write-behind issues them, and (c) those pieces copied into one buffer per request first
(numpy, on the writing thread). Figures only.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import numpy as np

from kvstore_server.tiers.iopool import _vec_io


def address(buf: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    at = ctypes.addressof(anchor)
    del anchor
    return at


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--threads", default="16", help="thread counts, comma-separated (e.g. 8,16,32)")
    p.add_argument(
        "--requests",
        default="2048:2048,2048:8,1024:8,256:8",
        help="REQUEST:BUFFER pairs in KiB, comma-separated (a request of 8 KiB buffers is one preadv "
        "into 256 pieces of a block's store layers, as a promotion issues it)",
    )
    p.add_argument("--dir", default=None, help="where the source file goes (default $TMPDIR)")
    p.add_argument(
        "--writes", action="store_true", help="also O_DIRECT writes from scattered pieces (see above)"
    )
    p.add_argument(
        "--register",
        action="store_true",
        help="also register a second mapping of the shared file with CUDA (as an engine maps the arena)",
    )
    args = p.parse_args()
    total = args.mib << 20
    fd_dir = tempfile.mkdtemp(dir=args.dir)
    src = Path(fd_dir) / "source.bin"
    with open(src, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(args.mib):
            f.write(chunk)
    fd = os.open(src, os.O_RDONLY)
    scratch = bytearray(1 << 20)
    for off in range(0, total, 1 << 20):  # into the page cache
        os.preadv(fd, [scratch], off)
    shm_path = Path("/dev/shm") / f"kvstore-io-paths-{os.getpid()}"
    sfd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(sfd, total)
    shared = mmap.mmap(sfd, total)
    private = mmap.mmap(-1, total)
    for m in (shared, private):  # every page present
        m.write(b"\0" * total)
    registered = None
    if args.register:  # the pages pinned by another mapping, as a vLLM engine's is
        import torch

        registered = mmap.mmap(sfd, total)
        at = address(registered)
        rc = torch.cuda.cudart().cudaHostRegister(at, total, 0)
        print(f"cudaHostRegister of a second mapping: {rc}")
    try:
        print(f"{args.mib} MiB from the page cache; GB/s")
        print(f"{'memory':>8} {'threads':>7} {'request':>8} {'buffer':>8} {'GB/s':>7}")
        pairs = [tuple(int(x) << 10 for x in pair.split(":")) for pair in args.requests.split(",")]
        combos = [(t, r, b) for t in (int(x) for x in args.threads.split(",")) for r, b in pairs]
        for name, dest in (("private", private), ("shared", shared)):
            base = address(dest)
            for threads, request, piece in combos:

                def one(i: int, base: int = base, request: int = request, piece: int = piece) -> None:
                    at = i * request
                    n = request // piece
                    iov = np.empty((n, 2), dtype=np.uint64)
                    iov[:, 0] = base + at + np.arange(n, dtype=np.uint64) * piece
                    iov[:, 1] = piece
                    _vec_io("preadv", fd, iov, at, request)

                best = 0.0
                for _ in range(3):
                    start = time.perf_counter()
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(one, range(total // request)))
                    best = max(best, total / (time.perf_counter() - start) / 1e9)
                print(f"{name:>8} {threads:>7} {request >> 10:>6}Ki {piece >> 10:>6}Ki {best:7.2f}")
        if args.writes:
            for threads in (int(x) for x in args.threads.split(",")):
                writes(Path(fd_dir) / "written.bin", shared, total, threads)
    finally:
        if registered is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(address(registered))
            registered.close()
        shared.close()
        os.close(sfd)
        shm_path.unlink(missing_ok=True)
        os.close(fd)
        src.unlink()
        os.rmdir(fd_dir)


def writes(path: Path, source: mmap.mmap, total: int, threads: int) -> None:
    """O_DIRECT writes of `total` bytes of `source` in 4 MiB requests, three ways (best of 3)."""
    request, piece = 4 << 20, 8 << 10
    pieces = request // piece
    stride = total // pieces  # piece k of request i lies at k * stride + i * piece: layer-major
    base = address(source)
    layered = np.frombuffer(source, dtype=np.uint8).reshape(pieces, total // pieces // piece, piece)
    local = threading.local()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        how = "O_DIRECT"
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        how = "buffered (O_DIRECT refused)"
    print(f"{total >> 20} MiB written {how} in 4 MiB requests, {threads} threads, then fdatasync; GB/s")
    try:
        os.ftruncate(fd, total)

        def one(i: int, way: str) -> None:
            if way == "in order":
                iov = np.array([[base + i * request, request]], dtype=np.uint64)
            elif way == "a block's layers":
                iov = np.empty((pieces, 2), dtype=np.uint64)
                iov[:, 0] = base + i * piece + np.arange(pieces, dtype=np.uint64) * stride
                iov[:, 1] = piece
            else:  # copied first
                if getattr(local, "buffer", None) is None:
                    local.buffer = mmap.mmap(-1, request)  # page-aligned, as O_DIRECT needs
                    local.view = np.frombuffer(local.buffer, dtype=np.uint8).reshape(pieces, piece)
                np.copyto(local.view, layered[:, i, :])
                iov = np.array([[address(local.buffer), request]], dtype=np.uint64)
            _vec_io("pwritev", fd, iov, i * request, request)

        for way in ("in order", "a block's layers", "copied first"):
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda i, way=way: one(i, way), range(total // request)))
                os.fdatasync(fd)
                best = max(best, total / (time.perf_counter() - start) / 1e9)
            print(f"  {way:<18} {best:7.2f}")
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

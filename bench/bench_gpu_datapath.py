"""The connector's GPU data path for one request shaped like Llama-3.1-8B (run on a GPU host).

    python bench/bench_gpu_datapath.py [--tokens 2048] [--block-size 16] [--repeat 5] [--no-daemon]

(a) gather + device->host and host->device + scatter, exactly as the connector
    does them (kvstore_connector.transfer.BlockMover, one indexed copy per layer,
    pinned host buffers, a side stream), next to a plain pinned copy of the same
    bytes in the same run;
(b) the full save and load through KVStoreClient and a kvstore daemon on this
    host over loopback: gather -> put_stream -> commit, and get_stream -> scatter,
    the load both over gRPC and on the same-host fast path (the client reads the
    daemon's LMDB map, see kvstore_client.local).
Shape: 32 layers, 8 KV heads, head dim 128, bf16: 2048 tokens = 268 MB of KV.
Prints medians; never pass/fail.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for sub in ("", "connector"):
    sys.path.insert(0, str(ROOT / sub))

from kvstore_connector.transfer import BlockMover  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128


def timed(fn, repeat: int) -> float:
    fn()  # warm-up: allocator caches, pinned pools, kernels
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=8192, help="paged blocks per layer on the GPU")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-daemon", action="store_true", help="only part (a)")
    args = p.parse_args()
    dev = torch.device("cuda")
    mover = BlockMover(dev)
    nblk = args.tokens // args.block_size
    per_block = (KV_HEADS, args.block_size, 2 * HEAD_DIM)  # standardized [B, H, N, C] view
    caches = [
        torch.randn((args.pool_blocks, *per_block), dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)
    ]
    gen = torch.Generator().manual_seed(0)
    ids_list = torch.randperm(args.pool_blocks, generator=gen)[:nblk].tolist()
    ids = mover.index(ids_list)
    nbytes = LAYERS * nblk * KV_HEADS * args.block_size * 2 * HEAD_DIM * 2
    gb = nbytes / 1e9
    print(f"{torch.cuda.get_device_name()}: {args.tokens} tokens, {nblk} blocks of {args.block_size}, "
          f"{LAYERS} layers -> {nbytes / 1e6:.0f} MB of KV")  # fmt: skip

    flat = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    layer_src = [c[:nblk].contiguous() for c in caches]
    layer_pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in layer_src]

    t_plain_d2h = timed(lambda: pinned.copy_(flat, non_blocking=True), args.repeat)
    t_plain_h2d = timed(lambda: flat.copy_(pinned, non_blocking=True), args.repeat)

    def plain_layers_d2h() -> None:
        for src, dst in zip(layer_src, layer_pinned, strict=False):
            dst.copy_(src, non_blocking=True)

    t_layers_d2h = timed(plain_layers_d2h, args.repeat)
    saved: list = []

    def connector_save() -> None:
        saved[:] = [mover.gather(c, ids) for c in caches]
        for copy in saved:
            copy.wait()

    def connector_load() -> None:
        events = [mover.scatter(c, ids, copy.host) for c, copy in zip(caches, saved, strict=False)]
        for event in events:
            mover.wait_on_compute_stream(event)

    t_gather = timed(connector_save, args.repeat)
    t_scatter = timed(connector_load, args.repeat)
    # the round trip restored the same bytes
    check = [mover.gather(c, ids).wait() for c in caches[:2]]
    if not all(torch.equal(a, b.host) for a, b in zip(check, saved[:2], strict=False)):
        raise SystemExit("round trip changed the bytes")

    print("\n(a) device <-> host, median of", args.repeat)
    rows = [
        ("plain pinned D2H, one 268 MB copy", t_plain_d2h, t_plain_d2h),
        ("plain pinned D2H, per layer", t_layers_d2h, t_plain_d2h),
        ("connector gather + D2H (32 layers)", t_gather, t_plain_d2h),
        ("plain pinned H2D, one copy", t_plain_h2d, t_plain_h2d),
        ("connector H2D + scatter (32 layers)", t_scatter, t_plain_h2d),
    ]
    for name, seconds, ref in rows:
        print(
            f"  {name:<38}{seconds * 1e3:8.1f} ms {gb / seconds:7.1f} GB/s  {ref / seconds * 100:5.0f}% of plain"
        )
    if args.no_daemon:
        return
    full_path(args, mover, caches, ids, gb)


def full_path(args, mover: BlockMover, caches, ids, gb: float) -> None:
    from kvstore_client import KVStoreClient, LayerSpec, tune_malloc
    from kvstore_client.hashing import block_hashes

    tune_malloc()  # as the connector does in vLLM's worker process

    tmp = Path(tempfile.mkdtemp(prefix="kvstore-gpu-"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore_server", "--listen", "127.0.0.1:0", "--data-dir", str(tmp / "data"),
         "--capacity", "64GiB", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    address = proc.stdout.readline().split()[3]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    specs = [LayerSpec(n, "bfloat16", tuple(caches[0].shape[1:])) for n in names]
    counter = iter(range(10**6))
    saves, loads, local_loads = [], [], []

    def load(client, hashes) -> float:
        start = time.perf_counter()
        layers = client.get_stream(
            "bench", hashes, allocate=lambda s, n: mover.host_buffer((n, *s.shape), torch.bfloat16)
        )
        events = [mover.scatter(caches[i], ids, host) for i, (_, host) in enumerate(layers)]
        for event in events:
            mover.wait_on_compute_stream(event)
        torch.cuda.synchronize()
        if layers.num_blocks != len(hashes):
            raise RuntimeError(f"loaded {layers.num_blocks} of {len(hashes)} blocks")
        return time.perf_counter() - start

    try:
        with (
            KVStoreClient(address, timeout=60) as kv,
            KVStoreClient(address, timeout=60, local_reads=True) as lkv,
        ):
            for _ in range(args.repeat + 1):
                hashes = block_hashes("bench", [next(counter)] * args.tokens, args.block_size)
                torch.cuda.synchronize()
                start = time.perf_counter()
                copies = [mover.gather(c, ids) for c in caches]
                with kv.put_stream("bench", hashes, specs) as stream:
                    for name, copy in zip(names, copies, strict=False):
                        stream.write_layer(name, copy.wait())
                    stream.commit()
                saves.append(time.perf_counter() - start)
                loads.append(load(kv, hashes))
                local_loads.append(load(lkv, hashes))
            if lkv.local_data_dir is None:
                raise RuntimeError("the same-host client did not read the daemon's files")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    save, grpc_load = statistics.median(saves[1:]), statistics.median(loads[1:])
    local_load = statistics.median(local_loads[1:])
    print(f"\n(b) through KVStoreClient + daemon on loopback (LMDB), median of {args.repeat}")
    print(f"  save (gather, D2H, put, commit)        {save * 1e3:8.1f} ms {gb / save:7.2f} GB/s")
    print(f"  load over gRPC (get, H2D, scatter)     {grpc_load * 1e3:8.1f} ms {gb / grpc_load:7.2f} GB/s")
    print(f"  load, same-host reads (map, H2D, scat.) {local_load * 1e3:7.1f} ms {gb / local_load:7.2f} GB/s")


if __name__ == "__main__":
    main()

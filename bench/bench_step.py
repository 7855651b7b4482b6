"""A busy engine's step of many small saves, then loads, through the connector's worker (CPU).

    python bench/bench_step.py                          # 1, 8, 32 requests a step, 2 blocks each
    python bench/bench_step.py --requests 64 --blocks 1 --layers 32

Each step saves `--requests` requests of `--blocks` blocks (a store layer per KV head:
`--layers` x `--heads`) through the worker and a real daemon on this host, as vLLM drives
it: the step's first save_layer opens every save (the forward thread waits for that), then
a copy per layer, then the commits on the worker's sender thread; then a step loads them
back into other paged blocks. Each case three times in one run:

- together: what the worker does: a step's saves reserved in one ReserveMany and committed
  in one CommitMany, its loads pinned in one PinMany;
- one by one: a Reserve, a Commit and a Pin per request, as before those calls;
- one request of all the step's blocks (the same bytes in one save and one load).

Printed per case: the forward thread's wait for the opens, the save step until every save
is committed, the load step until every layer is in place, and blocks per second.
Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import torch
from kvstore_connector.config import ConnectorConfig, NamespaceInfo
from kvstore_connector.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_connector.transport import commit_each
from kvstore_connector.worker import WorkerSide
from support.daemon import Daemon  # a daemon process on a free port

from kvstore_client.hashing import block_hashes

BS = 16
ONE_BY_ONE, TOGETHER, ONE_REQUEST = "one by one", "together", "one request"


def run(args: argparse.Namespace, address: str, requests: int, how: str) -> dict[str, float]:
    """Steps of `requests` saves (then loads) of --blocks each; ONE_REQUEST: one of all."""
    blocks = args.blocks
    if how == ONE_REQUEST:
        requests, blocks = 1, requests * args.blocks
    info = NamespaceInfo("bench-model", "bfloat16", BS, args.heads, args.head_dim, False, "cpu", tp_size=1,
                         pp_size=1)  # fmt: skip
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    pool = 2 * requests * blocks + 1
    worker = WorkerSide(info.namespace(0), pool, ConnectorConfig(address=address), load=True, save=True,
                        save_sync=True, num_kv_heads=args.heads)  # fmt: skip
    caches = {n: torch.randn((pool, args.heads, BS, 2 * args.head_dim)).to(torch.bfloat16) for n in names}
    worker.register_kv_caches(caches)
    transport = worker._transport
    if transport is None:
        raise SystemExit("the worker has no transport")
    if how == ONE_BY_ONE:  # a Reserve, a Commit and a Pin per request, as before the *Many calls
        transport.reserve_all = lambda specs: None  # type: ignore[method-assign]  (then opened one by one)
        transport.commit_all = lambda saves: commit_each(transport, saves)  # type: ignore[method-assign]
        transport.pin_all = lambda specs, timeout: None  # type: ignore[method-assign]
    opens, saves_s, loads_s = [], [], []
    tag = (ONE_BY_ONE, TOGETHER, ONE_REQUEST).index(how)
    for step in range(args.steps + 1):
        saves, loads = [], []
        for r in range(requests):
            case = requests * 104_729 + blocks * 613 + tag * 31  # blocks no other case stored
            first = step * 1_000_003 + case * 1009 + r * 7919
            hashes = block_hashes(info.hash_root, [first + t for t in range(blocks * BS)], BS)
            saves.append(
                SaveSpec(f"s{step}-{r}", hashes, list(range(1 + r * blocks, 1 + (r + 1) * blocks)), b"")
            )
            at = 1 + (requests + r) * blocks  # loaded into other paged blocks
            loads.append(LoadSpec(f"l{step}-{r}", hashes, list(range(at, at + blocks))))
        meta = KVStoreConnectorMetadata(saves=saves)
        start = time.perf_counter()
        worker.open_saves_ahead(meta)  # start_load_kv
        worker.save_layer(meta, names[0])  # the first layer waits for the opens
        opened = time.perf_counter()
        for name in names[1:]:
            worker.save_layer(meta, name)
        worker.finish_step_saves()  # save_sync: waits for the commits
        saved = time.perf_counter()
        meta = KVStoreConnectorMetadata(loads=loads)
        worker.start_load(meta)
        for name in names:
            worker.wait_for_layer(name)
        errors = worker.block_ids_with_load_errors()
        loaded = time.perf_counter()
        if errors:
            raise SystemExit(f"{len(errors)} blocks failed to load")
        if step:  # the first is a warm-up
            opens.append(opened - start)
            saves_s.append(saved - start)
            loads_s.append(loaded - saved)
    stats = worker.take_stats()
    worker.close()
    want = (args.steps + 1) * requests * blocks
    got = (
        (stats.data.get("blocks_saved", 0), stats.data.get("blocks_loaded", 0))
        if stats is not None
        else (0, 0)
    )
    if got != (want, want):
        raise SystemExit(f"{got} of {want} blocks saved and loaded")
    n = requests * blocks
    save_s, load_s = statistics.median(saves_s), statistics.median(loads_s)
    return {"open": statistics.median(opens), "save": save_s, "load": load_s, "saved_bps": n / save_s,
            "loaded_bps": n / load_s}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,32", help="requests per step, a comma list (1,8,32)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per request (2)")
    p.add_argument("--layers", type=int, default=8, help="attention layers (8)")
    p.add_argument("--heads", type=int, default=8, help="KV heads: store layers per attention layer (8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (20)")
    args = p.parse_args()
    block = args.layers * args.heads * BS * 2 * args.head_dim * 2  # K and V, bf16
    print(f"blocks of {BS} tokens, {args.layers} layers x {args.heads} KV heads (store layers): "
          f"{block / 1024:.0f} KiB; {args.blocks} blocks a request; median of {args.steps} steps")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstore-steps-") as tmp:
        daemon = Daemon(Path(tmp) / "data", capacity="8GiB", memory_size="2GiB", memory_dir=Path(tmp) / "shm")
        daemon.start()
        try:
            print(f"{'requests':>8} {'':<12} | {'opens':>8} | {'save step':>9} {'blocks/s':>8} | "
                  f"{'load step':>9} {'blocks/s':>8}")  # fmt: skip
            for requests in [int(r) for r in args.requests.split(",")]:
                got = {
                    how: run(args, daemon.address, requests, how)
                    for how in (ONE_BY_ONE, TOGETHER, ONE_REQUEST)
                }
                for how, m in got.items():
                    print(f"{requests:>8} {how:<12} | {m['open'] * 1e3:5.2f} ms | {m['save'] * 1e3:6.2f} ms "
                          f"{m['saved_bps']:8.0f} | {m['load'] * 1e3:6.2f} ms {m['loaded_bps']:8.0f}")  # fmt: skip
                one = got[ONE_REQUEST]
                print(f"{'':>8} {'together / one request':<24} saves {got[TOGETHER]['saved_bps'] / one['saved_bps']:.0%}, "
                      f"loads {got[TOGETHER]['loaded_bps'] / one['loaded_bps']:.0%} of its blocks/s")  # fmt: skip
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()

"""A busy engine's step of many small saves through the connector's worker (CPU).

    python bench/bench_step_saves.py                          # 1, 8, 32 requests a step
    python bench/bench_step_saves.py --requests 64 --blocks 1 --layers 32

Each step saves `--requests` requests of `--blocks` blocks (a store layer per KV head:
`--layers` x `--heads`) through the worker and a real daemon on this host, as vLLM drives
it: the step's first save_layer opens every save (the forward thread waits for that), then
a copy per layer, then the commits on the worker's sender thread. Printed per case: the
forward thread's stall in the opens, the step until every save is committed, and the
blocks per second; the saves reserved and committed in one round trip each (ReserveMany,
CommitMany, as the worker does) and, for comparison in the same run, one Reserve and one
Commit per save; and one save of all the step's blocks (the same bytes in one request).
Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon import Daemon  # noqa: E402  (tests/daemon.py: a daemon process on a free port)
from kvstore_connector.config import ConnectorConfig, NamespaceInfo  # noqa: E402
from kvstore_connector.metadata import KVStoreConnectorMetadata, SaveSpec  # noqa: E402
from kvstore_connector.transport import commit_each, open_each  # noqa: E402
from kvstore_connector.worker import WorkerSide  # noqa: E402

from kvstore_client.hashing import block_hashes  # noqa: E402

BS = 16


def run(
    args: argparse.Namespace, address: str, requests: int, batched: bool, blocks: int = 0, tag: int = 0
) -> dict[str, float]:
    """`requests` saves of `blocks` (default --blocks) each a step; `tag` keeps its blocks apart."""
    blocks = blocks or args.blocks
    info = NamespaceInfo("bench-model", "bfloat16", BS, args.heads, args.head_dim, False, "cpu", tp_size=1,
                         pp_size=1)  # fmt: skip
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    pool = requests * blocks + 1
    worker = WorkerSide(info.namespace(0), pool, ConnectorConfig(address=address), load=False, save=True,
                        save_sync=False, num_kv_heads=args.heads)  # fmt: skip
    caches = {n: torch.randn((pool, args.heads, BS, 2 * args.head_dim)).to(torch.bfloat16) for n in names}
    worker.register_kv_caches(caches)
    transport = worker._transport
    if transport is None:
        raise SystemExit("the worker has no transport")
    if not batched:  # one Reserve and one Commit per save, as before ReserveMany and CommitMany
        transport.open_all = lambda specs: open_each(transport, specs)  # type: ignore[method-assign]
        transport.commit_all = lambda saves: commit_each(transport, saves)  # type: ignore[method-assign]
    opens, steps = [], []
    for step in range(args.steps + 1):
        saves = []
        for r in range(requests):
            case = requests * 104_729 + blocks * 613 + batched * 31 + tag * 7  # blocks no other case stored
            first = step * 1_000_003 + case * 1009 + r * 7919
            tokens = [first + t for t in range(blocks * BS)]
            hashes = block_hashes(info.hash_root, tokens, BS)
            ids = list(range(1 + r * blocks, 1 + (r + 1) * blocks))
            saves.append(SaveSpec(f"s{step}-{r}", hashes, ids, b""))
        meta = KVStoreConnectorMetadata(saves=saves)
        start = time.perf_counter()
        worker.save_layer(meta, names[0])  # opens the step's saves
        opened = time.perf_counter()
        for name in names[1:]:
            worker.save_layer(meta, name)
        worker.finish_step_saves()
        worker.wait_for_commits()
        done = time.perf_counter()
        if step:  # the first is a warm-up
            opens.append(opened - start)
            steps.append(done - start)
    stats = worker.take_stats()
    worker.close()
    saved = stats.data.get("blocks_saved", 0) if stats is not None else 0
    want = (args.steps + 1) * requests * blocks
    if saved != want:
        raise SystemExit(f"{saved} of {want} blocks saved: {stats.data if stats is not None else None}")
    step_s = statistics.median(steps)
    return {"open": statistics.median(opens), "step": step_s, "blocks_per_s": requests * blocks / step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,32", help="saves per step, a comma list (1,8,32)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per save (2)")
    p.add_argument("--layers", type=int, default=8, help="attention layers (8)")
    p.add_argument("--heads", type=int, default=8, help="KV heads: store layers per attention layer (8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (20)")
    args = p.parse_args()
    block = args.layers * args.heads * BS * 2 * args.head_dim * 2  # K and V, bf16
    print(f"blocks of {BS} tokens, {args.layers} layers x {args.heads} KV heads (store layers): "
          f"{block / 1024:.0f} KiB; {args.blocks} blocks a save; median of {args.steps} steps")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvstore-steps-") as tmp:
        daemon = Daemon(Path(tmp) / "data", capacity="8GiB", memory_size="2GiB", memory_dir=Path(tmp) / "shm")
        daemon.start()
        try:
            print(f"{'saves/step':>10} | {'opens: one by one':>20} {'together':>12} | "
                  f"{'step: one by one':>19} {'together':>12} | blocks/s one by one / together "
                  "| one save of the step's blocks: step, blocks/s (together: % of it)")  # fmt: skip
            for requests in [int(r) for r in args.requests.split(",")]:
                each = run(args, daemon.address, requests, batched=False)
                many = run(args, daemon.address, requests, batched=True)
                large = run(args, daemon.address, 1, batched=True, blocks=requests * args.blocks, tag=1)
                print(f"{requests:>10} | {each['open'] * 1e3:17.2f} ms {many['open'] * 1e3:9.2f} ms | "
                      f"{each['step'] * 1e3:16.2f} ms {many['step'] * 1e3:9.2f} ms | "
                      f"{each['blocks_per_s']:8.0f} / {many['blocks_per_s']:<8.0f} | "
                      f"{large['step'] * 1e3:8.2f} ms {large['blocks_per_s']:6.0f} "
                      f"({many['blocks_per_s'] / large['blocks_per_s'] * 100:.0f}%)")  # fmt: skip
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()

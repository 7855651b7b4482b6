"""Decode-instance time to first token: store hit vs recompute vs vLLM's ExampleConnector.

    python bench/bench_connector.py [--tokens 2048] [--layers 8] [--hidden 1024] [--prompts 8] [--rounds 2]

Builds a random Llama (nothing downloaded), starts a kvstore daemon, fills the
store (KVStoreConnector, kv_producer) and an ExampleConnector directory from one
"prefill" process, then in one "decode" process measures, for the same prompts,
the wall time of generate(max_tokens=1) with: no connector (recompute), the
kvstore connector (kv_consumer; on the same-host fast path, the default, and
with local_reads=false over gRPC) and ExampleConnector, and for the connectors
the time spent inside their hooks (lookup, load, ...: their own cost, less
noisy than the TTFT on a shared 2-core machine). The hit engines take turns
for --rounds rounds. Each engine first serves a warm-up prompt; each measured
prompt is new to the engine, so vLLM's own prefix cache never hits. Prints
medians and ratios. Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from harness import build_model, kv_config, run_engines
from support.daemon import Daemon

from kvstore_client import KVStoreClient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="turns of the hit engines (each a fresh engine)")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-"))
    model = build_model(
        tmp / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.hidden * 2,
        vocab=4096,
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(4096) for _ in range(args.tokens)] for _ in range(args.prompts + 1)]
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")},
    }
    llm = {"max_model_len": args.tokens + 64, "max_num_batched_tokens": args.tokens + 64,
           "kv_cache_memory_bytes": 1 << 30}  # fmt: skip
    daemon = Daemon(tmp / "data", capacity="8GiB", memory_size="1GiB", memory_dir=Path("/dev/shm")).start()
    try:
        common = {"prompts": prompts, "max_tokens": 1, "llm": llm, "one_by_one": True}
        print(
            f"filling the stores: {len(prompts)} prefills of {args.tokens} tokens per connector",
            file=sys.stderr,
        )
        started = time.monotonic()
        run_engines(tmp, model, [
            {"name": "fill-kvstore", "kv": kv_config(daemon.address, "kv_producer"), **common},
            {"name": "fill-example", "kv": example, **common},
        ], timeout=None, progress=True)  # fmt: skip
        fill_seconds = time.monotonic() - started
        with KVStoreClient(daemon.address) as kv:
            stored = kv.stats()["blocks"]
        expected = len(prompts) * (args.tokens // 32)
        print(
            f"kvstore holds {stored} blocks after the fill (full blocks of the prompts: {expected})",
            file=sys.stderr,
        )
        hits = {
            "kvstore hit": kv_config(daemon.address, "kv_consumer"),  # through the daemon's arena
            "ExampleConnector hit": example,
            "kvstore hit, files": kv_config(daemon.address, "kv_consumer", arena=False),
            "kvstore hit, gRPC": kv_config(daemon.address, "kv_consumer", arena=False, local_reads=False),
        }
        # the hit engines take turns, round after round: slow drifts of the machine
        # reach them all alike
        engines = [{"name": "recompute", "kv": None, **common}] + [
            {"name": f"{name}#{r}", "kv": kv, "time_hooks": True, **common}
            for r in range(args.rounds) for name, kv in hits.items()
        ]  # fmt: skip
        # sized from the work: the recompute engine alone redoes half the fill, and hit
        # engines that recompute (a broken store) would redo it once each
        timeout = 600 + fill_seconds * (1 + 3 * args.rounds)
        print(f"measuring {len(engines)} engines (timeout {timeout:.0f}s)", file=sys.stderr)
        out = run_engines(tmp, model, engines, timeout=timeout, progress=True)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the model and two stores: GBs

    kv_bytes = 2 * args.kv_heads * (args.hidden // args.heads) * 2 * args.layers * args.tokens
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads, bf16, block 32; "
          f"prompt {args.tokens} tokens = {kv_bytes / 2**20:.1f} MiB of KV; median of {args.prompts} prompts")  # fmt: skip
    # each engine's first prompt warmed it up
    rows = {"recompute": statistics.median(out["recompute"]["ttft"][1:])}
    hooks = {}
    for name in hits:
        runs = [out[f"{name}#{r}"] for r in range(args.rounds)]
        rows[name] = statistics.median(t for run in runs for t in run["ttft"][1:])
        hooks[name] = statistics.median(t for run in runs for t in run["hook_seconds"][1:])
    print(f"{'decode TTFT':<24}{'seconds':>10}{'vs recompute':>15}{'in connector hooks':>22}")
    for name, seconds in rows.items():
        spent = f"{hooks[name] * 1e3:.1f} ms" if name in hooks else ""
        print(f"{name:<24}{seconds:>10.3f}{rows['recompute'] / seconds:>14.1f}x{spent:>22}")
    print(
        f"kvstore hit vs ExampleConnector hit: {rows['ExampleConnector hit'] / rows['kvstore hit']:.2f}x TTFT, "
        f"{hooks['ExampleConnector hit'] / hooks['kvstore hit']:.2f}x time in the connector (>1: kvstore faster)"
    )
    print("goal: hit >= 10x faster than recompute, no slower than ExampleConnector")


if __name__ == "__main__":
    main()

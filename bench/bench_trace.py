#!/usr/bin/env python
"""Replay a request trace against a real daemon: prefix hits next to an infinite cache and an
LRU, bytes served per tier, the GPU time the hits would save, and the client's cost per request.

    python bench/bench_trace.py [--trace FILE] [--requests N] [--block-bytes 64KiB] [--layers 8]
                                [--memory 10%] [--capacity 50%] [--recompute-tokens-per-s 33000]

The trace: JSON lines in the Mooncake FAST'25 format, {"timestamp": ms, "input_length":
tokens, "output_length": tokens, "hash_ids": [ids]}, one --block-tokens (512) block per id;
any file of that format replays (default: the synthetic trace in ../shared/data, read in
place). Block keys are chained, h_i = sha256(h_{i-1} || id_i) from the namespace's root
(kvstore_client.hashing.root_hash), so an id matches only after the same prefix, as the
connector's hashes do.

A daemon the bench starts (its own process, a private data dir and arena dir, both removed at
the end) has a memory tier (--memory) and a persistent tier (--capacity) both smaller than
the trace's footprint (distinct blocks x --block-bytes); a size or a % of the footprint. Each
block is --block-bytes of KV (64 KiB: Llama-3.1-8B's 64 MiB per 512 tokens scaled down by
1024) in --layers bf16 layers. One client replays the requests one after another, as fast as
it can (the timestamps are not waited for: the figures are the store's cost per request, not
a queue's), each as a same-host vLLM worker would:

    lookup(ns, hashes)                      -> n, the stored prefix
    get_stream(ns, hashes[:n])              pin in the arena (promoting what only the persistent
                                            tier holds), verify, copy out (into buffers made once,
                                            as a connector's KV cache is), release
    put(ns, hashes[n:], parent=hashes[n-1]) reserve in the arena, copy in, checksum, commit
                                            (written behind to the persistent tier)

With --step N, N requests at a time as one engine step, the way the connector batches a
step: a leasing lookup per request (where), then the step's loads (the leases; one
pin_many for prefixes to promote), then its saves (one reserve_many, one commit_many): the
reserve_many sent as the loads start and the commit_many on a sender thread, as the
connector's worker does (--no-overlap: each waited for in turn).

Then prints figures (never pass/fail):
  - prefix-hit ratio, blocks loaded / blocks requested, next to an infinite cache and an LRU
    of the memory + persistent capacity in blocks (and of the persistent capacity alone: the
    tiers are inclusive, every block in memory is also written behind), simulated here over
    the same requests. The LRU touches a request's blocks tail first, so a chain's tail is
    evicted before its head (as vLLM's prefix cache and the daemon's tails-first policy do);
  - bytes served per tier, from the daemon's stats (memory_hit_blocks, persistent_hit_blocks,
    promoted_bytes), and its rates;
  - GPU time saved: tokens hit / --recompute-tokens-per-s (33000: Llama-3.1-8B on an H200,
    2048 tokens in 61 ms) minus the measured load time, for loads served by the memory tier
    alone and for loads that promoted blocks from the persistent tier; and each tier's load
    cost per block (a fit over the requests);
  - the client's cost per request: requests/s, blocks/s and GB/s through the daemon, a fit
    of time = fixed + per-block x blocks for loads and puts, next to the same bytes moved in
    one large put and one large select (the large-request rate; the trace's rate as % of it).

About 3 minutes on a 2-core VM with the defaults.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
import numpy as np
from store_harness import _machine_busy, _proc_cpu, handler_seconds, layer_shape
from support.daemon import Daemon  # the same start-up as the tests use

from kvstore.sizes import format_size, parse_size

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
NAMESPACE = "trace"
GB = 1e9


# ---------------------------------------------------------------------------- the trace
@dataclass
class Request:
    input_length: int
    ids: list[int]
    hashes: list[bytes] = field(default_factory=list)

    def tokens(self, blocks: int, block_tokens: int) -> int:
        """Tokens in the first `blocks` blocks (the last block of a prompt may be partial)."""
        return min(blocks * block_tokens, self.input_length)


def read_trace(path: Path, limit: int | None) -> list[Request]:
    out = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append(Request(int(row["input_length"]), [int(i) for i in row["hash_ids"]]))
            if limit is not None and len(out) >= limit:
                break
    return out


def chain_hashes(requests: list[Request], namespace: str) -> None:
    """32-byte chained keys per request: equal ids after equal prefixes give equal keys."""
    from kvstore_client.hashing import root_hash

    root = root_hash(namespace)
    memo: dict[tuple[bytes, int], bytes] = {}
    for req in requests:
        prev = root
        for block_id in req.ids:
            key = (prev, block_id)
            h = memo.get(key)
            if h is None:
                h = memo[key] = hashlib.sha256(prev + block_id.to_bytes(8, "little")).digest()
            req.hashes.append(h)
            prev = h


# ---------------------------------------------------------------------------- simulations
def simulate(requests: list[Request], capacity_blocks: int | None) -> int:
    """Blocks hit as a stored prefix, with an LRU of `capacity_blocks` (None: infinite). A
    request's blocks are touched tail first, so its head is the most recently used."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = 0
    for req in requests:
        n = 0
        for h in req.hashes:
            if h not in cache:
                break
            n += 1
        hits += n
        for h in reversed(req.hashes):
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits


# ---------------------------------------------------------------------------- the replay
@dataclass
class Row:
    """One request's measurements."""

    blocks: int
    tokens_hit: int = 0
    lookup_n: int = 0
    loaded: int = 0
    put: int = 0
    lookup_s: float = 0.0
    load_s: float = 0.0
    put_s: float = 0.0
    memory_hits: int = 0
    persistent_hits: int = 0


class Cpu:
    """CPU seconds of our processes (`pids`) over a span, and the cores other processes used."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = time.perf_counter()
        self.c0 = self._now()

    def _now(self) -> dict[str, float]:
        out = {k: sum(_proc_cpu(p)) for k, p in self.pids.items()}
        out["machine"] = _machine_busy()[0]
        return out

    def end(self) -> str:
        dt = time.perf_counter() - self.t0
        c1 = self._now()
        ours = {k: c1[k] - self.c0[k] for k in self.pids}
        others = max(0.0, c1["machine"] - self.c0["machine"] - sum(ours.values())) / dt
        return " ".join(f"{k} {v:.1f}s" for k, v in ours.items()) + f"; others {others:.2f} cores"


class Source:
    """Random bf16 KV per layer, [max_blocks, *shape]; a put sends the first k blocks. A
    load copies into `dest`, the same shape, allocated (and touched) once, as a connector
    copies into its KV cache: a fresh tensor per load cost page faults that swung the large
    select between 0.3 and 3.9 GB/s from one repeat to the next."""

    def __init__(self, layers: int, block_bytes: int, max_blocks: int) -> None:
        import torch

        self.shape = layer_shape(block_bytes // layers)
        gen = torch.Generator().manual_seed(0)
        self.layers = {
            f"layer.{i}": torch.randint(
                -32768, 32767, (max_blocks, *self.shape), dtype=torch.int16, generator=gen
            ).view(torch.bfloat16)
            for i in range(layers)
        }

        self.dest = {name: torch.zeros_like(t) for name, t in self.layers.items()}

    def first(self, k: int) -> dict[str, Any]:
        return {name: t[:k] for name, t in self.layers.items()}

    def into(self, spec: Any, blocks: int) -> Any:
        """A LayerStream's `allocate`: a load's destination of one layer, in `dest`."""
        return self.dest[spec.name][:blocks]


def replay(
    client: Any, requests: list[Request], source: Source, block_tokens: int, progress_s: float
) -> list[Row]:
    """Each request once, in order, as one same-host worker: lookup, select the stored prefix,
    put the rest. Only those three calls are timed; a Stats call after each select (untimed)
    says which tier served its blocks."""
    rows = []
    stats = client.stats()
    mem0, per0 = stats["memory_hit_blocks"], stats["persistent_hit_blocks"]
    started = last_print = time.perf_counter()
    for k, req in enumerate(requests):
        hashes = req.hashes
        row = Row(len(hashes))
        t0 = time.perf_counter()
        n = client.lookup(NAMESPACE, hashes)
        t1 = time.perf_counter()
        row.lookup_n, row.lookup_s = n, t1 - t0
        if n:
            got = client.get_stream(NAMESPACE, hashes[:n], allocate=source.into)
            got.read_all()
            row.load_s = time.perf_counter() - t1
            row.loaded = got.num_blocks
            stats = client.stats()  # untimed: which tier served the blocks
            mem1, per1 = stats["memory_hit_blocks"], stats["persistent_hit_blocks"]
            row.memory_hits, row.persistent_hits = mem1 - mem0, per1 - per0
            mem0, per0 = mem1, per1
        row.tokens_hit = req.tokens(row.loaded, block_tokens)
        rest = hashes[n:]
        if rest:
            t2 = time.perf_counter()
            res = client.put(
                NAMESPACE, rest, source.first(len(rest)), parent_hash=hashes[n - 1] if n else b""
            )
            row.put_s = time.perf_counter() - t2
            row.put = res.blocks_written
        rows.append(row)
        now = time.perf_counter()
        if now - last_print >= progress_s:
            last_print = now
            hit = sum(r.loaded for r in rows) / max(1, sum(r.blocks for r in rows))
            stats = client.stats()
            print(
                f"    {k + 1}/{len(requests)} requests in {now - started:.0f} s, prefix hits {100 * hit:.1f}%; "
                f"write-behind backlog {format_size(stats['write_behind_bytes'])}, dropped "
                f"{stats['write_behind_dropped']} blocks so far",
                flush=True,
            )
    return rows


def replay_steps(
    client: Any,
    requests: list[Request],
    source: Source,
    step: int,
    block_tokens: int,
    progress_s: float,
    overlap: bool = True,
) -> list[Row]:
    """The requests `step` at a time, as one engine step of a busy vLLM engine with the
    kvstore connector: each request's lookup leases the prefix's memory-tier blocks (the
    scheduler's `where`), then the step's loads (the leases, and one PinMany for prefixes
    that need promotion), then the step's saves (one ReserveMany, the copies, one
    CommitMany): each request's blocks past its stored prefix. A step's load and save time
    is shared among its requests by blocks; a request sees the saves of earlier steps only
    (as in an engine).

    `overlap`, as the connector's worker runs a step: the saves' ReserveMany goes out on
    another thread as the loads start (`open_saves_ahead`), and the CommitMany on a sender
    thread, not waited for (`finish_step_saves`); the next step's commit waits for it (one
    in flight). Else each call is waited for in turn."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from kvstore import wire
    from kvstore.blocks import XXH3
    from kvstore_client.arena.load import ArenaSource
    from kvstore_client.errors import LocalDataCorrupt, StoreTimeout
    from kvstore_client.streams import LayerStream
    from kvstore_client.types import Chain, LayerSpec

    specs = [LayerSpec.of(name, t[:1]) for name, t in source.layers.items()]
    rows: list[Row] = []
    failed: Counter[str] = Counter()  # answers that were errors, by call and error
    opener = ThreadPoolExecutor(1, thread_name_prefix="trace-opener") if overlap else None
    sender = ThreadPoolExecutor(1, thread_name_prefix="trace-sender") if overlap else None
    committing: tuple[Future[Any], list[tuple[Row, Any]]] | None = None

    def committed(results: list[Any], commits: list[tuple[Row, Any]]) -> None:
        for (row, _), result in zip(commits, results, strict=True):
            if isinstance(result, Exception):
                failed[f"CommitMany: {type(result).__name__}"] += 1
            else:
                row.put = result.blocks_written

    started = last_print = time.perf_counter()
    for k in range(0, len(requests), step):
        batch = requests[k : k + step]
        step_rows = [Row(len(req.hashes)) for req in batch]
        leases: list[Any] = []
        for req, row in zip(batch, step_rows, strict=True):
            t0 = time.perf_counter()
            where = client.where(NAMESPACE, req.hashes, lease_from=0)
            row.lookup_s = time.perf_counter() - t0
            row.lookup_n = where.num_blocks
            row.memory_hits = where.tiers.count(wire.TIER_MEMORY)
            row.persistent_hits = where.num_blocks - row.memory_hits
            leases.append(where.lease)
        # the step's saves, known once its requests are looked up: each request's blocks past
        # its stored prefix; reserved on the opener thread while the loads run (overlap)
        saving = [i for i, row in enumerate(step_rows) if row.lookup_n < len(batch[i].hashes)]
        chains = [
            Chain(batch[i].hashes[step_rows[i].lookup_n :], batch[i].hashes[step_rows[i].lookup_n - 1]
                  if step_rows[i].lookup_n else b"")
            for i in saving
        ]  # fmt: skip
        reserving = (
            opener.submit(client.reserve_many, NAMESPACE, chains, specs) if opener and chains else None
        )
        t0 = time.perf_counter()
        pins: list[Any] = [None] * len(batch)
        promote = []
        for i, (row, lease) in enumerate(zip(step_rows, leases, strict=True)):
            pinned = client.leased(lease, NAMESPACE) if lease is not None else None
            if pinned is not None and pinned.num_blocks == row.lookup_n:
                pins[i] = pinned
                continue
            if pinned is not None:
                pinned.release()
            elif lease is not None:
                client.release_lease(lease, namespace=NAMESPACE, all_holders=False)
            if row.lookup_n:
                promote.append(i)
        if promote:
            answers = client.pin_many(NAMESPACE, [batch[i].hashes[: step_rows[i].lookup_n] for i in promote])
            for i, answer in zip(promote, answers, strict=True):
                if isinstance(answer, Exception):
                    failed[f"PinMany: {type(answer).__name__}"] += 1
                else:
                    pins[i] = answer
        for pinned, req, row in zip(pins, batch, step_rows, strict=True):
            if pinned is None:
                continue
            # copied out and verified as select does it (the client's ArenaSource), the pin
            # then ended; one that fails its checksum or outlives its lease loads nothing
            stream = LayerStream(ArenaSource(pinned, req.hashes), source.into, via="arena")
            try:
                stream.read_all()
            except (LocalDataCorrupt, StoreTimeout) as exc:
                failed[f"load: {type(exc).__name__}"] += 1
            else:
                row.loaded = stream.num_blocks
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reserved = (reserving.result() if reserving is not None else client.reserve_many(NAMESPACE, chains, specs)
                    ) if chains else []  # fmt: skip
        commits = []
        for i, answer in zip(saving, reserved, strict=True):
            if isinstance(answer, Exception):
                failed[f"ReserveMany: {type(answer).__name__}"] += 1
                continue
            lacked = answer.blocks  # the chain's blocks the store lacks: usually all, in order
            whole = lacked == list(range(len(lacked)))
            for layer, tensor in enumerate(source.layers.values()):
                answer.layer(layer).copy_(tensor[: len(lacked)] if whole else tensor[lacked])
            commits.append((step_rows[i], answer))
        if committing is not None:  # one CommitMany in flight, as the connector's one sender thread
            committed(committing[0].result(), committing[1])
            committing = None
        if commits:
            commit_many = client.commit_many
            if sender is None:
                committed(commit_many([(res, None, XXH3) for _, res in commits]), commits)
            else:
                committing = (sender.submit(commit_many, [(res, None, XXH3) for _, res in commits]), commits)
        put_s = time.perf_counter() - t0
        loaded = sum(row.loaded for row in step_rows)
        saved = sum(len(req.hashes) - row.lookup_n for req, row in zip(batch, step_rows, strict=True))
        for req, row in zip(batch, step_rows, strict=True):
            row.load_s = load_s * row.loaded / loaded if loaded else 0.0
            row.put_s = put_s * (len(req.hashes) - row.lookup_n) / saved if saved else 0.0
            row.tokens_hit = req.tokens(row.loaded, block_tokens)
        rows.extend(step_rows)
        now = time.perf_counter()
        if now - last_print >= progress_s:
            last_print = now
            hit = sum(r.loaded for r in rows) / max(1, sum(r.blocks for r in rows))
            print(f"    {len(rows)}/{len(requests)} requests in {now - started:.0f} s, prefix hits "
                  f"{100 * hit:.1f}%", flush=True)  # fmt: skip
    if committing is not None:
        committed(committing[0].result(), committing[1])
    for pool in (opener, sender):
        if pool is not None:
            pool.shutdown()
    if failed:
        print("  answers that were errors (their blocks neither loaded nor saved): "
              + ", ".join(f"{what} x{n}" for what, n in failed.most_common()), flush=True)  # fmt: skip
    return rows


def log_summary(path: Path, top: int = 6) -> list[str]:
    """The daemon's WARNING and ERROR lines, counted by message (numbers as N)."""
    import re

    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if " WARNING " in line or " ERROR " in line:
            message = re.sub(r"\d+", "N", line.split(" WARNING ", 1)[-1].split(" ERROR ", 1)[-1])
            counts[message] = counts.get(message, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
    return [f"{n:>6} x {message[:160]}" for message, n in ranked]


def wait_written_behind(client: Any, deadline_s: float = 600.0) -> float:
    """Seconds until the daemon's write-behind backlog is empty."""
    t0 = time.perf_counter()
    end = time.monotonic() + deadline_s
    while client.stats()["write_behind_blocks"] and time.monotonic() < end:
        time.sleep(0.05)
    return time.perf_counter() - t0


def large_requests(
    client: Any, source: Source, blocks: int, block_bytes: int, repeat: int
) -> tuple[float, float]:
    """GB/s of one put and one select of `blocks` blocks through the arena (best of `repeat`),
    with write-behind idle before each; the blocks stay in the memory tier for the select."""
    layers = source.first(blocks)
    nbytes = blocks * block_bytes
    best_put = best_get = 0.0
    for i in range(repeat):
        hashes = [os.urandom(32) for _ in range(blocks)]
        ns = f"large-{i}"
        wait_written_behind(client)
        t0 = time.perf_counter()
        res = client.put(ns, hashes, layers)
        put_s = time.perf_counter() - t0
        if res.blocks_written != blocks:
            raise RuntimeError(f"the large put wrote {res.blocks_written}/{blocks} blocks")
        wait_written_behind(client)
        before = client.stats()["persistent_hit_blocks"]
        t0 = time.perf_counter()
        got = client.get_stream(ns, hashes, allocate=source.into)
        got.read_all()
        get_s = time.perf_counter() - t0
        if got.num_blocks != blocks:
            raise RuntimeError(f"the large select returned {got.num_blocks}/{blocks} blocks")
        promoted = client.stats()["persistent_hit_blocks"] - before
        print(
            f"    large put {format_size(nbytes)}: {put_s * 1e3:7.1f} ms {nbytes / put_s / GB:5.2f} GB/s; "
            f"select {get_s * 1e3:7.1f} ms {nbytes / get_s / GB:5.2f} GB/s"
            + (f" ({promoted} blocks promoted from the persistent tier)" if promoted else ""),
            flush=True,
        )
        best_put, best_get = max(best_put, nbytes / put_s), max(best_get, nbytes / get_s)
        client.evict(namespace=ns)
    return best_put / GB, best_get / GB


# ---------------------------------------------------------------------------- report
def persistent_bytes(capacity: int) -> int:
    """The payload bytes the LMDB tier's segments hold of `capacity` (the rest is its index's)."""
    from kvstore_server.tiers.lmdb import index_reserve

    return capacity - index_reserve(capacity)


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b); (mean y, 0) when x does not vary."""
    if len(xs) < 2 or min(xs) == max(xs):
        return (statistics.fmean(ys) if ys else 0.0), 0.0
    b, a = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(a), float(b)


def pct(a: float, b: float) -> str:
    return f"{100 * a / b:5.1f}%" if b else "    -"


def report(
    args: argparse.Namespace,
    rows: list[Row],
    sims: dict[str, tuple[int, int | None]],
    stats: dict[str, Any],
    large: tuple[float, float],
    replay_s: float,
    cpu: str,
    handlers: dict[str, tuple[float, float]],
) -> list[str]:
    bb = args.block_bytes
    out: list[str] = []

    def say(line: str = "") -> None:
        out.append(line)

    requested = sum(r.blocks for r in rows)
    loaded = sum(r.loaded for r in rows)
    looked = sum(r.lookup_n for r in rows)
    say(f"== prefix hits: blocks loaded / blocks requested ({len(rows)} requests, {requested} blocks)")
    say(f"  {'daemon (memory + persistent tier)':<44} {loaded:>8} {pct(loaded, requested)}")
    if looked != loaded:
        say(f"  {'  of which lookup counted':<44} {looked:>8} {pct(looked, requested)}")
    for name, (hits, cap) in sims.items():
        what = f"{name}" + (f" ({cap} blocks)" if cap is not None else "")
        say(f"  {what:<44} {hits:>8} {pct(hits, requested)}   daemon = {pct(loaded, hits).strip()} of it")

    mem, per = stats["memory_hit_blocks"], stats["persistent_hit_blocks"]
    say()
    say("== bytes served per tier (daemon stats)")
    say(f"  memory tier      {mem:>8} blocks {mem * bb / GB:7.2f} GB  {pct(mem, mem + per)}")
    say(
        f"  persistent tier  {per:>8} blocks {per * bb / GB:7.2f} GB  {pct(per, mem + per)}   "
        f"promoted_bytes {stats['promoted_bytes'] / GB:.2f} GB, persistent_read_rate "
        f"{stats['persistent_read_rate'] / GB:.2f} GB/s"
    )
    say(
        f"  stored: {sum(r.put for r in rows)} blocks put ({stats['commits']} arena commits, "
        f"{stats['puts'] - stats['commits']} over gRPC); written behind {stats['written_behind']} blocks "
        f"({stats['written_behind_bytes'] / GB:.2f} GB, write_behind_rate "
        f"{stats['write_behind_rate'] / GB:.2f} GB/s), dropped {stats['write_behind_dropped']}; "
        f"evictions: store {stats['evictions']}, memory tier {stats['memory_evictions']}"
    )

    segments = persistent_bytes(args.capacity_bytes)
    say(
        f"  capacity: --capacity {format_size(args.capacity_bytes)}, of which the persistent tier's "
        f"segments hold {format_size(segments)} = {segments // bb} blocks (less the index reserve); "
        f"bytes_used at the end {format_size(stats['bytes_used'])}, {stats['memory_only_blocks']} blocks "
        f"in memory only"
    )

    rate = args.recompute_tokens_per_s
    hot = [r for r in rows if r.loaded and not r.persistent_hits]
    cold = [r for r in rows if r.loaded and r.persistent_hits]
    say()
    say(f"== GPU time saved: tokens hit / {rate:.0f} tokens/s - measured load time")
    say(
        f"  {'loads':<30} {'reqs':>5} {'blocks':>7} {'tokens':>9} {'recompute s':>11} "
        f"{'load s':>8} {'saved s':>8} {'load/recompute':>14}"
    )
    for name, group in (
        ("memory tier only", hot),
        ("with persistent-tier blocks", cold),
        ("all", hot + cold),
    ):
        tokens = sum(r.tokens_hit for r in group)
        recompute = tokens / rate
        load = sum(r.load_s for r in group)
        say(
            f"  {name:<30} {len(group):>5} {sum(r.loaded for r in group):>7} {tokens:>9} "
            f"{recompute:>11.2f} {load:>8.2f} {recompute - load:>8.2f} {pct(load, recompute):>14}"
        )
    # per-tier cost per block: memory-only loads give the memory tier's fixed + per-block cost;
    # the rest of a promoting load's time, per promoted block, is the persistent tier's
    a_m, b_m = fit([r.loaded for r in hot], [r.load_s for r in hot])
    extra = [(r.load_s - a_m - b_m * r.memory_hits) / r.persistent_hits for r in cold if r.persistent_hits]
    per_block_recompute = args.block_tokens / rate
    b_per = statistics.median(extra) if extra else 0.0
    say(
        f"  per block ({format_size(bb)} of KV for {args.block_tokens} tokens, recompute "
        f"{per_block_recompute * 1e3:.2f} ms): memory tier {b_m * 1e6:.0f} us + {a_m * 1e3:.2f} ms per "
        f"request (fit); persistent tier {b_per * 1e6:.0f} us more (median of {len(extra)} promoting loads)"
    )
    scale = args.real_block_bytes / bb
    say(
        f"  at {format_size(args.real_block_bytes)} of KV per block (--real-block-bytes), these per-byte "
        f"rates ({bb / b_m / GB if b_m > 0 else 0:.2f} and {bb / b_per / GB if b_per > 0 else 0:.2f} GB/s) would "
        f"take {b_m * scale * 1e3:.1f} ms (memory) and {b_per * scale * 1e3:.1f} ms (persistent) per block "
        f"against {per_block_recompute * 1e3:.2f} ms of recompute"
    )

    moved_load = loaded * bb
    moved_put = sum(r.put for r in rows) * bb
    lookup_s = sum(r.lookup_s for r in rows)
    load_s = sum(r.load_s for r in rows)
    put_s = sum(r.put_s for r in rows)
    busy = lookup_s + load_s + put_s
    puts = [r for r in rows if r.put]
    a_p, b_p = fit([r.put for r in puts], [r.put_s for r in puts])
    hot_bytes = sum(r.loaded for r in hot) * bb
    hot_s = sum(r.load_s for r in hot)
    large_put, large_get = large
    lookups = sorted(r.lookup_s for r in rows)
    say()
    say("== the client's cost per request (time inside lookup + select + put)")
    say(
        f"  {len(rows) / busy:7.1f} requests/s  {(loaded + sum(r.put for r in rows)) / busy:8.0f} blocks/s  "
        f"{(moved_load + moved_put) / busy / GB:5.2f} GB/s   ({busy:.1f} s of {replay_s:.1f} s replay; "
        f"cpu {cpu})"
    )
    say(
        f"  lookup  {len(rows):>5} calls  p50 {lookups[len(lookups) // 2] * 1e3:6.2f} ms  "
        f"mean {lookup_s / len(rows) * 1e3:6.2f} ms"
    )
    say(
        f"  select  {sum(1 for r in rows if r.lookup_n):>5} calls  {moved_load / GB:6.2f} GB in "
        f"{load_s:6.1f} s {moved_load / load_s / GB if load_s else 0:5.2f} GB/s; memory tier only "
        f"{hot_bytes / hot_s / GB if hot_s else 0:5.2f} GB/s = {pct(hot_bytes / hot_s / GB if hot_s else 0, large_get)} "
        f"of one large select ({large_get:.2f} GB/s); fit {a_m * 1e3:.2f} ms + {b_m * 1e6:.0f} us/block"
    )
    say(
        f"  put     {len(puts):>5} calls  {moved_put / GB:6.2f} GB in {put_s:6.1f} s "
        f"{moved_put / put_s / GB if put_s else 0:5.2f} GB/s = {pct(moved_put / put_s / GB if put_s else 0, large_put)} "
        f"of one large put ({large_put:.2f} GB/s); fit {a_p * 1e3:.2f} ms + {b_p * 1e6:.0f} us/block"
    )
    all_large = (
        (moved_load + moved_put) / (moved_load / large_get + moved_put / large_put) if large_get else 0
    )
    if args.step > 1 and args.overlap:
        say("  (put: what the step waited for, the reservation made as its loads ran, the copies, the "
            "previous step's commit; its own CommitMany went on a sender thread, as the connector's does)")  # fmt: skip
    say(
        f"  overall {(moved_load + moved_put) / replay_s / GB:5.2f} GB/s over the replay's wall time = "
        f"{pct((moved_load + moved_put) / replay_s / GB, all_large)} of the same bytes in large requests "
        f"({all_large:.2f} GB/s; goal >= 50%)"
    )
    busiest = sorted(((s, c, m) for m, (c, s) in handlers.items() if c), reverse=True)
    say(
        "  the daemon's handlers over the replay (calls, mean ms, total s): "
        + "; ".join(f"{m} {c:.0f} x {1e3 * s / c:.2f} = {s:.2f}" for s, c, m in busiest)
    )
    return out


# ---------------------------------------------------------------------------- main
def since(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """Each method's (calls, seconds) in the daemon's handlers between two readings."""
    return {
        m: (c - before.get(m, (0, 0.0))[0], s - before.get(m, (0, 0.0))[1]) for m, (c, s) in after.items()
    }


def size_or_share(text: str, footprint: int) -> int:
    """'10%' of the footprint, or a size ('256MiB')."""
    if text.endswith("%"):
        return int(footprint * float(text[:-1]) / 100)
    return parse_size(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"JSONL trace (default {DEFAULT_TRACE})")
    p.add_argument("--requests", type=int, default=None, help="replay the first N requests (default: all)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (512)")
    p.add_argument("--block-bytes", type=parse_size, default="64KiB", help="KV bytes per block, all layers")
    p.add_argument("--layers", type=int, default=8, help="bf16 layers per block (8)")
    p.add_argument("--memory", default="10%", help="memory tier: a size or a %% of the footprint (10%%)")
    p.add_argument(
        "--capacity", default="50%", help="persistent tier: a size or a %% of the footprint (50%%)"
    )
    p.add_argument("--recompute-tokens-per-s", type=float, default=33000.0, help="prefill rate (33000)")
    p.add_argument(
        "--real-block-bytes",
        type=parse_size,
        default="64MiB",
        help="the unscaled KV of a block, for the projection (64MiB: Llama-3.1-8B, 512 tokens, bf16)",
    )
    p.add_argument("--large-bytes", type=parse_size, default="128MiB", help="the large put/select (128MiB)")
    p.add_argument("--large-repeat", type=int, default=3)
    p.add_argument("--data-root", default=None, help="where the daemon's data dir goes ($TMPDIR)")
    p.add_argument("--no-control-socket", dest="control_socket", action="store_false",
                   help="every call over gRPC, not the daemon's control socket (to compare)")  # fmt: skip
    p.add_argument("--memory-root", default="/dev/shm", help="a tmpfs; the arena goes in a private dir there")
    p.add_argument("--step", type=int, default=1,
                   help="requests per engine step: >1 replays them as the connector batches a step's loads "
                        "and saves (leasing lookups, PinMany, ReserveMany, CommitMany)")  # fmt: skip
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="with --step: wait for each step's ReserveMany and CommitMany in turn, not "
                        "reserve as the loads run and commit on a sender thread as the connector does")  # fmt: skip
    p.add_argument("--progress", type=float, default=15.0, help="seconds between progress lines")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra daemon argument (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvstore.memory import populate_mapping, tune_malloc
    from kvstore_client import KVStoreClient

    args = parse_args(argv)
    tune_malloc()  # as the connector does in a vLLM worker
    # the client's copies on one thread: torch's OpenMP workers spin between copies and took
    # the daemon's core on the 2-core VM (client CPU 17.1 s against 6.6 s, same replay)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    if args.block_bytes % args.layers:
        raise SystemExit("--block-bytes must be a multiple of --layers")
    requests = read_trace(args.trace, args.requests)
    chain_hashes(requests, NAMESPACE)
    distinct = len({h for r in requests for h in r.hashes})
    footprint = distinct * args.block_bytes
    memory = size_or_share(args.memory, footprint)
    capacity = args.capacity_bytes = size_or_share(args.capacity, footprint)
    refs = sum(len(r.hashes) for r in requests)
    print(
        f"trace {args.trace}: {len(requests)} requests, {refs} block references, {distinct} distinct "
        f"blocks = {format_size(footprint)} at {format_size(args.block_bytes)} per {args.block_tokens}-token "
        f"block ({args.layers} layers); memory tier {format_size(memory)}, persistent tier "
        f"{format_size(capacity)}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    source = Source(args.layers, args.block_bytes, max(max(len(r.hashes) for r in requests), 1))
    root = Path(tempfile.mkdtemp(prefix="kvstore-trace-", dir=args.data_root))
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-trace-", dir=args.memory_root))
    daemon = Daemon(
        root / "data",  # its log: root / "data.log"
        capacity=str(capacity),
        memory_size=str(memory),
        memory_dir=memory_dir,
        extra_args=["--log-level", "WARNING", "--metrics-port", "0", *args.daemon_arg],
    )
    try:
        daemon.start()
        print(f"  {daemon.ready_line}", flush=True)
        with KVStoreClient(daemon.address, timeout=120.0, control_socket=args.control_socket) as client:
            if not client.arena_available():
                raise SystemExit("the client could not map the daemon's arena")
            mapping = client.arena_mapping()
            if mapping is not None:  # as the connector's worker does (host_memory), here before timing
                t0 = time.perf_counter()
                faulted = populate_mapping(mapping.tensor().data_ptr(), mapping.size)
                print(f"  the arena's {format_size(mapping.size)} pre-faulted in this process: {faulted}, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
            stats = client.stats()
            # in blocks: what the persistent tier's segments hold (the store's budget), and the arena
            cap_blocks = persistent_bytes(capacity) // args.block_bytes
            mem_blocks = stats["memory_capacity_bytes"] // args.block_bytes
            sims = {
                "infinite cache": (simulate(requests, None), None),
                "LRU, memory + persistent": (
                    simulate(requests, cap_blocks + mem_blocks),
                    cap_blocks + mem_blocks,
                ),
                "LRU, persistent alone": (simulate(requests, cap_blocks), cap_blocks),
            }
            print(f"  simulated: {', '.join(f'{k} {v[0]}' for k, v in sims.items())} blocks hit", flush=True)
            how = f", {args.step} per engine step (as the connector batches them)" if args.step > 1 else ""
            print(f"[replay: {len(requests)} requests{how}]", flush=True)
            cpu = Cpu({"daemon": daemon.proc.pid, "client": os.getpid()})
            handlers = handler_seconds(daemon.metrics_url)
            t0 = time.perf_counter()
            if args.step > 1:
                rows = replay_steps(
                    client, requests, source, args.step, args.block_tokens, args.progress, args.overlap
                )
            else:
                rows = replay(client, requests, source, args.block_tokens, args.progress)
            replay_s = time.perf_counter() - t0
            cpu_line = cpu.end()
            handlers = since(handlers, handler_seconds(daemon.metrics_url))
            drain = wait_written_behind(client)
            stats = client.stats()
            print(f"  replay done in {replay_s:.1f} s; write-behind drained {drain:.1f} s later", flush=True)
            large_blocks = max(
                1, min(args.large_bytes, stats["memory_capacity_bytes"] // 2) // args.block_bytes
            )
            print(f"[large requests: {large_blocks} blocks, one put and one select]", flush=True)
            big = Source(args.layers, args.block_bytes, large_blocks)
            large = large_requests(client, big, large_blocks, args.block_bytes, args.large_repeat)
        daemon.stop()
        warnings = log_summary(root / "data.log")
    finally:
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory_dir, ignore_errors=True)
    lines = report(args, rows, sims, stats, large, replay_s, cpu_line, handlers)
    if warnings:
        lines += ["", "== the daemon's log: WARNING / ERROR lines by message", *[f"  {w}" for w in warnings]]
    print()
    print("\n".join(lines))
    print(f"(bench wall time {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

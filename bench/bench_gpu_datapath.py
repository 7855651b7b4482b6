"""The connector's GPU data path for one request shaped like Llama-3.1-8B (run on a GPU host).

    python bench/bench_gpu_datapath.py [--tokens 2048,8192] [--block-sizes 16,32] [--repeat 5]
        [--memory 40GiB] [--cold-repeat 3] [--disk-repeat 2] [--no-daemon] [--no-legacy] [--no-recompute]
        [--profile]

Shape: 32 layers, 8 KV heads, head dim 128, bf16, the paged view per layer
[num_blocks, 8, block_size, 256]: 2048 tokens = 268 MB of KV, 8192 = 1074 MB.
For each token count and block size, in one run:

(a) ceilings: one plain pinned D2H / H2D copy of the same bytes; one indexed copy
    per layer into / out of a cudaHostRegister'd mapping of a /dev/shm file (what
    the arena is): `index_select` + D2H (gather ceiling), H2D + `index_copy_`
    (scatter ceiling); and BlockMover.gather / scatter over pinned buffers;
(arena) saves and loads through the connector's ArenaTransport and a daemon this
    bench starts (--memory arena under a private /dev/shm folder): save = reserve,
    32 x save_layer, commit (checksums + Commit RPC); hot load = pin, per group of
    layers H2D + check on the GPU + scatter, events done, release; cold load = the same after the
    daemon was killed (-9), its arena file deleted and restarted, so the Pin RPC
    promotes the blocks from LMDB: first with LMDB's file in the page cache, then
    (where /proc/sys/vm/drop_caches can be written) read from the disk; with
    --prefetch-repeat N, N more from the page cache each prefetched by a Lookup
    --prefetch-gap-ms before the load (the connector's scheduler side asks a step ahead);
(b) the older paths: put_stream over gRPC, get_stream over gRPC and the same-host
    LMDB reads (first block size only);
(recompute) one prefill (use_cache=True, logits of the last token) of a random-weight
    Llama-3.1-8B in transformers (sdpa, bf16, batch 1) at each token count.

Each timed daemon operation starts with the daemon's write-behind idle (the bench
waits for it; the time it takes is printed as a write-behind rate). Medians of
--repeat runs after a warm-up; the split rows are medians of each part on its
own, so they need not add up to the median total exactly. The hot part and the
cold part run in child processes (each maps the arena once), the recompute in
this process once the daemon is gone. Prints figures only; never pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for sub in ("", "connector"):
    sys.path.insert(0, str(ROOT / sub))

from kvstore_connector.host_memory import prepare_arena  # noqa: E402
from kvstore_connector.transfer import BlockMover  # noqa: E402
from store_harness import drop_page_cache, fs_of, handler_seconds  # noqa: E402  (bench/, this script's directory)

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
NAMESPACE = b"bench"
now = time.perf_counter


@dataclass
class Spec:
    """Stand-in for kvstore_connector.metadata's SaveSpec/LoadSpec (that module imports vLLM)."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    parent_hash: bytes = b""
    token_ids: list[int] = field(default_factory=list)
    lease: Any = None  # LoadSpec's


try:
    from kvstore_connector.metadata import LoadSpec, SaveSpec
except ImportError:  # no vLLM here: same fields
    LoadSpec = SaveSpec = Spec  # type: ignore[misc,assignment]


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Device:
    def __init__(self, name: str) -> None:
        self.dev = torch.device(name)
        self.cuda = self.dev.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any], repeat: int) -> float:
        fn()  # warm-up: allocator caches, pinned pools, kernels
        self.sync()
        runs = []
        for _ in range(repeat):
            start = now()
            fn()
            self.sync()
            runs.append(now() - start)
        return med(runs)


def seed_tokens(kind: str, bs: int, tokens: int, i: int) -> list[int]:
    """Distinct, reproducible prompts: the cold child re-derives the hashes the hot child saved."""
    kinds = {"hot": 1, "cold": 2, "legacy": 3}
    return [(kinds[kind] * 1000 + bs) * 10**6 + tokens * 100 + i] * tokens


def hashes_for(kind: str, bs: int, tokens: int, i: int) -> list[bytes]:
    from kvstore_client.hashing import block_hashes

    return block_hashes(NAMESPACE, seed_tokens(kind, bs, tokens, i), bs)


def kv_bytes(tokens: int, bs: int) -> int:
    return LAYERS * (tokens // bs) * KV_HEADS * bs * 2 * HEAD_DIM * 2


class Row:
    """Prints `name  ms  GB/s  note` lines."""

    def __init__(self, nbytes: int) -> None:
        self.gb = nbytes / 1e9

    def __call__(
        self, name: str, seconds: float, note: str = "", *, indent: int = 2, rate: bool = True
    ) -> None:
        speed = f"{self.gb / seconds:7.2f} GB/s" if rate and seconds > 0 else " " * 12
        print(f"{' ' * indent}{name:<{60 - indent}}{seconds * 1e3:9.2f} ms {speed}  {note}".rstrip())


def part(name: str, seconds: float, total: float) -> None:
    print(f"      {name:<54}{seconds * 1e3:9.2f} ms {seconds / total * 100:5.0f}% of the total")


# ---- instrumentation of the client (bench only) ---------------------------------------
class Probe:
    """Times each arena RPC and each checksum batch (xxh3 on the client's threads)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def add(self, what: str, start: float) -> None:
        self.events.append((what, start, now()))

    def reset(self) -> None:
        self.events = []

    def total(self, what: str) -> float:
        return sum(end - start for w, start, end in self.events if w == what)

    def span(self, what: str) -> tuple[float, float]:
        got = [(s, e) for w, s, e in self.events if w == what]
        return (got[0][0], got[-1][1]) if got else (float("nan"), float("nan"))


def timed(probe: Probe, what: str, plain: Callable[..., Any]) -> Callable[..., Any]:
    """`plain`, each call's span added to `probe` as `what` (marked: not wrapped twice)."""

    def call(*args: Any, **kw: Any) -> Any:
        start = now()
        try:
            return plain(*args, **kw)
        finally:
            probe.add(what, start)

    call._bench = True  # type: ignore[attr-defined]
    return call


def instrument(client: Any, probe: Probe) -> None:
    import kvstore_client.arena.load as arena_load
    import kvstore_client.arena.save as arena_save

    arena = client._arena
    call = arena._call

    class FirstTimed:
        """A PinStream whose first message (the pin's answer) is timed as the Pin RPC, and
        each later one (a report of blocks read) as "Ready", from the same start."""

        def __init__(self, stream: Any, start: float) -> None:
            self.stream, self.start, self.answered = stream, start, False

        def __iter__(self) -> Any:
            return self

        def __next__(self) -> Any:
            try:
                message = next(self.stream)
            except BaseException:
                if not self.answered:
                    probe.add("Pin", self.start)
                raise
            probe.add("Ready" if self.answered else "Pin", self.start)
            self.answered = True
            return message

        def cancel(self) -> None:
            self.stream.cancel()

        def finish(self) -> None:
            self.stream.finish()

    def timed_call(method: str, request: Any, timeout: float | None = None, **kw: Any) -> Any:
        start = now()
        if method == "PinStream":
            return FirstTimed(call(method, request, timeout, **kw), start)
        try:
            return call(method, request, timeout, **kw)
        finally:
            probe.add(method, start)

    arena._call = timed_call  # Reservation / Pinned take the arena's call when made
    # the save and load sides each look checksums up in their own module
    for side in (arena_save, arena_load):
        if not getattr(side.checksums, "_bench", False):
            side.checksums = timed(probe, "xxh3", side.checksums)


# ---- a registered /dev/shm mapping (what the arena is), for the ceilings ----------------
@contextlib.contextmanager
def shm_mapping(nbytes: int, cuda: bool) -> Iterator[torch.Tensor]:
    path = Path("/dev/shm") / f"kvstore-bench-ceiling-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mm, dtype=torch.uint8)
    tensor.fill_(0)  # fault the pages in, as the daemon pre-faults its arena
    registered = False
    if cuda:
        start = now()
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        registered = int(err) == 0
        print(f"  ceiling buffer: {nbytes / 1e9:.2f} GB in {path}, cudaHostRegister "
              f"{'ok' if registered else f'FAILED ({err})'} in {now() - start:.2f}s")  # fmt: skip
    try:
        yield tensor
    finally:
        if registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        del tensor
        gc.collect()
        with contextlib.suppress(BufferError):
            mm.close()
        path.unlink(missing_ok=True)


def layer_views(buf: torch.Tensor, n: int, per_block: tuple[int, ...]) -> list[torch.Tensor]:
    size = n * KV_HEADS * per_block[1] * per_block[2] * 2
    return [buf[i * size : (i + 1) * size].view(torch.bfloat16).view(n, *per_block) for i in range(LAYERS)]


# ---- the hot child: ceilings, arena saves and hot loads, legacy paths ------------------
def make_caches(d: Device, bs: int, pool_tokens: int) -> dict[str, torch.Tensor]:
    pool = pool_tokens // bs
    gen = torch.Generator(device=d.dev).manual_seed(bs)
    return {
        n: torch.randn((pool, KV_HEADS, bs, 2 * HEAD_DIM), dtype=torch.bfloat16, device=d.dev, generator=gen)
        for n in NAMES
    }


def block_ids_for(pool: int, n: int, seed: int) -> list[int]:
    return torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:n].tolist()


class Daemonside:
    """The parent's view of the daemon (stats over gRPC, no arena)."""

    def __init__(self, address: str, metrics_url: str = "") -> None:
        from kvstore_client import KVStoreClient

        self.kv = KVStoreClient(address, timeout=30, arena=False)
        self.metrics_url = metrics_url

    def server_time(self) -> dict[str, tuple[float, float]]:
        """Each method's (calls, seconds) in the daemon so far: its handlers' own time
        (kvstore_rpc_duration_seconds), without the transport or the client's."""
        return handler_seconds(self.metrics_url) if self.metrics_url else {}

    def quiesce(self, limit: float = 120.0) -> float:
        """Wait until nothing waits for write-behind; the seconds it took."""
        start = now()
        while now() - start < limit:
            if not self.kv.stats()["write_behind_blocks"]:
                return now() - start
            time.sleep(0.005)
        print(f"  NOTE: write-behind still busy after {limit:.0f}s")
        return now() - start

    def close(self) -> None:
        self.kv.close()


def arena_save(transport: Any, probe: Probe, d: Device, caches: dict, hashes: list, block_ids: list) -> dict:
    spec = SaveSpec("bench", hashes, block_ids, b"")
    d.sync()
    probe.reset()
    t0 = now()
    save = transport.open(spec)  # raises when the arena is off (the bench's transport has no fallback)
    if save is None:
        raise RuntimeError("ArenaTransport.open dropped the save")
    t1 = now()
    layout = LAYOUTS.get(id(transport))
    for name in NAMES:
        if layout is None:  # --layout layers: a store layer per attention layer
            transport.save_layer([save], [name], None)
        else:  # the connector's: a store layer per KV head, a layer's heads in one copy
            transport.save_layer([save], layout.by_layer[name], layout.heads[name])
    t2 = now()
    save.wait()
    t3 = now()
    result = transport.commit(save)
    t4 = now()
    if result is None or result.blocks_written != len(hashes):
        raise RuntimeError(f"arena save wrote {result} of {len(hashes)} blocks")
    return {
        "total": t4 - t0,
        "reserve_rpc": probe.total("Reserve"),
        "open_other": (t1 - t0) - probe.total("Reserve"),
        "issue": t2 - t1,
        "copies": t3 - t2,
        "xxh3": probe.total("xxh3"),
        "commit_rpc": probe.total("Commit"),
        "commit_other": (t4 - t3) - probe.total("xxh3") - probe.total("Commit"),
    }


def arena_load(
    transport: Any, probe: Probe, d: Device, hashes: list, block_ids: list, *, leased: bool = False
) -> dict:
    """One load, split. `leased`: as the connector loads after its scheduler side's lookup
    leased the blocks: the Lookup (timed apart, as "lookup_rpc": the scheduler's, a step
    ahead) then the load from its lease, with no pin RPC."""
    lookup = 0.0
    lease = None
    if leased:
        t = now()
        lease = transport.client.where(transport.namespace, hashes, lease_from=0).lease
        lookup = now() - t
        if lease is None or lease.num_blocks != len(hashes):
            raise RuntimeError(
                f"the lookup leased {lease.num_blocks if lease else 0} of {len(hashes)} blocks"
            )
    spec = LoadSpec("bench", hashes, block_ids, lease=lease)
    pending = list(transport.caches)  # the store layers
    issued: list[float] = []
    events: list[Any] = []

    def done(name: str, event: Any) -> None:
        # as the worker's layer gates do: note the event; the compute stream waits on it
        # on the forward thread (wait_for_layer), not on the loader thread
        if not events or event is not events[-1]:  # a group's layers share its event: marked once
            GPU_MARKS.mark("scattered", transport.mover._scatter_stream)
        issued.append(now())
        events.append(event)

    d.sync()
    probe.reset()
    GPU_MARKS.reset(transport.mover.cuda)
    t0 = now()
    pinned = transport.leased(spec) if leased else None
    if leased and pinned is None:
        raise RuntimeError("the transport could not load from the lease")
    n = transport.load(spec, pending, done, 60, pinned)
    t1 = now()
    for event in events:
        transport.mover.wait_on_compute_stream(event)
    d.sync()
    if n != len(hashes):
        raise RuntimeError(f"arena load got {n} of {len(hashes)} blocks")
    pin_end = t0 if leased else probe.span("Pin")[1]
    release_start = probe.span("Release")[0]
    verify = probe.total("xxh3")
    ready = [end for what, _, end in probe.events if what == "Ready"]
    stages = [end for what, _, end in probe.events if what == "Stage"]
    staged = [end for what, _, end in probe.events if what == "Staged"]
    timeline = {}
    if ready and staged:  # a cold load: what follows the daemon's last report
        timeline = {
            "t_last_ready": ready[-1] - t0,
            "t_ranges": float(len(stages)),
            "t_first_stage": (stages[0] - t0) if stages else 0.0,
            "t_staged": staged[-1] - t0,
            "t_first_done": issued[0] - t0,
            "t_last_done": issued[-1] - t0,
            "t_end": t1 - t0,
        }
        for what in ("landed", "checked", "scattered"):  # on the GPU (None on CPU)
            at = GPU_MARKS.last(what)
            if at is not None:
                timeline[f"gpu_{what}"] = at
    return {
        **timeline,
        "total": t1 - t0,
        # the daemon's reports of blocks read (cold loads): the first after the pin's
        # answer, the last (everything read) after the pin was sent
        "first_ready": (ready[0] - pin_end) if ready else 0.0,
        "last_ready": (ready[-1] - t0) if ready else 0.0,
        "lookup_rpc": lookup,
        "pin_rpc": probe.total("Pin"),
        "verify": verify,
        "issue": (issued[-1] - pin_end) - verify,
        "copies": release_start - issued[-1],
        "release_rpc": probe.total("Release"),
        "other": (t1 - t0) - (probe.total("Pin") + (issued[-1] - pin_end) + (release_start - issued[-1])
                              + probe.total("Release")),
    }  # fmt: skip


class GpuMarks:
    """When the GPU got there, for the cold loads' timeline: a timing event on the copy
    stream after each range's copy (landed), on the check stream after a run's checks, and
    on the scatter stream after each group's scatters; read as ms from `start` once the
    device is synchronised. Nothing on CPU, nor in the hot part (no timing events in the
    loads it times): on once instrument_transport ran (the cold child)."""

    def __init__(self) -> None:
        self.on = False
        self.start: Any = None
        self.marks: list[tuple[str, Any]] = []

    def reset(self, cuda: bool) -> None:
        self.marks = []
        self.start = None
        if cuda and self.on:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def mark(self, what: str, stream: Any) -> None:
        if self.start is not None and stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.marks.append((what, event))

    def last(self, what: str) -> float | None:
        """Seconds from the start to the last `what` (after the device synchronised)."""
        got = [event for w, event in self.marks if w == what]
        return self.start.elapsed_time(got[-1]) / 1e3 if got else None


GPU_MARKS = GpuMarks()


def instrument_transport(transport: Any, probe: Probe) -> None:
    """Time each copy of a promotion's range of blocks to the device ("Stage": issued, not
    landed) and the end of a run's staging ("Staged"), for the cold loads' timeline; and
    when the GPU ran them (GPU_MARKS)."""
    mover = transport.mover
    stage_into, stage_blocks = mover.stage_into, transport._stage_blocks
    GPU_MARKS.on = True

    def staged_into(*args: Any, **kw: Any) -> Any:
        try:
            return stage_into(*args, **kw)
        finally:
            GPU_MARKS.mark("landed", mover._stream)

    def staged_blocks(*args: Any, **kw: Any) -> Any:
        try:
            return stage_blocks(*args, **kw)
        finally:
            GPU_MARKS.mark("checked", mover._check_stream)

    mover.stage_into = timed(probe, "Stage", staged_into)
    transport._stage_blocks = timed(probe, "Staged", staged_blocks)


LAYOUTS: dict[int, Any] = {}
"""id(transport) -> its StoreLayout (--layout heads)."""


def build_transport(args: argparse.Namespace, kv: Any, d: Device, caches: dict, bs: int) -> Any:
    """The ArenaTransport the connector would use (--layout heads: kvstore_connector.layout, a
    store layer per KV head; --layout layers: one per attention layer, as before it), with
    --compression's codec on the device."""
    from kvstore_connector.arena_transport import ArenaTransport
    from kvstore_connector.compression import make_codec
    from kvstore_connector.layout import StoreLayout

    from kvstore_client import LayerSpec

    codec = make_codec(args.compression)
    mover = BlockMover(d.dev, codec)
    namespace = NAMESPACE + f"|{args.layout}|{args.compression}".encode()
    if args.layout == "layers":
        if codec is not None:
            raise SystemExit("--compression needs --layout heads")
        specs = [LayerSpec(n, "bfloat16", (KV_HEADS, bs, 2 * HEAD_DIM)) for n in NAMES]
        return ArenaTransport(kv, namespace, specs, caches, mover, reserve_timeout=30)
    layout = StoreLayout.build(caches, num_kv_heads=KV_HEADS, tp_size=1, tp_rank=0, mla=False, codec=codec)
    transport = ArenaTransport(kv, namespace, layout.subset_specs, layout.views, mover, stored=layout.specs,
                               subset=layout.subset, heads=layout.head_targets, reserve_timeout=30)  # fmt: skip
    LAYOUTS[id(transport)] = layout
    return transport


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs that have it (a cold load's timeline: those that
    promoted)."""
    keys = dict.fromkeys(k for r in runs for k in r)
    return {k: med([r[k] for r in runs if k in r]) for k in keys}


SAVE_PARTS = [
    ("reserve RPC", "reserve_rpc"),
    ("open: rest (block ids, the device staging buffer)", "open_other"),
    ("issue 32 x save_layer (gather, D2H; GPU sums per group)", "issue"),
    ("wait for the gathers and D2H copies", "copies"),
    ("checksums on the host (xxh3; 0 when summed on the GPU)", "xxh3"),
    ("commit RPC", "commit_rpc"),
    ("commit: rest (the GPU's sums to the host)", "commit_other"),
]
LOAD_PARTS = [
    ("pin RPC", "pin_rpc"),
    ("verify on the host (xxh3; 0 when checked on the GPU)", "verify"),
    ("H2D + check per group of layers, scatters issued", "issue"),
    ("wait for the copies after the last layer was issued", "copies"),
    ("release (sent in the background when the pin held)", "release_rpc"),
    ("rest", "other"),
]


def print_split(row: Row, title: str, m: dict, parts: list, ceiling: float, ceiling_name: str) -> None:
    row(title, m["total"], f"{ceiling / m['total'] * 100:3.0f}% of the {ceiling_name}")
    for name, key in parts:
        part(name, m[key], m["total"])
    top = max(parts, key=lambda nk: m[nk[1]])
    print(f"      -> most of the time: {top[0]} ({m[top[1]] / m['total'] * 100:.0f}%)")


def hot_child(args: argparse.Namespace) -> None:
    from kvstore_client import KVStoreClient, LayerSpec, tune_malloc

    tune_malloc()  # as the connector does in vLLM's worker process
    d = Device(args.device)
    mover = BlockMover(d.dev)
    side = Daemonside(args.address, args.metrics_url) if args.address else None
    results: dict[str, dict] = {}
    name = torch.cuda.get_device_name() if d.cuda else "cpu"
    print(
        f"{name}; torch {torch.__version__}; {LAYERS} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, bf16"
    )
    kv = probe = transport = None
    if side is not None:
        kv = KVStoreClient(args.address, timeout=60, control_socket=args.control_socket)
        start = now()
        if not prepare_arena(kv, cuda=d.cuda):
            raise SystemExit("the daemon offers no arena to this process")
        print(
            f"  mapped the daemon's arena {kv.arena_path} and registered it with CUDA in {now() - start:.2f}s"
        )
        probe = Probe()
        instrument(kv, probe)
    max_bytes = max(kv_bytes(t, bs) for t in args.tokens for bs in args.block_sizes)
    with shm_mapping(max_bytes, d.cuda) as shm:
        for bi, bs in enumerate(args.block_sizes):
            caches = make_caches(d, bs, args.pool_tokens)
            pool = args.pool_tokens // bs
            per_block = (KV_HEADS, bs, 2 * HEAD_DIM)
            specs = [LayerSpec(n, "bfloat16", per_block) for n in NAMES]
            if kv is not None:
                transport = build_transport(args, kv, d, caches, bs)
            for tokens in args.tokens:
                key = f"{tokens}/{bs}"
                res: dict[str, Any] = {"tokens": tokens, "bs": bs}
                results[key] = res
                nblk = tokens // bs
                nbytes = kv_bytes(tokens, bs)
                res["nbytes"] = nbytes
                block_ids = block_ids_for(pool, nblk, tokens + bs)
                ids = mover.index(block_ids)
                row = Row(nbytes)
                print(f"\n=== {tokens} tokens, block size {bs}: {nblk} blocks x {LAYERS} layers = "
                      f"{nbytes / 1e6:.0f} MB of KV; paged pool {pool} blocks/layer ===")  # fmt: skip
                ceilings(args, d, mover, caches, ids, shm, nblk, per_block, row, res)
                if transport is not None:
                    arena_part(args, d, transport, probe, side, caches, block_ids, ids, bs, tokens, row, res)
                if kv is not None and args.legacy and bi == 0:
                    legacy_part(args, d, mover, caches, ids, specs, side, bs, tokens, row, res)
            del caches, transport
            gc.collect()
            if d.cuda:
                torch.cuda.empty_cache()
    if kv is not None:
        kv.close()
    if side is not None:
        side.close()
    Path(args.results).write_text(json.dumps(results))


def ceilings(args, d: Device, mover, caches, ids, shm, nblk, per_block, row: Row, res: dict) -> None:
    nbytes = res["nbytes"]
    layers = [caches[n] for n in NAMES]
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=d.dev)
    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=d.cuda)
    shm_flat = shm[:nbytes].view(torch.bfloat16)
    shm_layers = layer_views(shm, nblk, per_block)

    def gather_ceiling() -> None:
        for kv, dst in zip(layers, shm_layers, strict=True):
            dst.copy_(kv.index_select(0, ids), non_blocking=True)

    def scatter_ceiling() -> None:
        for kv, src in zip(layers, shm_layers, strict=True):
            kv.index_copy_(0, ids, src.to(d.dev, non_blocking=True))

    saved: list = []

    def connector_gather() -> None:
        saved[:] = [mover.gather(kv, ids) for kv in layers]
        for copy in saved:
            copy.wait()

    def connector_scatter() -> None:
        events = [mover.scatter(kv, ids, copy.host) for kv, copy in zip(layers, saved, strict=True)]
        for event in events:
            mover.wait_on_compute_stream(event)

    r = args.repeat
    t = {
        "d2h": d.timed(lambda: pinned.copy_(flat, non_blocking=True), r),
        "h2d": d.timed(lambda: flat.copy_(pinned, non_blocking=True), r),
        "d2h_shm": d.timed(lambda: shm_flat.copy_(flat, non_blocking=True), r),
        "h2d_shm": d.timed(lambda: flat.copy_(shm_flat, non_blocking=True), r),
        "gather_ceiling": d.timed(gather_ceiling, r),
        "scatter_ceiling": d.timed(scatter_ceiling, r),
        "connector_gather": d.timed(connector_gather, r),
        "connector_scatter": d.timed(connector_scatter, r),
    }
    # the scatters wrote back what the gathers read
    if not all(
        torch.equal(layers[i].index_select(0, ids).cpu(), saved[i].host.cpu()) for i in (0, LAYERS - 1)
    ):
        raise SystemExit("round trip changed the bytes")
    res.update(t)
    print(f"(a) ceilings, median of {r}")
    row("plain pinned D2H, one copy (cudaHostAlloc)", t["d2h"])
    row("plain pinned H2D, one copy (cudaHostAlloc)", t["h2d"])
    row("D2H, one copy into the registered /dev/shm map", t["d2h_shm"])
    row("H2D, one copy out of the registered /dev/shm map", t["h2d_shm"])
    row("gather ceiling: 32 x (index_select + D2H) into shm", t["gather_ceiling"],
        f"{t['d2h'] / t['gather_ceiling'] * 100:3.0f}% of plain D2H")  # fmt: skip
    row("scatter ceiling: 32 x (H2D + index_copy_) from shm", t["scatter_ceiling"],
        f"{t['h2d'] / t['scatter_ceiling'] * 100:3.0f}% of plain H2D")  # fmt: skip
    row("BlockMover.gather into pinned buffers (32 layers)", t["connector_gather"])
    row("BlockMover.scatter from pinned buffers (32 layers)", t["connector_scatter"])


def arena_part(
    args, d: Device, transport, probe, side, caches, block_ids, ids, bs, tokens, row: Row, res
) -> None:
    saves, loads, leased, behind = [], [], [], []
    served: dict[str, tuple[float, float]] = {}
    for i in range(args.repeat + 1):
        if i == 1:  # after the warm-up: the daemon's time per call over the repeats
            served = side.server_time()
        hashes = hashes_for("hot", bs, tokens, i)
        side.quiesce()
        s = arena_save(transport, probe, d, caches, hashes, block_ids)
        behind.append(side.quiesce())
        if i == 0:  # check the round trip once: blank two layers' blocks, load, compare
            ref = {n: caches[n].index_select(0, ids).clone() for n in (NAMES[0], NAMES[-1])}
            for n in ref:
                caches[n].index_fill_(0, ids, 0)
        r = arena_load(transport, probe, d, hashes, block_ids)
        if i == 0:
            for n in ref:
                got = caches[n].index_select(0, ids)
                if args.compression == "none" and not torch.equal(got, ref[n]):
                    raise SystemExit("the arena round trip changed the bytes")
                error = (got.float() - ref[n].float()).abs().max().item() / ref[n].float().abs().max().item()
                if error > 2**-3:  # lossy: far within a row's quantization step
                    raise SystemExit(f"the {args.compression} round trip is off by {error:.3f} of amax")
            del ref
        else:
            saves.append(s)
            loads.append(r)
            leased.append(arena_load(transport, probe, d, hashes, block_ids, leased=True))
    server = per_call(served, side.server_time())
    for i in range(1 + args.cold_repeat + args.disk_repeat + args.prefetch_repeat):  # for the cold child
        arena_save(transport, probe, d, caches, hashes_for("cold", bs, tokens, i), block_ids)
    behind.append(side.quiesce())
    ms, ml, mll = medians(saves), medians(loads), medians(leased)
    res["save"], res["hot"], res["hot_leased"] = ms, ml, mll
    res["write_behind_s"] = med(behind[1:-1])
    print(f"(arena) through ArenaTransport and the daemon's arena, median of {args.repeat}")
    print_split(row, "save end to end: reserve .. Commit returned", ms, SAVE_PARTS,
                res["gather_ceiling"], "gather ceiling")  # fmt: skip
    # the connector reserves a step's saves before its forward pass (open_saves_ahead), on
    # another thread: the Reserve round trip is off the path from the first layer saved to
    # the blocks being visible, which the rest of the split is
    ahead = ms["total"] - ms["reserve_rpc"]
    res["save_ahead"] = ahead
    row("save, reserved ahead as the connector does: open .. Commit", ahead,
        f"{res['gather_ceiling'] / ahead * 100:3.0f}% of the gather ceiling")  # fmt: skip
    # what of that the connector's step waits for: the Commit goes to its sender thread
    # (finish_step_saves); the blocks are visible to other engines once it returns
    copied = med([r["open_other"] + r["issue"] + r["copies"] for r in saves])
    res["save_copied"] = copied
    row("  of which its copies: open .. done (then the Commit)", copied,
        f"{res['gather_ceiling'] / copied * 100:3.0f}% of the gather ceiling")  # fmt: skip
    print_split(row, "load, hot (memory tier): pin .. release returned", ml, LOAD_PARTS,
                res["scatter_ceiling"], "scatter ceiling")  # fmt: skip
    print_split(row, "load, hot, from the lookup's lease: no pin RPC .. release", mll, LOAD_PARTS,
                res["scatter_ceiling"], "scatter ceiling")  # fmt: skip
    part("(a step before: the scheduler side's Lookup + lease)", mll["lookup_rpc"], mll["total"])
    row("(daemon) write-behind to LMDB after a save, until idle", res["write_behind_s"], "(not in the save)")
    if server:
        res["server_ms"] = server
        client = {"Reserve": ms["reserve_rpc"], "Commit": ms["commit_rpc"], "PinStream": ml["pin_rpc"],
                  "Lookup": mll["lookup_rpc"]}  # fmt: skip
        print("  each RPC in the daemon (its handler, mean of the repeats) / at the client (median):")
        print("  (Lookup: with a lease of every block, as the connector's scheduler side asks)")
        for method in ("Reserve", "Commit", "PinStream", "Pin", "Lookup", "Release"):
            if method in server:
                at_client = f" / {client[method] * 1e3:.2f} ms" if method in client else ""
                print(f"    {method:<10} {server[method]:6.2f} ms{at_client}")
    if args.profile:
        profile_once(transport, probe, d, side, caches, bs, tokens, block_ids)


def per_call(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Each method's mean time per call (ms) between two Daemonside.server_time readings."""
    out = {}
    for method, (calls, seconds) in after.items():
        was_calls, was_seconds = before.get(method, (0.0, 0.0))
        if calls > was_calls:
            out[method] = (seconds - was_seconds) / (calls - was_calls) * 1e3
    return out


def profiled(what: str, run: Callable[[], Any]) -> Any:
    """run() under cProfile; prints this process's calls by own time, and returns its result."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(run)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    body = out.getvalue()
    print(f"  (profile) one {what}, by own time:")
    print("\n".join("    " + line for line in body[body.index("ncalls") :].splitlines() if line.strip()))
    return result


def profile_once(transport, probe, d: Device, side, caches, bs: int, tokens: int, block_ids: list) -> None:
    """One more save and hot load under cProfile: this process's Python and torch calls
    (the daemon's side of the RPCs shows as the time the calls wait)."""
    hashes = hashes_for("hot", bs, tokens, 10_000)
    side.quiesce()
    for what, run in (
        ("save", lambda: arena_save(transport, probe, d, caches, hashes, block_ids)),
        ("hot load", lambda: arena_load(transport, probe, d, hashes, block_ids)),
    ):
        profiled(what, run)
        side.quiesce()


def legacy_part(args, d: Device, mover, caches, ids, specs, side, bs, tokens, row: Row, res) -> None:
    from kvstore_client import KVStoreClient

    n = len(ids)
    saves, loads, local_loads = [], [], []

    def load(client, hashes) -> float:
        start = now()
        layers = client.get_stream(
            NAMESPACE, hashes, allocate=lambda s, k: mover.host_buffer((k, *s.shape), torch.bfloat16)
        )
        events = [mover.scatter(caches[NAMES[i]], ids, host) for i, (_, host) in enumerate(layers)]
        for event in events:
            mover.wait_on_compute_stream(event)
        d.sync()
        if layers.num_blocks != n:
            raise RuntimeError(f"loaded {layers.num_blocks} of {n} blocks")
        return now() - start

    repeat = min(args.repeat, args.legacy_repeat)
    with (
        KVStoreClient(args.address, timeout=60, arena=False) as grpc_kv,
        KVStoreClient(args.address, timeout=60, arena=False, local_reads=True) as local_kv,
    ):
        for i in range(repeat + 1):
            hashes = hashes_for("legacy", bs, tokens, i)
            side.quiesce()
            d.sync()
            start = now()
            copies = [mover.gather(caches[name], ids) for name in NAMES]
            with grpc_kv.put_stream(NAMESPACE, hashes, specs) as stream:
                for name, copy in zip(NAMES, copies, strict=True):
                    stream.write_layer(name, copy.wait())
                stream.commit()
            saves.append(now() - start)
            side.quiesce()
            loads.append(load(grpc_kv, hashes))
            local_loads.append(load(local_kv, hashes))
        local = local_kv.local_data_dir is not None
    res["legacy"] = {"save": med(saves[1:]), "grpc_load": med(loads[1:]), "local_load": med(local_loads[1:])}
    lg = res["legacy"]
    print(f"(b) older paths: KVStoreClient without the arena, median of {repeat}")
    row("save: gather, D2H, put_stream over gRPC, commit", lg["save"])
    row("load over gRPC: get_stream, H2D, scatter", lg["grpc_load"])
    row("load, same-host LMDB reads: map, H2D, scatter", lg["local_load"],
        "" if local else "(NOTE: the client did not read the files itself)")  # fmt: skip


# ---- the cold child: loads whose blocks only LMDB holds --------------------------------


def cold_child(args: argparse.Namespace) -> None:
    from kvstore_client import KVStoreClient, tune_malloc

    tune_malloc()
    d = Device(args.device)
    kv = KVStoreClient(args.address, timeout=120, control_socket=args.control_socket)
    start = now()
    if not prepare_arena(kv, cuda=d.cuda):
        raise SystemExit("the restarted daemon offers no arena to this process")
    print(f"  mapped the new arena and registered it with CUDA in {now() - start:.2f}s")
    probe = Probe()
    instrument(kv, probe)
    results: dict[str, dict] = {}
    configs = [(bs, t) for bs in args.block_sizes for t in args.tokens]
    passes = [("page cache", 1, 1 + args.cold_repeat)]
    if args.disk_repeat:
        passes.append(("disk", 1 + args.cold_repeat, 1 + args.cold_repeat + args.disk_repeat))
    cache: dict[int, dict] = {}
    for label, first, end in passes:
        if label == "disk" and not drop_page_cache():
            break
        for bs, tokens in configs:
            if bs not in cache:
                cache.clear()
                gc.collect()
                cache[bs] = make_caches(d, bs, args.pool_tokens)
            caches = cache[bs]
            transport = build_transport(args, kv, d, caches, bs)
            instrument_transport(transport, probe)
            block_ids = block_ids_for(args.pool_tokens // bs, tokens // bs, tokens + bs)
            runs = []
            if label == "page cache":  # the first cold load warms this process's kernels up
                arena_load(transport, probe, d, hashes_for("cold", bs, tokens, 0), block_ids)
            for i in range(first, end):
                load = functools.partial(
                    arena_load, transport, probe, d, hashes_for("cold", bs, tokens, i), block_ids
                )
                if (
                    args.profile and label == "page cache" and i == end - 1 and runs
                ):  # the last: profiled, not timed
                    profiled(f"cold load of {tokens} tokens from the page cache", load)
                else:
                    runs.append(load())
            results.setdefault(f"{tokens}/{bs}", {})["cold" if label == "page cache" else "cold_disk"] = (
                medians(runs)
            )
            if label == "page cache" and args.prefetch_repeat:
                # as the connector's scheduler side asks a step before its workers load: the
                # Lookup starts the promotion, the engine's step passes (modeled: a wait of
                # --prefetch-gap-ms), then the load's Pin joins the reads or finds them done
                ahead = []
                base = 1 + args.cold_repeat + args.disk_repeat
                for i in range(base, base + args.prefetch_repeat):
                    hashes = hashes_for("cold", bs, tokens, i)
                    started = transport.client.where(transport.namespace, hashes, lease_from=0, prefetch=True)
                    time.sleep(args.prefetch_gap_ms / 1e3)
                    ahead.append(arena_load(transport, probe, d, hashes, block_ids))
                    ahead[-1]["prefetching"] = started.prefetching
                results[f"{tokens}/{bs}"]["cold_prefetched"] = medians(ahead)
    kv.close()
    print(f"  cold loads done ({len(passes)} pass(es))")
    Path(args.results).write_text(json.dumps(results))


# ---- the recompute: a random-weight Llama-3.1-8B prefill -------------------------------
def recompute(args: argparse.Namespace) -> dict[int, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Device(args.device)
    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.model_layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, attn_implementation="sdpa",
    )  # fmt: skip
    start = now()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(d.dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to(device=d.dev, dtype=torch.bfloat16).eval()
    d.sync()
    params = sum(p.numel() for p in model.parameters())
    # transformers draws the weights at construction (normal, std = initializer_range 0.02):
    # printed, since all-zero weights would run faster than real ones
    std = model.model.layers[0].self_attn.q_proj.weight.float().std().item()
    print(f"\n(recompute) random-weight Llama-3.1-8B shape in transformers "
          f"({params / 1e9:.2f} B parameters, {args.model_layers} layers, sdpa, bf16, weight std {std:.3f}), built in {now() - start:.1f}s")  # fmt: skip
    out: dict[int, float] = {}
    for tokens in args.tokens:
        ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=d.dev)

        def prefill(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                model(input_ids=ids, use_cache=True, logits_to_keep=1)

        prefill()  # the first call also picks kernels
        out[tokens] = d.timed(prefill, args.repeat)
        print(
            f"  prefill of {tokens} tokens, batch 1, use_cache=True: {out[tokens] * 1e3:8.1f} ms (median of {args.repeat})"
        )
    return out


# ---- the host's disk and page cache: what the persistent tier can reach -------------------
def io_ceilings(directory: Path, total: int, request: int, threads: int) -> dict[str, float]:
    """Raw parallel I/O of `total` bytes in `request`-byte requests from `threads` threads,
    the persistent tier's own shape (kvstore_server.tiers.segments: one request per block,
    IOPool's threads): pwritev (O_DIRECT where the filesystem takes it, as the tier
    writes) then fdatasync; preadv after the page cache was dropped (the disk); preadv
    again (the page cache). Seconds of each; a missing key: could not be measured."""
    from concurrent.futures import ThreadPoolExecutor

    path = directory / "io-ceiling.bin"
    total -= total % request
    # one buffer of `total` bytes, written (so faulted in) first: each request moves its own
    # memory, as the tier's do (an arena extent each). NOTE: runs before 2026-12-05 reused
    # `threads` buffers, which stayed in the CPU's caches: their page-cache read ceiling
    # (24-34 GB/s on the H200 host) was not one a load of distinct memory can reach
    buf = mmap.mmap(-1, total)
    chunk = os.urandom(1 << 20)
    for at in range(0, total - (1 << 20) + 1, 1 << 20):
        buf[at : at + (1 << 20)] = chunk
    views = [memoryview(buf)[at : at + request] for at in range(0, total, request)]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    out: dict[str, float] = {}
    try:
        os.posix_fallocate(fd, 0, total)
        try:
            wfd = os.open(path, os.O_RDWR | os.O_DIRECT)
            out["direct"] = 1.0
        except OSError:
            wfd = os.dup(fd)
        offsets = list(range(0, total, request))

        def run(op: Callable[[int, list[memoryview], int], int], use_fd: int) -> float:
            def one(i: int) -> None:
                op(use_fd, [views[i]], offsets[i])

            start = now()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(len(offsets))))
            return now() - start

        start = now()
        run(os.pwritev, wfd)
        os.fdatasync(fd)
        out["write"] = now() - start
        os.close(wfd)
        if drop_page_cache():
            out["disk_read"] = run(os.preadv, fd)
        else:
            run(os.preadv, fd)
        out["cache_read"] = run(os.preadv, fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    gb = total / 1e9
    print(
        f"(io) the data dir's filesystem, {gb:.2f} GB in {request >> 10} KiB requests from {threads} threads:"
    )
    for key, what in (("write", f"pwritev{' O_DIRECT' if 'direct' in out else ''} + fdatasync"),
                      ("disk_read", "preadv, page cache dropped (the disk)"),
                      ("cache_read", "preadv, in the page cache")):  # fmt: skip
        if key in out:
            print(f"  {what:<44} {out[key] * 1e3:9.1f} ms {gb / out[key]:7.2f} GB/s")
    out["bytes"] = float(total)
    return out


# ---- the parent: daemons, children, summary --------------------------------------------
class Daemon:
    def __init__(self, args: argparse.Namespace, data_dir: Path, memory_dir: Path) -> None:
        self.cmd = [
            sys.executable, "-m", "kvstore_server", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir),
            "--memory", args.memory, "--memory-dir", str(memory_dir), "--write-behind-bytes", args.memory,
            "--capacity", args.capacity, "--log-level", args.daemon_log_level, "--metrics-port", "0",
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.metrics_url = ""  # each RPC's time in the daemon (kvstore_rpc_duration_seconds)
        self.log_path = data_dir.parent / "daemon.log"

    def start(self) -> float:
        start = now()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "ready" not in line:
            self.proc.kill()
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise SystemExit(f"the daemon did not start: {line!r}\n{tail}")
        self.address = line.split()[3]
        found = re.search(r"metrics=(\S+?)\)", line)
        self.metrics_url = found.group(1) if found else ""
        return now() - start

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def child(args: argparse.Namespace, phase: str, daemon: Daemon, results: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        *args.argv,
        "--phase",
        phase,
        "--address",
        daemon.address,
        "--metrics-url",
        daemon.metrics_url,
        "--results",
        str(results),
    ]
    rc = subprocess.call(cmd)
    if rc != 0:
        raise SystemExit(f"the {phase} child failed (exit {rc})")
    return json.loads(results.read_text())


def parent(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-gpu-", dir=args.data_root))
    memory_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir="/dev/shm"))
    results: dict[str, dict] = {}
    info: dict[str, Any] = {}
    daemon = Daemon(args, tmp / "data", memory_dir)
    try:
        if args.io_ceilings:
            block = kv_bytes(args.block_sizes[0], args.block_sizes[0])  # one block: one request
            info["io"] = io_ceilings(tmp, max(kv_bytes(t, args.block_sizes[0]) for t in args.tokens),
                                     block, args.io_threads)  # fmt: skip
        if args.daemon:
            print(f"daemon: {' '.join(daemon.cmd[1:])}")
            print(f"  data dir on {fs_of(tmp)}; arena under {memory_dir}")
            info["start"] = daemon.start()
            print(f"  ready in {info['start']:.1f}s (creating and pre-faulting the {args.memory} arena)")
        results = child(args, "hot", daemon, tmp / "hot.json")
        if args.daemon:
            side = Daemonside(daemon.address)
            side.quiesce()
            stats = side.kv.stats()
            side.close()
            print(f"\n--- cold loads: daemon killed (-9) with nothing waiting for write-behind "
                  f"(write_behind_dropped={stats.get('write_behind_dropped')}), its arena file deleted, restarted")  # fmt: skip
            daemon.kill()
            shutil.rmtree(memory_dir, ignore_errors=True)
            memory_dir.mkdir()
            info["restart"] = daemon.start()
            print(f"  restarted in {info['restart']:.1f}s (a fresh arena; LMDB holds the blocks)")
            # write-behind writes O_DIRECT where it can: nothing it wrote is in the page cache.
            # Read the segment files once, so the first pass loads from the page cache (the
            # second, after dropping it, from the disk).
            start, warmed = now(), 0
            for seg in sorted((tmp / "data" / "lmdb" / "segments").glob("seg-*")):
                with open(seg, "rb", buffering=0) as f:
                    while chunk := f.read(16 << 20):
                        warmed += len(chunk)
            print(
                f"  read the segment files into the page cache: {warmed / 1e9:.2f} GB in {now() - start:.1f}s"
            )
            for key, value in child(args, "cold", daemon, tmp / "cold.json").items():
                results.setdefault(key, {}).update(value)
            daemon.stop()
            print_cold(results)
        print_daemon_log(daemon.log_path)
    finally:
        daemon.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(memory_dir, ignore_errors=True)
    prefill = recompute(args) if args.recompute else {}
    summary(args, results, prefill, info.get("io", {}))


def print_daemon_log(path: Path) -> None:
    """What the daemon logged at WARNING and above, and (at --daemon-log-level DEBUG) its
    promotions' and write-behind batches' timings."""
    if not path.exists():
        return
    timings = ("promoted", "wrote behind", " writes in ")
    lines = [line for line in path.read_text().splitlines()
             if " WARNING " in line or " ERROR " in line or any(t in line for t in timings)]  # fmt: skip
    if lines:
        print(f"\n--- the daemon's log ({len(lines)} lines)")
        for line in lines[-200:]:
            print(f"  {line}")


def print_cold(results: dict) -> None:
    for key, res in results.items():
        for label, what in (("cold", "page cache"), ("cold_prefetched", "page cache, prefetched at the lookup"),
                            ("cold_disk", "disk, page cache dropped")):  # fmt: skip
            m = res.get(label)
            if not m:
                continue
            tokens, bs = key.split("/")
            row = Row(res["nbytes"])
            print(f"\n=== {tokens} tokens, block size {bs}: cold load, LMDB file on {what} ===")
            print_split(row, "load, cold: pin (promotes from LMDB) .. release", m, LOAD_PARTS,
                        res["scatter_ceiling"], "scatter ceiling")  # fmt: skip
            if m.get("last_ready"):
                print(f"      (the daemon's first report of blocks read came {m['first_ready'] * 1e3:.2f} ms after "
                      f"the pin's answer; its last, all read, {m['last_ready'] * 1e3:.2f} ms after the pin was sent)")  # fmt: skip
            if m.get("t_staged"):
                print(f"      timeline from the pin sent (ms): the pin's answer {m['pin_rpc'] * 1e3:.2f}, first range "
                      f"copied {m['t_first_stage'] * 1e3:.2f}, last report {m['t_last_ready'] * 1e3:.2f}, last range "
                      f"copied {m['t_staged'] * 1e3:.2f} ({m['t_ranges']:.0f} ranges), checks done and the first "
                      f"group scattered {m['t_first_done'] * 1e3:.2f}, the last {m['t_last_done'] * 1e3:.2f}, "
                      f"landed {m['t_end'] * 1e3:.2f}")  # fmt: skip
            if m.get("gpu_landed"):
                print(f"      on the GPU (ms from the pin sent): the last range landed {m['gpu_landed'] * 1e3:.2f}, "
                      f"its checks done {m['gpu_checked'] * 1e3:.2f}, the last group scattered "
                      f"{m['gpu_scattered'] * 1e3:.2f}")  # fmt: skip


def summary(args: argparse.Namespace, results: dict, prefill: dict[int, float], io: dict) -> None:
    print("\n=== summary: medians, GB/s of KV bytes (1e9 B/s) ===")
    print(f"{'tokens':>6} {'blk':>3} {'KV MB':>6} | {'gath.ceil':>9} {'save':>6} {'%ceil':>5} | "
          f"{'scat.ceil':>9} {'hot ld':>6} {'%ceil':>5} | {'cold pc':>7} {'disk':>6} | "
          f"{'save ms':>7} {'hot ms':>7} {'cold ms':>7} {'disk ms':>7} {'recomp ms':>9}")  # fmt: skip
    lines = []
    for res in results.values():
        gb = res["nbytes"] / 1e9

        def rate(s: float | None, width: int = 6, gb: float = gb) -> str:
            return f"{gb / s:{width}.2f}" if s else f"{'-':>{width}}"

        def ms(s: float | None, width: int = 7) -> str:
            return f"{s * 1e3:{width}.1f}" if s else f"{'-':>{width}}"

        def pct(ceiling: float, s: float | None) -> str:
            return f"{ceiling / s * 100:5.0f}" if s else f"{'-':>5}"

        save = res.get("save", {}).get("total")
        hot = res.get("hot", {}).get("total")
        cold = res.get("cold", {}).get("total")
        disk = res.get("cold_disk", {}).get("total")
        rec = prefill.get(res["tokens"])
        print(
            f"{res['tokens']:>6} {res['bs']:>3} {res['nbytes'] / 1e6:6.0f} | {gb / res['gather_ceiling']:9.2f} "
            f"{rate(save)} {pct(res['gather_ceiling'], save)} | {gb / res['scatter_ceiling']:9.2f} {rate(hot)} "
            f"{pct(res['scatter_ceiling'], hot)} | {rate(cold, 7)} {rate(disk)} | {ms(save)} {ms(hot)} "
            f"{ms(cold)} {ms(disk)} {ms(rec, 9)}"
        )
        pre = res.get("cold_prefetched", {}).get("total")
        if pre:
            lines.append(f"  {res['tokens']} tokens, block {res['bs']}: cold load (page cache) prefetched at the "
                         f"lookup {args.prefetch_gap_ms:.0f} ms before the load (the engine's step, modeled) "
                         f"{ms(pre).strip()} ms, {rate(pre).strip()} GB/s, against {ms(cold).strip()} ms not")  # fmt: skip
        ahead = res.get("save_ahead")
        if ahead:
            lines.append(f"  {res['tokens']} tokens, block {res['bs']}: save reserved ahead (the connector's "
                         f"step) {ms(ahead).strip()} ms, {rate(ahead).strip()} GB/s, "
                         f"{pct(res['gather_ceiling'], ahead).strip()}% of the gather ceiling")  # fmt: skip
        copied = res.get("save_copied")
        if copied and ahead:
            lines.append(f"  {res['tokens']} tokens, block {res['bs']}: of which its copies (open .. done) "
                         f"{ms(copied).strip()} ms, {pct(res['gather_ceiling'], copied).strip()}% of the gather "
                         f"ceiling; the Commit after them (the connector's sender thread) "
                         f"{ms(ahead - copied).strip()} ms")  # fmt: skip
        if rec:
            got = [f"hot {rec / hot:.1f}x" if hot else "", f"cold, LMDB in the page cache {rec / cold:.1f}x" if cold
                   else "", f"cold, LMDB from disk {rec / disk:.1f}x" if disk else ""]  # fmt: skip
            lines.append(f"  {res['tokens']} tokens, block {res['bs']}: recompute time / load time "
                         f"({rec * 1e3:.0f} ms): {', '.join(g for g in got if g)}")  # fmt: skip
    print(
        "  %ceil: the ceiling's time / this time (save vs the gather ceiling, hot load vs the scatter ceiling)"
    )
    print("  recompute time / load time: above 1 a hit is that many times faster than the prefill")
    for line in lines:
        print(line)
    print("  where the rest of the time goes: each end-to-end row's split above (RPCs, xxh3, copies, Python)")
    if io:
        io_gb = io["bytes"] / 1e9
        ceil = {k: io_gb / io[k] for k in ("write", "disk_read", "cache_read") if k in io}
        print(
            "\n=== the persistent tier against this host's disk and page cache (GB/s; % of the ceiling) ==="
        )
        print("  ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in ceil.items()))
        for res in results.values():
            gb = res["nbytes"] / 1e9
            parts = []
            behind = res.get("write_behind_s")
            if behind and "write" in ceil:
                parts.append(
                    f"write-behind {gb / behind:.2f} ({gb / behind / ceil['write'] * 100:.0f}% of write)"
                )
            cold = res.get("cold", {}).get("total")
            if cold and "cache_read" in ceil:
                parts.append(
                    f"cold load, page cache {gb / cold:.2f} ({gb / cold / ceil['cache_read'] * 100:.0f}%)"
                )
            disk = res.get("cold_disk", {}).get("total")
            if disk and "disk_read" in ceil:
                parts.append(f"cold load, disk {gb / disk:.2f} ({gb / disk / ceil['disk_read'] * 100:.0f}%)")
            print(f"  {res['tokens']} tokens, block {res['bs']}: " + "; ".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--block-sizes", default="16,32", help="comma-separated vLLM block sizes")
    p.add_argument("--pool-tokens", type=int, default=65536, help="paged KV pool per layer, in tokens")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--cold-repeat", type=int, default=3, help="cold loads per size (LMDB in the page cache)")
    p.add_argument(
        "--disk-repeat", type=int, default=2, help="cold loads per size after dropping the page cache"
    )
    p.add_argument("--legacy-repeat", type=int, default=3, help="runs of the (b) gRPC/LMDB paths")
    p.add_argument("--prefetch-repeat", type=int, default=0,
                   help="cold loads per size (page cache) prefetched at a Lookup --prefetch-gap-ms before")  # fmt: skip
    p.add_argument("--prefetch-gap-ms", type=float, default=10.0,
                   help="the engine's step between the scheduler's Lookup and the workers' load (modeled)")  # fmt: skip
    p.add_argument("--memory", default="40GiB", help="the daemon's arena")
    p.add_argument("--capacity", default="200GiB", help="the daemon's LMDB budget")
    p.add_argument("--data-root", default=None, help="where the daemon's data dir goes (default: $TMPDIR)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the bench out")
    p.add_argument("--model-layers", type=int, default=32, help="recompute model layers (32: Llama-3.1-8B)")
    p.add_argument("--no-daemon", dest="daemon", action="store_false", help="only the ceilings and recompute")
    p.add_argument("--no-legacy", dest="legacy", action="store_false", help="skip (b)")
    p.add_argument("--no-recompute", dest="recompute", action="store_false")
    p.add_argument("--no-io-ceilings", dest="io_ceilings", action="store_false",
                   help="skip the raw disk and page-cache ceilings")  # fmt: skip
    p.add_argument("--io-threads", type=int, default=16, help="threads of the raw I/O ceilings (the tier's)")
    p.add_argument(
        "--daemon-log-level",
        default="WARNING",
        help="the daemon's; DEBUG prints each promotion's and write-behind batch's timings",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile one hot save and load per size, and the last cold load from the page cache",
    )
    p.add_argument(
        "--layout",
        choices=("heads", "layers"),
        default="heads",
        help="heads: the connector's (a store layer per KV head); layers: one per layer, as before",
    )
    p.add_argument("--compression", choices=("none", "fp8", "int8"), default="none",
                   help="the connector's compression, on the device (GB/s stay of the raw KV)")  # fmt: skip
    p.add_argument("--no-control-socket", dest="control_socket", action="store_false",
                   help="the arena clients make every call over gRPC (to compare)")  # fmt: skip
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--metrics-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--results", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.argv = [a for a in sys.argv[1:]]
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.block_sizes = [int(b) for b in str(args.block_sizes).split(",")]
    if args.phase == "hot":
        hot_child(args)
    elif args.phase == "cold":
        cold_child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()

"""Tensor-parallel ranks sharing one daemon's arena: each rank a process with its own GPU
(or, on a one-GPU host, all on the same one), saving and loading its KV heads at once.

    python bench/bench_tp_ranks.py                      # GPU host: ranks on cuda:0, cuda:1, ...
    python bench/bench_tp_ranks.py --device cpu --tokens 64 --memory 1GiB   # try it out

One daemon; rank processes of a Llama-3.1-8B-shaped model (32 layers, 8 KV heads, head
dim 128, bf16, block size 16) driving the connector's ArenaTransport as its worker does
(kvstore_connector.layout: a store layer per KV head; a rank saves its heads as a part of
each block, visible once every rank's part is in). Per size, in one run:

- each TP=2 rank's gather and scatter ceiling (its layers' indexed copies into / out of
  registered shared memory), measured with every rank copying at once;
- TP=2 saves: both ranks save the same request at once (partial puts into one block);
  then a TP=1 process loads it whole: bit-exact against what the ranks held;
- a TP=1 save, then both TP=2 ranks load their heads of it at once: bit-exact;
- per rank and aggregate GB/s (the aggregate: all ranks' bytes over the span from the
  first start to the last end), each process's time to map and register the arena, the
  daemon's time per Reserve and Commit (a part each per rank), and how many of the parts'
  block-layers the ranks wrote in place (the daemon copied none: `part_layers_*` stats).

Figures only; each rank's own bytes are its heads (half a block's at TP=2).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_datapath as g  # noqa: E402  (its path setup, Daemon, timing and the arena save/load)

BS = 16
ANSWER = "@answer "  # a rank's answers on its stdout, apart from what else it prints


def content(d: g.Device, tokens: int, seed: int) -> list[torch.Tensor]:
    """A request's KV, every head of every layer ([blocks, heads, bs, 2 x head dim] each):
    the same bytes in every process that asks (random bits, compared as bytes)."""
    gen = torch.Generator(device=d.dev).manual_seed(seed)
    shape = (tokens // BS, g.KV_HEADS, BS, 2 * g.HEAD_DIM)
    return [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=d.dev, generator=gen).view(
            torch.bfloat16
        )
        for _ in g.NAMES
    ]


class Rank:
    """One process's transport: rank `rank` of a TP=`tp` engine, its heads of each layer."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvstore_connector.arena_transport import ArenaTransport
        from kvstore_connector.layout import StoreLayout

        from kvstore_client import KVStoreClient, tune_malloc

        tune_malloc()
        self.d = g.Device(args.device)
        if self.d.cuda:
            torch.cuda.set_device(self.d.dev)
        self.tp, self.rank = args.tp, args.rank
        self.heads = g.KV_HEADS // self.tp
        self.first = self.rank * self.heads
        pool = 2 * max(args.tokens) // BS + 8
        self.caches = {
            n: torch.zeros((pool, self.heads, BS, 2 * g.HEAD_DIM), dtype=torch.bfloat16, device=self.d.dev)
            for n in g.NAMES
        }
        self.kv = KVStoreClient(args.address, timeout=60)
        start = time.perf_counter()
        if not g.prepare_arena(self.kv, cuda=self.d.cuda):
            raise SystemExit("the daemon offers no arena to this process")
        self.register_s = time.perf_counter() - start
        layout = StoreLayout.build(self.caches, num_kv_heads=g.KV_HEADS, tp_size=self.tp, tp_rank=self.rank,
                                   mla=False, codec=None)  # fmt: skip
        self.transport = ArenaTransport(self.kv, g.NAMESPACE + b"|tp", layout.subset_specs, layout.views,
                                        g.BlockMover(self.d.dev), stored=layout.specs, subset=layout.subset,
                                        heads=layout.head_targets, reserve_timeout=30)  # fmt: skip
        g.LAYOUTS[id(self.transport)] = layout
        self.probe = g.Probe()
        g.instrument(self.kv, self.probe)
        self.pool = pool

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.first : self.first + self.heads]

    def ids(self, tokens: int, where: str) -> list[int]:
        n = tokens // BS
        return list(range(n)) if where == "save" else list(range(self.pool - n, self.pool))

    def hashes(self, tokens: int, seed: int) -> list[bytes]:
        from kvstore_client.hashing import block_hashes

        return block_hashes(g.NAMESPACE, [seed] * tokens, BS)

    def save(self, tokens: int, seed: int) -> dict[str, Any]:
        ids = self.ids(tokens, "save")
        for name, full in zip(g.NAMES, content(self.d, tokens, seed), strict=True):
            self.caches[name][ids] = self.mine(full)
        hashes = self.hashes(tokens, seed)
        spec = g.SaveSpec("bench", hashes, ids, b"")
        layout = g.LAYOUTS[id(self.transport)]
        self.d.sync()
        start = time.monotonic()
        save = self.transport.open(spec)
        if save is None:
            raise RuntimeError("ArenaTransport.open dropped the save")
        for name in g.NAMES:  # a layer's heads (this rank's) in one copy, as the connector saves
            self.transport.save_layer([save], layout.by_layer[name], layout.heads[name])
        done = self.transport.commit(save)  # the part that completes a block makes it visible
        end = time.monotonic()
        if done is None or done.blocks_sent != len(hashes):
            raise RuntimeError(f"the save sent {done} of {len(hashes)} blocks")
        return {"start": start, "end": end, "ok": True}

    def load(self, tokens: int, seed: int) -> dict[str, Any]:
        ids = self.ids(tokens, "load")
        for cache in self.caches.values():
            cache[ids] = 0
        self.d.sync()
        start = time.monotonic()
        g.arena_load(self.transport, self.probe, self.d, self.hashes(tokens, seed), ids)
        end = time.monotonic()
        ok = all(
            torch.equal(self.caches[name][ids].view(torch.int16), self.mine(full).view(torch.int16))
            for name, full in zip(g.NAMES, content(self.d, tokens, seed), strict=True)
        )
        return {"start": start, "end": end, "ok": ok}

    def ceiling(self, tokens: int, repeat: int) -> dict[str, Any]:
        """This rank's gather and scatter ceilings: its layers' indexed copies into / out of
        registered shared memory (what its saves and loads do, without the store)."""
        ids = self.transport.mover.index(self.ids(tokens, "save"))
        layers = list(self.caches.values())
        per = len(ids) * self.heads * BS * 2 * g.HEAD_DIM * 2
        with g.shm_mapping(per * len(layers), self.d.cuda) as shm:
            views = [shm[i * per : (i + 1) * per].view(torch.bfloat16).view(len(ids), self.heads, BS, -1)
                     for i in range(len(layers))]  # fmt: skip

            def gather() -> None:
                for kv, dst in zip(layers, views, strict=True):
                    dst.copy_(kv.index_select(0, ids), non_blocking=True)

            def scatter() -> None:
                for kv, src in zip(layers, views, strict=True):
                    kv.index_copy_(0, ids, src.to(self.d.dev, non_blocking=True))

            start = time.monotonic()
            out = {"gather": self.d.timed(gather, repeat), "scatter": self.d.timed(scatter, repeat)}
        return {"start": start, "end": time.monotonic(), **out, "ok": True}


def rank_main(args: argparse.Namespace) -> None:
    """A rank process: 'ready <seconds to map and register the arena>', then one JSON answer
    per command line on stdin (save|load|ceiling TOKENS SEED/REPEAT, or quit)."""
    rank = Rank(args)
    print(f"{ANSWER}ready {rank.register_s:.3f}", flush=True)
    for line in sys.stdin:
        what, tokens, arg = (line.split() + ["", "", ""])[:3]
        if what == "quit":
            break
        method = {"save": rank.save, "load": rank.load, "ceiling": rank.ceiling}[what]
        print(ANSWER + json.dumps(method(int(tokens), int(arg))), flush=True)
    rank.kv.close()


class Ranks:
    """The parent's handle on a group of rank processes (one engine of tensor parallelism tp)."""

    def __init__(self, args: argparse.Namespace, daemon: g.Daemon, tp: int, devices: list[str]) -> None:
        self.tp = tp
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--phase",
                    "rank",
                    "--tp",
                    str(tp),
                    "--rank",
                    str(r),
                    "--device",
                    devices[r % len(devices)],
                    "--address",
                    daemon.address,
                    "--tokens",
                    ",".join(map(str, args.tokens)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for r in range(tp)
        ]
        self.register_s = []
        for proc in self.procs:
            line = _answer(proc)
            if not line.startswith("ready"):
                raise SystemExit(f"a rank process did not start: {line!r}")
            self.register_s.append(float(line.split()[1]))

    def all(self, command: str, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        """Every rank (or `ranks`) runs `command` at once (sent to all before any answer is read)."""
        procs = self.procs if ranks is None else [self.procs[r] for r in ranks]
        for proc in procs:
            if proc.stdin is None:
                raise RuntimeError("a rank process without its stdin")
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        answers = []
        for proc in procs:
            line = _answer(proc)
            if not line:
                raise SystemExit(f"a rank process died during {command!r}")
            answers.append(json.loads(line))
        return answers

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.write("quit\n")
                proc.stdin.close()
            proc.wait(60)


def _answer(proc: subprocess.Popen) -> str:
    """A rank's next answer (its other output is passed on); "" when it ended."""
    while proc.stdout is not None and (line := proc.stdout.readline()):
        if line.startswith(ANSWER):
            return line[len(ANSWER) :]
        print(line, end="")
    return ""


def span(answers: list[dict[str, Any]]) -> float:
    return max(a["end"] for a in answers) - min(a["start"] for a in answers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cuda (every GPU of the host, ranks round-robin) or cpu")
    p.add_argument("--memory", default="24GiB", help="the daemon's arena")
    p.add_argument("--capacity", default="64GiB")
    p.add_argument("--daemon-log-level", default="WARNING")
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    if args.phase == "rank":
        rank_main(args)
        return
    if args.device == "cuda":
        count = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(count)]
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        print(f"{count} GPU(s): {', '.join(names)}; two ranks on {'two GPUs' if count > 1 else 'one GPU'}")
    else:
        devices = ["cpu"]
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-tp-"))
    daemon = g.Daemon(args, tmp / "data", Path("/dev/shm") / tmp.name)
    print(f"daemon ready in {daemon.start():.1f}s")
    side = g.Daemonside(daemon.address, daemon.metrics_url)
    try:
        two = Ranks(args, daemon, 2, devices)
        one = Ranks(args, daemon, 1, devices)
        print(f"map + register the arena: TP=2 ranks {', '.join(f'{s:.2f}s' for s in two.register_s)}; "
              f"TP=1 {one.register_s[0]:.2f}s")  # fmt: skip
        for tokens in args.tokens:
            report(args, tokens, two, one, side)
        two.close()
        one.close()
    finally:
        side.close()
        daemon.stop()
        subprocess.call(["rm", "-rf", str(tmp), str(Path("/dev/shm") / tmp.name)])


def report(args: argparse.Namespace, tokens: int, two: Ranks, one: Ranks, side: g.Daemonside) -> None:
    whole = g.kv_bytes(tokens, BS)
    half = whole // 2
    print(f"\n=== {tokens} tokens: {whole / 1e6:.0f} MB of KV, {half / 1e6:.0f} MB per TP=2 rank ===")
    ceil = two.all(f"ceiling {tokens} {args.repeat}")
    for r, c in enumerate(ceil):
        print(f"  rank {r} ceilings, both ranks copying: gather {c['gather'] * 1e3:.2f} ms "
              f"({half / c['gather'] / 1e9:.1f} GB/s), scatter {c['scatter'] * 1e3:.2f} ms "
              f"({half / c['scatter'] / 1e9:.1f} GB/s)")  # fmt: skip
    rows: dict[str, list[list[dict[str, Any]]]] = {
        "alone_save": [], "alone_load": [], "save2": [], "load1": [], "save1": [], "load2": []
    }  # fmt: skip
    before, parts = side.server_time(), side.kv.stats()
    exact = True
    for i in range(args.repeat + 1):
        seed = tokens * 1000 + i
        # rank 0 alone (what two ranks together are measured against); rank 1's part then
        # completes the blocks (untimed), and rank 0 alone loads its heads of them
        alone_save = two.all(f"save {tokens} {seed + 900}", [0])
        two.all(f"save {tokens} {seed + 900}", [1])
        runs = {
            "alone_save": alone_save,
            "alone_load": two.all(f"load {tokens} {seed + 900}", [0]),
            "save2": two.all(f"save {tokens} {seed}"),  # both halves of each block at once
            "load1": one.all(f"load {tokens} {seed}"),  # the whole of it, by one process
            "save1": one.all(f"save {tokens} {seed + 500}"),
            "load2": two.all(f"load {tokens} {seed + 500}"),  # each rank its heads of it
        }
        exact = exact and all(a["ok"] for answers in runs.values() for a in answers)
        if i:  # the first: warm-up
            for key, answers in runs.items():
                rows[key].append(answers)
    server = g.per_call(before, side.server_time())
    print(f"  every load bit-exact against the source KV: {'yes' if exact else 'NO'}")
    after = side.kv.stats()
    placed, copied = (after[k] - parts[k] for k in ("part_layers_in_place", "part_layers_copied"))
    print(f"  parts' block-layers written in place by the ranks: {placed}, copied by the daemon: {copied}")
    for key, title, each in (("alone_save", "TP=2 rank 0 saving alone (its part)", half),
                             ("alone_load", "TP=2 rank 0 loading alone (its heads)", half),
                             ("save2", "TP=2 save, both ranks at once (a part each)", half),
                             ("load1", "TP=1 load of the TP=2 save (whole blocks)", whole),
                             ("save1", "TP=1 save", whole),
                             ("load2", "TP=2 load of the TP=1 save, both ranks at once", half)):  # fmt: skip
        runs = rows[key]
        agg = g.med([span(answers) for answers in runs])
        per = [
            g.med([answers[r]["end"] - answers[r]["start"] for answers in runs]) for r in range(len(runs[0]))
        ]
        moved = each * len(per)
        rates = ", ".join(f"rank {r} {s * 1e3:.2f} ms {each / s / 1e9:.1f} GB/s" for r, s in enumerate(per))
        print(f"  {title:<48} {agg * 1e3:7.2f} ms {moved / agg / 1e9:6.1f} GB/s  ({rates})")
        if key in ("save2", "load2"):
            kind = "gather" if key == "save2" else "scatter"
            alone = g.med([a[0]["end"] - a[0]["start"] for a in rows["alone_" + key[:4]]])
            ratios = ", ".join(f"{c[kind] / s * 100:.0f}%" for c, s in zip(ceil, per, strict=True))
            print(f"      each rank against its {kind} ceiling: {ratios}; the two together: "
                  f"{moved / agg / (half / alone):.2f}x rank 0 alone")  # fmt: skip
    print("  the daemon's time per call (mean), every part included:")
    for method in ("Reserve", "Commit", "PinStream", "Pin", "Release"):
        if method in server:
            print(f"    {method:<10} {server[method]:6.2f} ms")


if __name__ == "__main__":
    main()

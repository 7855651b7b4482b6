"""The daemon's memory under concurrent load stays within the documented bound.

README (Limits): the daemon's own (anonymous) memory stays within its idle size +
max_inflight_put_bytes + MEMORY_CONSTANT under the load of bench/bench_memory.py, and
its RSS returns near the idle size once the load has stopped. (RSS also counts the
stored data's file pages that reads map: page cache, reported, not bounded here.)
Here: a small budget, many clients putting 16 MiB each at once (most are refused with
RESOURCE_EXHAUSTED: the budget is the point), readers streaming stored blocks back
meanwhile, on the real daemon process, both backends. The daemon's anonymous memory
is sampled every few milliseconds (the kernel keeps a peak of RSS only).
"""

from __future__ import annotations

import threading
from pathlib import Path

from integration.helpers import NS, chain, make_layers
from support.daemon import Daemon, eventually
from support.threads import run_all

from kvstore_client import KVStoreClient, errors

MiB = 1 << 20
BUDGET = 64 * MiB
# README, Limits: the documented constant above idle + max_inflight_put_bytes.
MEMORY_CONSTANT = 256 * MiB
# ... and "near its idle size" once the load is over
SETTLED = 48 * MiB
CLIENTS = 24
ROUNDS = 2
READERS = 4


def test_rss_under_concurrent_put_and_get_load_stays_within_the_bound(tmp_path: Path, backend: str) -> None:
    daemon = Daemon(
        tmp_path / "data",
        backend=backend,
        capacity="2GiB",
        extra_args=["--max-inflight-put-bytes", str(BUDGET)],
    ).start()
    try:
        layers = make_layers(16, num_layers=16, shape=(64, 512), seed=3)  # 16 blocks x 1 MiB
        idle = daemon.memory()  # a fresh daemon: what the load must come back to
        with KVStoreClient(daemon.address, timeout=60, arena=False) as kv:
            readable = chain("readable", 16)
            kv.put(NS, readable, layers)
        outcomes: dict[str, int] = {}
        lock = threading.Lock()
        anon_peak = [0]
        loaded = threading.Event()

        def sample() -> None:  # a measurement, not a synchronisation
            while not loaded.wait(0.003):
                anon_peak[0] = max(anon_peak[0], daemon.memory()["RssAnon"])

        def writer(i: int, round_: int) -> None:
            with KVStoreClient(daemon.address, timeout=60, arena=False) as kv:
                try:
                    kv.put(NS, chain(f"w{i}-{round_}", 16), layers)
                    outcome = "stored"
                except errors.CapacityExceeded:
                    outcome = "refused"
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        def reader() -> None:
            with KVStoreClient(daemon.address, timeout=60, arena=False) as kv:
                for _ in range(3):
                    got = kv.select(NS, readable)
                    assert len(got) == 16 and got["layer.0"].shape[0] == 16

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            for round_ in range(ROUNDS):
                failures = run_all(
                    [lambda i=i, r=round_: writer(i, r) for i in range(CLIENTS)] + [reader] * READERS
                )
                assert failures == []
        finally:
            loaded.set()
            sampler.join()
        peak = daemon.memory()["VmHWM"]
        over = anon_peak[0] - idle["RssAnon"] - BUDGET
        print(
            f"\n[{backend}] budget {BUDGET / MiB:.0f} MiB, {CLIENTS} clients x {ROUNDS} rounds of 16 MiB puts "
            f"+ {READERS} readers: own memory idle {idle['RssAnon'] / MiB:.0f} MiB, peak "
            f"{anon_peak[0] / MiB:.0f} MiB = idle + budget + {over / MiB:.0f} MiB (documented constant "
            f"{MEMORY_CONSTANT / MiB:.0f}); RSS idle {idle['VmRSS'] / MiB:.0f}, peak {peak / MiB:.0f} MiB; {outcomes}"
        )
        assert outcomes.get("stored", 0) > 0 and outcomes.get("refused", 0) > 0  # the budget was the limit
        assert anon_peak[0] <= idle["RssAnon"] + BUDGET + MEMORY_CONSTANT
        # once idle, the daemon gives its transfer buffers (and LMDB's mapped pages) back
        eventually(lambda: daemon.memory()["VmRSS"] <= idle["VmRSS"] + SETTLED, deadline_s=30)
        print(f"[{backend}] RSS after the load: {daemon.memory()['VmRSS'] / MiB:.0f} MiB")
    finally:
        daemon.stop()

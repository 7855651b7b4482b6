"""SIGKILL loops: the daemon is killed mid-traffic, again and again, and restarted.

Two writers put chains of distinct, deterministic blocks as fast as the daemon takes
them, reconnecting across restarts; the daemon is SIGKILLed whenever each writer has
had a few more puts acknowledged since the last restart, KILLS times, then restarted
once more and checked. What holds, for both backends:

- 0 acknowledged blocks lost: every put that returned is stored whole, bit-exact;
- 0 blocks visible with wrong or partial bytes: every block the daemon lists belongs
  to a put that was sent, and reading any attempted chain returns a prefix whose
  bytes are exactly what was sent (a put the kill interrupted is all there or absent).
"""

from __future__ import annotations

import threading
from pathlib import Path

from integration.helpers import NS, as_bytes, chain, make_layers
from support.daemon import Daemon

from kvstore_client import KVStoreClient, errors

KILLS = 8
PUTS_PER_CYCLE = 3  # acknowledged puts each writer gets in before the next kill
WRITERS = 2
BLOCKS = 4  # per put: 4 blocks x 2 layers x 64 KiB


def expected_layers(writer: int, index: int) -> dict[str, bytes]:
    layers = make_layers(BLOCKS, num_layers=2, shape=(64, 512), seed=writer * 100_000 + index)
    return {name: as_bytes(t) for name, t in layers.items()}


class Writers:
    """Threads putting fresh chains until stopped; what was attempted and acknowledged."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.cond = threading.Condition()
        self.attempted: list[tuple[int, int]] = []
        self.acknowledged: list[tuple[int, int]] = []
        self.acked_since_restart = [0] * WRITERS
        self.stopped = False
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(w,), name=f"writer-{w}") for w in range(WRITERS)
        ]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        for t in self.threads:
            t.join()

    def _run(self, writer: int) -> None:
        index = 0
        try:
            while True:
                with self.cond:
                    if self.stopped:
                        return
                    address = self.daemon.address
                    self.attempted.append((writer, index))
                layers = make_layers(BLOCKS, num_layers=2, shape=(64, 512), seed=writer * 100_000 + index)
                try:
                    with KVStoreClient(address, timeout=10) as kv:
                        kv.put(NS, chain(f"w{writer}-{index}", BLOCKS), layers)
                except errors.KVStoreError:
                    with self.cond:  # the daemon is down or restarting: try the next put once it is back
                        self.cond.wait(0.2)
                else:
                    with self.cond:
                        self.acknowledged.append((writer, index))
                        self.acked_since_restart[writer] += 1
                        self.cond.notify_all()
                index += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self.errors.append(exc)

    def wait_for_progress(self) -> None:
        with self.cond:
            done = self.cond.wait_for(
                lambda: self.errors or min(self.acked_since_restart) >= PUTS_PER_CYCLE, timeout=120
            )
            assert done and not self.errors, self.errors
            self.acked_since_restart = [0] * WRITERS


def test_sigkill_loops_lose_no_acknowledged_block_and_show_no_torn_one(tmp_path: Path, backend: str) -> None:
    daemon = Daemon(tmp_path / "data", backend=backend).start()
    port = daemon.address.rpartition(":")[2]
    daemon.extra_args = ["--listen", f"127.0.0.1:{port}"]  # restarts come back on the same address
    try:
        with Writers(daemon) as writers:
            for _ in range(KILLS):
                writers.wait_for_progress()
                daemon.kill()
                daemon.start()
            writers.wait_for_progress()
        daemon.kill()
        daemon.start()
        checked = 0
        with KVStoreClient(daemon.address, timeout=30) as kv:
            for writer, index in writers.acknowledged:
                hashes = chain(f"w{writer}-{index}", BLOCKS)
                assert kv.lookup(NS, hashes) == BLOCKS, f"acknowledged put w{writer}-{index} lost blocks"
            attempted = {tuple(chain(f"w{w}-{i}", BLOCKS)): (w, i) for w, i in writers.attempted}
            known = {h for hashes in attempted for h in hashes}
            listed = list(kv.iter_blocks(NS))
            assert {b.block_hash for b in listed} <= known  # nothing the writers did not send
            for hashes, (writer, index) in attempted.items():
                got = kv.select(NS, list(hashes))
                if not got:
                    continue
                n = next(iter(got.values())).shape[0]
                want = expected_layers(writer, index)
                for name, tensor in got.items():
                    per_block = len(want[name]) // BLOCKS
                    assert as_bytes(tensor) == want[name][: n * per_block], (writer, index, name)
                checked += n
        acked_blocks = len(writers.acknowledged) * BLOCKS
        assert checked >= acked_blocks and checked == len(listed)
        print(
            f"\n[{backend}] {KILLS + 1} SIGKILLs, {len(writers.attempted)} puts sent, "
            f"{len(writers.acknowledged)} acknowledged ({acked_blocks} blocks, all there); "
            f"{checked} stored blocks checked bit-exact"
        )
    finally:
        daemon.stop()

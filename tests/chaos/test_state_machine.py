"""A state machine of the store against a plain dict, on the real daemon process.

The model is `{(namespace, hash): Block}`: what the store holds, each block with
the parent it was stored under and its bytes per layer. Hashes come from a tree
built by the test (each hash has one fixed parent), so no put can form a cycle,
and one hash may be stored in both namespaces (with different bytes).

Rules, in the order hypothesis picks, in one of two namespaces (mostly the one a
chain was put in): put_new (a new chain of 1-4 blocks), put_extend (1-4 blocks
below a known chain's tail, via the parent hash, resending up to 3 of its last
blocks first), lookup and select (a slice of a known chain; lookup also with
unknown hashes after it), drop_select (timeout 0 or 10 ms), evict_block (a block
and what is stored below it), evict_namespace_or_all, restart (SIGTERM + start)
and kill (SIGKILL + start); at most MAX_RESTARTS of the last two per example.
Every example runs its own daemon on a fresh data dir: MAX_EXAMPLES examples of
up to STEPS steps per backend (lmdb, disk).

What holds, after every rule:

- a put writes exactly the blocks the model lacks and skips the rest (a stored
  block keeps its first bytes and parent);
- lookup answers the model's stored prefix length; select returns the model's
  bytes of that prefix bit-exactly ({} on a miss);
- drop_select of a wholly stored list returns it bit-exactly and removes it;
  otherwise it raises StoreTimeout and changes nothing;
- evict by namespace / all removes exactly those blocks; by block, the block and
  its stored descendants (found through stored blocks only: below a block that
  was taken out of a chain, nothing is reached);
- a restart or a kill changes nothing: every acknowledged put, eviction and
  drop_select was committed;
- Stats (blocks, bytes, namespaces) and List (every key with its parent, size,
  layers and stored children) equal the model.

The capacity is far above what an example stores, so capacity eviction (LRU,
which the model does not predict) never happens.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from integration.helpers import NS, assert_same
from support.daemon import Daemon

from kvstore_client import KVStoreClient, errors

NAMESPACES = (f"{NS}-sm-a".encode(), f"{NS}-sm-b".encode())
# (name, dtype, per-block shape): two dtypes, so a layer mix-up shows in a compare
LAYERS: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = (
    ("layer.0", torch.float16, (2, 8)),
    ("layer.1", torch.bfloat16, (3, 4)),
)
LAYER_BYTES = tuple(2 * shape[0] * shape[1] for _, _, shape in LAYERS)
BLOCK_BYTES = sum(LAYER_BYTES)
CAPACITY = "256MiB"  # an example stores a few KiB: capacity eviction never runs
MAX_RESTARTS = 2  # restarts + kills per example: each costs a daemon start (~0.4 s)
MAX_EXAMPLES = 10
STEPS = 25

Hashes = tuple[bytes, ...]  # hashes from a chain's root down
Chain = tuple[bytes, Hashes]  # (the namespace it was put in, its path)
# mostly the chain's own namespace; at times the other one (a miss, or a put below an absent parent)
RARELY = st.sampled_from([False, False, False, True])


@dataclass(frozen=True)
class Block:
    parent: bytes
    rows: tuple[bytes, ...]  # one block's bytes per layer


def block_rows(namespace: bytes, block_hash: bytes, version: int) -> tuple[bytes, ...]:
    """Deterministic bytes, distinct per namespace, block and put (any bit pattern)."""
    rnd = random.Random(hashlib.sha256(namespace + block_hash + version.to_bytes(4, "little")).digest())
    return tuple(rnd.randbytes(n) for n in LAYER_BYTES)


def tensors(blocks: Sequence[tuple[bytes, ...]]) -> dict[str, torch.Tensor]:
    """{layer: [n, *shape]} of these blocks' rows."""
    out = {}
    for k, (name, dtype, shape) in enumerate(LAYERS):
        raw = bytearray(b"".join(rows[k] for rows in blocks))
        out[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(len(blocks), *shape)
    return out


class StoreMachine(RuleBasedStateMachine):
    """Subclassed per test with `backend` and `root` set; each example runs its own daemon
    on a fresh data dir under `root` (so nothing a faulty example left behind, even
    where the daemon's index does not see it, reaches the next one)."""

    backend: str
    root: Path
    started: list[Daemon]  # every daemon of the test, stopped at its end whatever happened
    chains = Bundle("chains")

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[tuple[bytes, bytes], Block] = {}
        self.parent_of: dict[bytes, bytes] = {}  # the hash tree: fixed for the whole example
        self.labels = 0
        self.puts = 0
        self.restarts = 0
        self.kv: KVStoreClient | None = None
        self.daemon = Daemon(self.root / f"data-{len(self.started)}", backend=self.backend, capacity=CAPACITY)
        self.started.append(self.daemon)

    # ---- helpers
    @property
    def client(self) -> KVStoreClient:
        assert self.kv is not None
        return self.kv

    def connect(self) -> None:
        if self.kv is not None:
            self.kv.close()
        self.kv = KVStoreClient(self.daemon.address, timeout=30)

    def new_hash(self, parent: bytes) -> bytes:
        self.labels += 1
        h = hashlib.sha256(b"sm-node" + parent + self.labels.to_bytes(4, "little")).digest()
        self.parent_of[h] = parent
        return h

    def prefix_len(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        for i, h in enumerate(hashes):
            if (ns, h) not in self.model:
                return i
        return len(hashes)

    def expected(self, ns: bytes, hashes: Sequence[bytes]) -> dict[str, torch.Tensor]:
        return tensors([self.model[(ns, h)].rows for h in hashes])

    def subtree(self, ns: bytes, block_hash: bytes) -> set[tuple[bytes, bytes]]:
        """The block (if stored) and the stored blocks below it, walking stored blocks only."""
        out = {(ns, block_hash)} & self.model.keys()
        stack = [block_hash]
        while stack:
            parent = stack.pop()
            for key, block in self.model.items():
                if key[0] == ns and block.parent == parent and key not in out:
                    out.add(key)
                    stack.append(key[1])
        return out

    def drop(self, keys: set[tuple[bytes, bytes]]) -> None:
        for key in keys:
            del self.model[key]

    @staticmethod
    def ns(chain: Chain, other: bool) -> bytes:
        return NAMESPACES[NAMESPACES.index(chain[0]) ^ other]

    @staticmethod
    def cut(path: Hashes, start: int, length: int) -> list[bytes]:
        start = min(start, len(path) - 1)
        return list(path[start : start + max(1, length)])

    # ---- rules
    @initialize()
    def start(self) -> None:
        self.daemon.start()
        self.connect()

    def do_put(self, ns: bytes, base: Hashes, resend: int, new: int) -> Chain:
        """Put `new` fresh blocks below `base`, resending its last `resend` blocks first."""
        resend = min(resend, len(base))
        new = min(max(new, 0 if resend else 1), 4 - resend)
        fresh: list[bytes] = []
        for _ in range(new):
            fresh.append(self.new_hash(fresh[-1] if fresh else (base[-1] if base else b"")))
        kept = len(base) - resend
        hashes = [*base[kept:], *fresh]
        parent = base[kept - 1] if kept else b""
        self.puts += 1
        rows = [block_rows(ns, h, self.puts) for h in hashes]
        result = self.client.put(ns, hashes, tensors(rows), parent_hash=parent)
        written = 0
        for h, r in zip(hashes, rows, strict=True):
            if (ns, h) not in self.model:
                self.model[(ns, h)] = Block(self.parent_of[h], r)
                written += 1
        assert (result.blocks_written, result.blocks_skipped) == (written, len(hashes) - written)
        assert result.bytes_written == written * BLOCK_BYTES
        assert result.blocks_evicted == 0
        return ns, (*base, *fresh)

    @rule(target=chains, ns=st.sampled_from(NAMESPACES), new=st.integers(1, 4))
    def put_new(self, ns: bytes, new: int) -> Chain:
        return self.do_put(ns, (), 0, new)

    @rule(target=chains, base=chains, other_ns=RARELY, resend=st.integers(0, 3), new=st.integers(0, 4))
    def put_extend(self, base: Chain, other_ns: bool, resend: int, new: int) -> Chain:
        return self.do_put(self.ns(base, other_ns), base[1], resend, new)

    @precondition(lambda self: self.model)
    @rule(
        known=chains,
        other_ns=RARELY,
        start=st.integers(0, 7),
        length=st.integers(1, 8),
        unknown=st.integers(0, 2),
    )
    def lookup(self, known: Chain, other_ns: bool, start: int, length: int, unknown: int) -> None:
        ns, hashes = self.ns(known, other_ns), self.cut(known[1], start, length)
        hashes += [hashlib.sha256(b"sm-never-stored" + bytes([i])).digest() for i in range(unknown)]
        n = self.prefix_len(ns, hashes)
        assert self.client.lookup(ns, hashes) == n

    @precondition(lambda self: self.model)
    @rule(known=chains, other_ns=RARELY, start=st.integers(0, 7), length=st.integers(1, 8))
    def select(self, known: Chain, other_ns: bool, start: int, length: int) -> None:
        ns, hashes = self.ns(known, other_ns), self.cut(known[1], start, length)
        n = self.prefix_len(ns, hashes)
        got = self.client.select(ns, hashes)
        if n == 0:
            assert got == {}
        else:
            assert_same(got, self.expected(ns, hashes[:n]))

    @precondition(lambda self: self.model)
    @rule(
        known=chains,
        other_ns=RARELY,
        start=st.integers(0, 7),
        length=st.integers(1, 8),
        timeout=st.sampled_from([0.0, 0.01]),
    )
    def drop_select(self, known: Chain, other_ns: bool, start: int, length: int, timeout: float) -> None:
        ns, hashes = self.ns(known, other_ns), self.cut(known[1], start, length)
        if self.prefix_len(ns, hashes) == len(hashes):
            assert_same(self.client.drop_select(ns, hashes, timeout=timeout), self.expected(ns, hashes))
            self.drop({(ns, h) for h in hashes})
        else:
            with pytest.raises(errors.StoreTimeout):
                self.client.drop_select(ns, hashes, timeout=timeout)

    @precondition(lambda self: self.model)
    @rule(known=chains, other_ns=RARELY, index=st.integers(0, 7))
    def evict_block(self, known: Chain, other_ns: bool, index: int) -> None:
        ns, block_hash = self.ns(known, other_ns), known[1][min(index, len(known[1]) - 1)]
        victims = self.subtree(ns, block_hash)
        result = self.client.evict(namespace=ns, block_hash=block_hash)
        assert (result.blocks_evicted, result.bytes_freed) == (len(victims), len(victims) * BLOCK_BYTES)
        self.drop(victims)

    @precondition(lambda self: self.model)
    @rule(ns=st.sampled_from([*NAMESPACES, None]))
    def evict_namespace_or_all(self, ns: bytes | None) -> None:
        victims = {key for key in self.model if ns is None or key[0] == ns}
        result = self.client.evict(namespace=ns) if ns is not None else self.client.evict(all=True)
        assert (result.blocks_evicted, result.bytes_freed) == (len(victims), len(victims) * BLOCK_BYTES)
        self.drop(victims)

    def bounce(self, sig: signal.Signals) -> None:
        """Stop the daemon with `sig`, start it on the same data dir, and read every block back."""
        self.restarts += 1
        self.client.close()
        self.kv = None
        rc = self.daemon.stop(sig)
        assert rc == (0 if sig == signal.SIGTERM else -sig)
        self.daemon.start()
        self.connect()
        for (ns, h), block in self.model.items():
            assert_same(self.client.select(ns, [h]), tensors([block.rows]))

    @precondition(lambda self: self.restarts < MAX_RESTARTS and self.model)
    @rule()
    def restart(self) -> None:
        self.bounce(signal.SIGTERM)

    @precondition(lambda self: self.restarts < MAX_RESTARTS and self.model)
    @rule()
    def kill(self) -> None:
        self.bounce(signal.SIGKILL)

    # ---- invariants
    @invariant()
    def stats_match(self) -> None:
        stats = self.client.stats()
        assert stats["blocks"] == len(self.model)
        assert stats["bytes_used"] == len(self.model) * BLOCK_BYTES
        assert stats["namespaces"] == len({ns for ns, _ in self.model})

    @invariant()
    def listing_matches(self) -> None:
        listed = {
            (b.namespace, b.block_hash): (b.parent_hash, b.size_bytes, b.num_layers, b.num_children)
            for b in self.client.iter_blocks()
        }
        children: dict[tuple[bytes, bytes], int] = {}
        for (ns, _), block in self.model.items():
            children[(ns, block.parent)] = children.get((ns, block.parent), 0) + 1
        want = {
            key: (block.parent, BLOCK_BYTES, len(LAYERS), children.get(key, 0))
            for key, block in self.model.items()
        }
        assert listed == want

    def teardown(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        self.daemon.stop()
        shutil.rmtree(self.daemon.data_dir, ignore_errors=True)  # its log stays beside it


def test_store_matches_a_dict_model(tmp_path: Path, backend: str) -> None:
    started: list[Daemon] = []
    machine = type(
        f"StoreMachineOn{backend.capitalize()}",
        (StoreMachine,),
        {"backend": backend, "root": tmp_path, "started": started},
    )
    try:
        run_state_machine_as_test(
            machine, settings=settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS)
        )
    finally:
        for d in started:
            d.stop()

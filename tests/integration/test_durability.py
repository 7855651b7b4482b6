"""Restarts, crashes and shutdown: what was acknowledged survives, nothing half-written shows.

Daemon processes throughout (SIGTERM, SIGKILL, restarts after them, start-up refusals).
What the backend's files must survive runs on both backends; signal handling on one."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.service import SERVICE_NAME
from kvstore_client import KVStoreClient, LayerSpec, errors
from kvstore_client.hashing import block_hashes

from .helpers import (
    NS,
    all_blocks,
    assert_same,
    both_backends,
    chain,
    drop_select_parked,
    make_layers,
    rows,
    wait_until_parked,
    write_config,
)


def _state(data_dir: Path) -> dict:
    return json.loads((data_dir / "STATE").read_text())


# ---- restart -------------------------------------------------------------------------
@both_backends
def test_restart_after_sigterm_keeps_everything(make_daemon) -> None:
    d = make_daemon()
    kept = {
        (NS, "bf16"): make_layers(4, dtype=torch.bfloat16, seed=40),
        (NS, "fp8"): make_layers(3, dtype=torch.float8_e4m3fn, seed=41),
        ("other", "fp32"): make_layers(2, dtype=torch.float32, seed=42),
    }
    keys = {k: chain(k[1], len(v[next(iter(v))]), namespace=k[0]) for k, v in kept.items()}
    consumed = chain("consumed", 2)
    evicted = chain("evicted", 3)

    with KVStoreClient(d.address, arena=False) as kv:
        for k, layers in kept.items():
            kv.put(k[0], keys[k], layers)
        kv.put(NS, consumed, make_layers(2))
        kv.drop_select(NS, consumed, timeout=1)
        kv.put(NS, evicted, make_layers(3))
        kv.evict(namespace=NS, block_hash=evicted[1])
        stats = kv.stats()
        listing = [
            (b.namespace, b.block_hash, b.parent_hash, b.size_bytes, b.created_at, b.num_children)
            for b in all_blocks(kv, page_size=3)
        ]
        described = {h: kv.describe(k[0], h) for k in kept for h in keys[k]}

    assert d.stop() == 0
    assert _state(d.data_dir)["clean"] is True
    d.start()

    with KVStoreClient(d.address, arena=False) as kv:
        for k, layers in kept.items():
            assert kv.lookup(k[0], keys[k]) == len(keys[k])
            assert_same(kv.select(k[0], keys[k]), layers)
        assert kv.lookup(NS, consumed) == 0
        assert kv.lookup(NS, evicted) == 1
        after = kv.stats()
        for field in ("blocks", "bytes_used", "namespaces", "capacity_bytes", "backend"):
            assert after[field] == stats[field], field
        assert [
            (b.namespace, b.block_hash, b.parent_hash, b.size_bytes, b.created_at, b.num_children)
            for b in all_blocks(kv, page_size=3)
        ] == listing
        for k in kept:
            for h in keys[k]:
                again = kv.describe(k[0], h)
                assert list(again.layers) == list(described[h].layers)  # specs and checksums
    log = d.log()
    assert f"loaded {stats['blocks']} blocks ({stats['bytes_used']} bytes) in 2 namespaces" in log
    assert "did not stop cleanly" not in log


# ---- SIGKILL while puts stream in --------------------------------------------------------
PUTTER = r"""
import hashlib, sys
import torch
from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes

address, namespace, blocks, per_put = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
SHAPE = (16, 256)  # float16: 8 KiB per block per layer
hashes = block_hashes(namespace, list(range(blocks * 16)), 16)

def content(block_hash, layer):
    return hashlib.shake_256(block_hash + bytes([layer])).digest(2 * SHAPE[0] * SHAPE[1])

# one block per message, so a put is many messages on the wire
with KVStoreClient(address, timeout=30, chunk_bytes=8192, arena=False) as kv:
    for start in range(0, blocks, per_put):
        part = hashes[start : start + per_put]
        layers = {
            f"layer.{l}": torch.frombuffer(bytearray(b"".join(content(h, l) for h in part)),
                                           dtype=torch.float16).reshape(len(part), *SHAPE)
            for l in range(2)
        }
        try:
            kv.put(namespace, part, layers, parent_hash=hashes[start - 1] if start else b"")
        except Exception as exc:
            print("failed", type(exc).__name__, flush=True)
            break
        print("committed", start + len(part), flush=True)
    else:
        print("finished", flush=True)
"""
KILL_AFTER = 40  # blocks committed before the daemon is killed
PER_PUT = 4
BLOCK_BYTES = 2 * 2 * 16 * 256


def _expected(block_hash: bytes, layer: int) -> bytes:
    return hashlib.shake_256(block_hash + bytes([layer])).digest(BLOCK_BYTES // 2)


@both_backends
def test_sigkill_during_puts_then_restart(tmp_path: Path, make_daemon, backend: str) -> None:
    d = make_daemon()
    total = 20000
    script = tmp_path / "putter.py"
    script.write_text(PUTTER)
    stderr = open(tmp_path / "putter.err", "w")  # noqa: SIM115 - closed below
    child = subprocess.Popen(
        [sys.executable, str(script), d.address, NS, str(total), str(PER_PUT)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    stderr.close()
    assert child.stdout is not None
    committed = 0
    try:
        for line in child.stdout:
            if line.startswith("committed"):
                committed = int(line.split()[1])
                if committed >= KILL_AFTER:
                    break
        assert committed >= KILL_AFTER, f"putter stopped early: {(tmp_path / 'putter.err').read_text()}"
        d.kill()  # SIGKILL, while the putter keeps streaming puts
        rest = child.stdout.read()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    for line in rest.splitlines():
        if line.startswith("committed"):  # acknowledged between our read and the kill
            committed = int(line.split()[1])
    assert rest.splitlines()[-1].startswith("failed"), rest  # the putter saw the daemon die
    assert committed < total

    d.start()
    assert "did not stop cleanly (process crash)" in d.log()
    hashes = block_hashes(NS, list(range(total * 16)), 16)
    with KVStoreClient(d.address, timeout=60, arena=False) as kv:
        n = kv.lookup(NS, hashes)
        # every acknowledged put survived; at most the one in flight may have landed too
        assert committed <= n <= committed + PER_PUT
        if backend == "lmdb":
            assert n % PER_PUT == 0  # one transaction per put: all of it or none
        listed = all_blocks(kv, page_size=16)
        assert {b.block_hash for b in listed} == set(hashes[:n])  # a prefix, no holes, nothing stray
        stats = kv.stats()
        assert stats["blocks"] == len(listed) == n
        assert stats["bytes_used"] == sum(b.size_bytes for b in listed) == n * BLOCK_BYTES

        got = kv.select(NS, hashes[:n])
        assert {name: t.shape[0] for name, t in got.items()} == {"layer.0": n, "layer.1": n}
        for layer, tensor in enumerate(got.values()):
            raw = tensor.view(torch.uint8).reshape(n, -1)
            for i in range(n):
                assert raw[i].numpy().tobytes() == _expected(hashes[i], layer), (i, layer)
        assert kv.stats()["checksum_failures"] == 0
    if backend == "disk":
        leftovers = [
            p for p in (d.data_dir / "blocks").rglob("*") if p.is_file() and p.suffix != ".safetensors"
        ]
        assert leftovers == []  # partial writes were cleared at start


@both_backends
@pytest.mark.parametrize("sync", [False, True], ids=["nosync", "sync"])
def test_unclean_stop_before_a_reboot(make_daemon, sync: bool) -> None:
    """After a crash and an OS restart, unsynced data is set aside; fsynced data is kept."""
    d = make_daemon(extra_args=["--sync"] if sync else [])
    hashes = chain("reboot", 3)
    layers = make_layers(3, seed=46)
    with KVStoreClient(d.address, arena=False) as kv:
        kv.put(NS, hashes, layers)
    d.kill()
    state = _state(d.data_dir)
    assert (state["clean"], state["sync"]) == (False, sync)
    # pretend the machine rebooted since that run
    (d.data_dir / "STATE").write_text(json.dumps({**state, "boot_id": "some-earlier-boot"}))

    d.start()
    with KVStoreClient(d.address, arena=False) as kv:
        if sync:
            assert_same(kv.select(NS, hashes), layers)
        else:
            assert kv.lookup(NS, hashes) == 0
            assert kv.stats()["blocks"] == 0
            aside = [p for p in d.data_dir.iterdir() if p.name.startswith("discarded-")]
            assert len(aside) == 1
            assert {p.name for p in aside[0].iterdir()} == {"lmdb" if d.backend == "lmdb" else "blocks"}
            assert "moved to" in d.log()
            # the store works normally from its fresh start
            kv.put(NS, hashes, layers)
            assert_same(kv.select(NS, hashes), layers)


# ---- shutdown ------------------------------------------------------------------------------
def test_sigterm_is_graceful(tmp_path: Path, make_daemon) -> None:
    config = write_config(tmp_path / "kvstore.toml", max_waiting_drop_selects=1, grace_seconds=60.0)
    d = make_daemon(extra_args=["--config", str(config)])
    absent = chain("never-put", 2)
    with KVStoreClient(d.address, timeout=5, arena=False) as kv:
        assert kv.health() == "SERVING"
        hashes = chain("graceful", 2)
        layers = make_layers(2, seed=43)
        kv.put(NS, hashes, layers)

        waiter, outcome = drop_select_parked(d.address, NS, absent, timeout=120.0)
        wait_until_parked(kv)
        with grpc.insecure_channel(d.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60
            )
            status = health_pb2.HealthCheckResponse.ServingStatus
            assert status.Name(next(watch).status) == "SERVING"
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            assert status.Name(next(watch).status) == "NOT_SERVING"
            watch.cancel()
        # far inside the 60 s grace: a waiting DropSelect is released, not waited for
        assert d.stop(timeout=20) == 0
        waiter.join(30)
        assert not waiter.is_alive()
        assert isinstance(outcome.get("error"), errors.StoreUnavailable), outcome
        with pytest.raises(errors.StoreUnavailable):
            kv.lookup(NS, hashes, timeout=2)

    log = d.log()
    shutting = log.index("NOT_SERVING, finishing in-flight calls")
    assert log.index("stopped cleanly") > shutting
    assert "ERROR" not in log
    assert _state(d.data_dir)["clean"] is True

    d.start()
    with KVStoreClient(d.address, arena=False) as kv:
        assert_same(kv.select(NS, hashes), layers)


_TGKILL = {"x86_64": 234, "aarch64": 131}


def _blocks_sigterm(pid: int, tid: int) -> bool:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() not in _TGKILL, reason="needs Linux tgkill")
def test_sigterm_cannot_get_lost_on_another_thread(make_daemon) -> None:
    """The kernel hands a process-directed SIGTERM to any thread that does not block it,
    mostly gRPC's C threads. Each must either block it or lead to a clean stop anyway."""
    d = make_daemon()
    with KVStoreClient(d.address, arena=False) as kv:  # let gRPC start all of its threads
        hashes = chain("tgkill", 2)
        kv.put(NS, hashes, rows(make_layers(2), 0, 2))
        assert kv.lookup(NS, hashes) == 2
    assert d.proc is not None
    pid = d.proc.pid
    others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert others
    exposed = [t for t in others if not _blocks_sigterm(pid, t)]
    if exposed:
        # deliver it to such a thread, as the kernel may; prefer a C thread (not named "python")
        exposed.sort(key=lambda t: Path(f"/proc/{pid}/task/{t}/comm").read_text().strip() == "python")
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(_TGKILL[platform.machine()], pid, exposed[0], signal.SIGTERM) == 0
    else:
        d.proc.send_signal(signal.SIGTERM)  # only the main thread can take it
    assert d.proc.wait(timeout=15) == 0
    assert "stopped cleanly" in d.log()
    assert d.stop() == 0


@both_backends
def test_second_daemon_on_the_same_data_dir_is_refused(make_daemon, tmp_path: Path, backend: str) -> None:
    first = make_daemon()
    with KVStoreClient(first.address, arena=False) as kv:
        hashes = chain("locked", 2)
        layers = make_layers(2, seed=44)
        kv.put(NS, hashes, layers)
    from support.daemon import Daemon

    second = Daemon(first.data_dir, backend=backend)
    with pytest.raises(RuntimeError, match="in use by another kvstore-server"):
        second.start()
    assert second.proc is not None and second.proc.returncode == 1
    second.proc.stdout.close()
    with KVStoreClient(first.address, arena=False) as kv:
        assert_same(kv.select(NS, hashes), layers)


def test_a_port_in_use_is_refused_in_one_line_naming_listen(tmp_path: Path) -> None:
    from support.daemon import Daemon

    with socket.socket() as held:  # another process's server, as far as the daemon can tell
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        d = Daemon(tmp_path / "data", extra_args=["--listen", listen])
        with pytest.raises(RuntimeError, match="did not start"):
            d.start()
    assert d.proc is not None and d.proc.returncode == 1
    d.proc.stdout.close()
    errors_logged = [line for line in d.log().splitlines() if " ERROR " in line or line.startswith("E")]
    assert len(errors_logged) == 1, d.log()
    assert errors_logged[0].endswith(
        f"ERROR kvstore_server: cannot listen on {listen}: the address is already in use "
        "(another kvstore-server?); choose another with --listen"
    )
    assert "GRPC_VERBOSITY" not in d.log()
    assert not (tmp_path / "data").exists()  # refused before the data directory was made


def test_sigterm_with_an_open_put_stream_stores_nothing_of_it(make_daemon) -> None:
    """An uncommitted put does not hold the daemon past its grace, and is not stored."""
    d = make_daemon(extra_args=["--grace-seconds", "1"])
    layers = make_layers(2, seed=45)
    hashes = chain("open-put", 2)
    with KVStoreClient(d.address, arena=False) as kv:
        stream = kv.put_stream(NS, hashes, [LayerSpec.of(n, t) for n, t in layers.items()])
        stream.write_layer("layer.0", layers["layer.0"])
        assert d.stop(timeout=20) == 0
        stream.write_layer("layer.1", layers["layer.1"])
        with pytest.raises(errors.KVStoreError):
            stream.commit()
    d.start()
    with KVStoreClient(d.address, arena=False) as kv:
        assert kv.lookup(NS, hashes) == 0
        assert kv.stats()["blocks"] == 0

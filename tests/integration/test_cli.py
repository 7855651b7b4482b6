"""kvstore-cli against a real server: every command, human and --json output, exit codes.

Blocks are stored with KVStoreClient; the CLI is driven through
kvstore_cli.main.main (stdout/stderr via capsys) against the in-process server, and
once as the installed `kvstore-cli` command against a daemon process.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support.daemon import Daemon
from support.inproc import InProcServer

from kvstore.service import SERVICE_NAME
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_cli.main import main
from kvstore_client import KVStoreClient, address
from kvstore_client.hashing import block_hashes

NS = "ns"
BIN_NS = b"\xff\x00bin"  # not UTF-8: rendered and given as 0x...
BIN_NS_ARG = "0x" + BIN_NS.hex()
BLOCK_SIZE = 4
LAYER_SHAPE = (2, 4)  # float16: 16 bytes per layer per block
BLOCK_BYTES = 2 * 2 * 4 * 2  # two layers
NOTHING_EVICTED = {"blocks_evicted": 0, "bytes_freed": 0}


@dataclass
class Stored:
    address: str
    chain: list[bytes]  # 8 blocks in NS, one chain
    bin_chain: list[bytes]  # 3 blocks in BIN_NS

    @property
    def total_blocks(self) -> int:
        return len(self.chain) + len(self.bin_chain)


def _layers(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn((num_blocks, *LAYER_SHAPE), generator=gen).to(torch.float16) for name in ("k", "v")
    }


def _put(address: str, namespace: str | bytes, num_blocks: int, seed: int = 0) -> list[bytes]:
    hashes = block_hashes(namespace, list(range(seed, seed + num_blocks * BLOCK_SIZE)), BLOCK_SIZE)
    with KVStoreClient(address) as client:
        result = client.put(namespace, hashes, _layers(num_blocks, seed))
    assert result.blocks_written == num_blocks
    return hashes


def _store(address: str) -> Stored:
    return Stored(address, _put(address, NS, 8), _put(address, BIN_NS, 3, seed=1))


@pytest.fixture
def stored(server: InProcServer) -> Stored:
    return _store(server.address)


def run(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str, str]:
    code = main(["--address", address, *args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> Any:
    code, out, err = run(capsys, address, "--json", *args)
    assert (code, err) == (0, "")
    return json.loads(out)


def _stats(address: str) -> dict[str, object]:
    with KVStoreClient(address) as client:
        return client.stats()


def _stored_prefix(address: str, namespace: str | bytes, hashes: list[bytes]) -> int:
    with KVStoreClient(address) as client:
        return client.lookup(namespace, hashes)


# ---- health ---------------------------------------------------------------------------
def test_health_serving(server: InProcServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, server.address, "health") == (0, "SERVING\n", "")
    assert run_json(capsys, server.address, "health") == {"address": server.address, "status": "SERVING"}


@pytest.fixture
def not_serving_address() -> Iterator[str]:
    """A gRPC server whose health service reports kvstore.v1.KVStore as NOT_SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait()


def test_health_not_serving_exits_1(not_serving_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, not_serving_address, "health") == (1, "NOT_SERVING\n", "")


# ---- stats ----------------------------------------------------------------------------
def test_stats_human(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, stored.address, "stats")
    assert (code, err) == (0, "")
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert table["blocks"] == str(stored.total_blocks)
    assert table["namespaces"] == "2"
    assert table["capacity"] == "1.0 GiB"
    used = stored.total_blocks * BLOCK_BYTES
    assert table["used"] == f"{used} B (<0.1%)"
    assert table["puts"] == "2"
    assert table["checksum failures"] == "0"
    assert re.fullmatch(r"\d+[smhd]( \d+[smhd])?", table["uptime"])
    # the memory tier's rows (the fixture's client saved through the arena)
    assert table["memory tier"] == f"{stored.total_blocks} blocks, {used} B"
    assert re.fullmatch(r"\d+\.\d KiB of 64\.0 MiB \(<?\d+\.\d%\)", table["memory used"]), table[
        "memory used"
    ]
    assert table["pinned"] == "0 B" and table["commits"] == "2"


def test_stats_human_through_the_arena(server: InProcServer, capsys: pytest.CaptureFixture[str]) -> None:
    hashes = block_hashes(NS, list(range(3 * BLOCK_SIZE)), BLOCK_SIZE)
    layers = {f"l{i}": torch.randn((3, *LAYER_SHAPE)).to(torch.float16) for i in range(2)}
    with KVStoreClient(server.address) as kv:  # arena=True by default: reserve, write, commit
        kv.put(NS, hashes, layers)
        assert kv.select(NS, hashes)  # a pin
    code, out, _ = run(capsys, server.address, "stats")
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert code == 0 and table["memory tier"].startswith("3 blocks, ")
    assert (table["commits"], table["memory hits"], table["pinned"]) == ("1", "3 blocks", "0 B")


def test_stats_human_without_a_memory_tier(make_server, capsys: pytest.CaptureFixture[str]) -> None:
    off = make_server("off", memory=0)
    table = dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in run(capsys, off.address, "stats")[1].splitlines()
    )
    assert table["memory tier"] == "off"


def test_stats_json(server: InProcServer, stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    stats = run_json(capsys, stored.address, "stats")
    assert isinstance(stats, dict)
    assert set(stats) == {f.name for f in pb.StatsResponse.DESCRIPTOR.fields}
    assert stats["blocks"] == stored.total_blocks
    assert stats["bytes_used"] == stored.total_blocks * BLOCK_BYTES
    assert stats["capacity_bytes"] == 1 << 30
    for key in ("blocks", "bytes_used", "capacity_bytes", "namespaces", "puts", "evictions"):
        assert type(stats[key]) is int, key
    assert isinstance(stats["uptime_seconds"], float)
    assert stats["backend"] == server.backend


def test_global_options_after_the_command(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["stats", "--address", stored.address, "--timeout", "5", "--json"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert json.loads(out)["blocks"] == stored.total_blocks


def test_an_address_without_a_port_means_the_daemons_port(
    server: InProcServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the in-process server stands for a daemon on the default port (50051 may be taken here)
    monkeypatch.setattr(address, "DEFAULT_PORT", int(server.address.rpartition(":")[2]))
    assert run(capsys, "127.0.0.1", "health") == (0, "SERVING\n", "")
    assert run_json(capsys, "127.0.0.1", "health")["address"] == server.address


def test_address_from_environment(
    server: InProcServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSTORE_ADDRESS", server.address)
    assert main(["health"]) == 0
    assert capsys.readouterr().out == "SERVING\n"


# ---- ls -------------------------------------------------------------------------------
def test_ls_human(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, stored.address, "ls")
    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split() == ["NAMESPACE", "HASH", "SIZE", "CHILDREN", "LAST", "ACCESS", "CREATED"]
    assert len(rows) == stored.total_blocks
    by_hash = {row.split()[1]: row.split() for row in rows}
    for h in stored.chain:
        assert h.hex() not in out  # shortened in human output
        row = by_hash[h.hex()[:16]]
        assert row[0] == NS
        assert row[2:4] == [str(BLOCK_BYTES), "B"]
    assert {by_hash[h.hex()[:16]][0] for h in stored.bin_chain} == {BIN_NS_ARG}
    last = by_hash[stored.chain[-1].hex()[:16]]
    assert last[4] == "0"  # no children: the chain's tail
    assert by_hash[stored.chain[0].hex()[:16]][4] == "1"
    assert all(" ago " in row for row in rows)


def test_ls_json(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = run_json(capsys, stored.address, "ls")
    assert isinstance(blocks, list)
    assert {b["hash"] for b in blocks} == {h.hex() for h in stored.chain + stored.bin_chain}
    by_hash = {b["hash"]: b for b in blocks}
    second = by_hash[stored.chain[1].hex()]
    assert second["namespace"] == NS
    assert second["parent_hash"] == stored.chain[0].hex()
    assert second["size_bytes"] == BLOCK_BYTES
    assert second["num_children"] == 1
    assert second["created_at"] <= second["last_access_at"]
    assert by_hash[stored.chain[0].hex()]["parent_hash"] == ""


@pytest.mark.parametrize("namespace", [NS, "0x" + NS.encode().hex()])
def test_ls_namespace(stored: Stored, capsys: pytest.CaptureFixture[str], namespace: str) -> None:
    blocks = run_json(capsys, stored.address, "ls", "--namespace", namespace)
    assert [b["hash"] for b in blocks] == sorted(h.hex() for h in stored.chain)  # (namespace, hash) order
    binary = run_json(capsys, stored.address, "ls", "--namespace", BIN_NS_ARG)
    assert {b["namespace"] for b in binary} == {BIN_NS_ARG}
    assert len(binary) == len(stored.bin_chain)
    assert run(capsys, stored.address, "ls", "--namespace", "empty") == (0, "no blocks stored\n", "")


def test_ls_limit(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, stored.address, "ls", "--limit", "5")
    assert code == 0
    assert len(out.splitlines()) == 1 + 5
    assert "first 5 blocks shown" in err
    # Exactly as many as stored: nothing more to announce.
    code, out, err = run(capsys, stored.address, "ls", "--limit", str(stored.total_blocks))
    assert (code, err) == (0, "")
    assert len(out.splitlines()) == 1 + stored.total_blocks
    assert len(run_json(capsys, stored.address, "ls", "--limit", "3")) == 3


def test_ls_pages_through_the_store(server: InProcServer, capsys: pytest.CaptureFixture[str]) -> None:
    # More blocks than one List page (1000): one put of small one-layer blocks.
    count = 1100
    hashes = block_hashes("many", list(range(count)), 1)
    with KVStoreClient(server.address) as client:
        client.put("many", hashes, {"x": torch.zeros((count, 1), dtype=torch.uint8)})
    everything = run_json(capsys, server.address, "ls", "--limit", "0")
    assert [b["hash"] for b in everything] == sorted(h.hex() for h in hashes)
    across = run_json(capsys, server.address, "ls", "--namespace", "many", "--limit", "1050")
    assert [b["hash"] for b in across] == [b["hash"] for b in everything[:1050]]
    code, out, err = run(capsys, server.address, "ls")
    assert code == 0
    assert len(out.splitlines()) == 1 + 100  # the default limit
    assert "first 100 blocks shown" in err


# ---- show -----------------------------------------------------------------------------
def test_show_human(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    block = stored.chain[3]
    code, out, err = run(capsys, stored.address, "show", block.hex(), "--namespace", NS)
    assert (code, err) == (0, "")
    fields_text, layer_text = out.split("\n\n")
    fields = {line[:12].strip(): line[12:].strip() for line in fields_text.splitlines()}
    assert fields["namespace"] == NS
    assert fields["hash"] == block.hex()
    assert fields["parent"] == stored.chain[2].hex()
    assert fields["size"] == f"{BLOCK_BYTES} B ({BLOCK_BYTES} bytes)"
    assert fields["layers"] == "2"
    assert fields["children"] == "1"
    assert fields["created"].endswith(" ago)")
    header, *rows = layer_text.splitlines()
    assert header.split() == ["LAYER", "DTYPE", "SHAPE", "BYTES", "CHECKSUM"]
    with KVStoreClient(stored.address) as client:
        described = client.describe(NS, block)
    for row, layer in zip(rows, described.layers, strict=True):
        assert row.split() == [layer.spec.name, "float16", "[2,", "4]", "16", "B", f"{layer.checksum:016x}"]


def test_show_json(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    first = stored.bin_chain[0]
    info = run_json(capsys, stored.address, "show", first.hex(), "--namespace", BIN_NS_ARG)
    assert isinstance(info, dict)
    assert info["namespace"] == BIN_NS_ARG
    assert info["hash"] == first.hex()
    assert info["parent_hash"] == ""
    assert info["num_layers"] == 2
    assert info["num_children"] == 1
    assert [(la["name"], la["dtype"], la["shape"], la["nbytes"]) for la in info["layers"]] == [
        ("k", "float16", [2, 4], 16),
        ("v", "float16", [2, 4], 16),
    ]
    assert all(len(la["checksum"]) == 16 for la in info["layers"])


def test_show_unknown_block(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, stored.address, "show", stored.chain[0].hex(), "--namespace", "other")
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert "NOT_FOUND" in err
    assert stored.chain[0].hex() in err


def test_show_and_evict_take_the_short_hash_ls_prints(
    stored: Stored, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = run_json(capsys, stored.address, "ls", "--namespace", NS)
    code, out, _ = run(capsys, stored.address, "ls", "--namespace", NS)
    short = out.splitlines()[1].split()[1]  # the first row's HASH column
    assert len(short) == 16 and listed[0]["hash"].startswith(short)
    assert run_json(capsys, stored.address, "show", short, "--namespace", NS)["hash"] == listed[0]["hash"]
    prefix = stored.chain[5].hex()[:12].upper()  # any case, any length from 4
    assert (
        run_json(capsys, stored.address, "show", prefix, "--namespace", NS)["hash"] == stored.chain[5].hex()
    )
    result = run_json(capsys, stored.address, "evict", "--block", prefix, "--namespace", NS)
    assert result == {"blocks_evicted": 3, "bytes_freed": 3 * BLOCK_BYTES}
    assert _stored_prefix(stored.address, NS, stored.chain) == 5


def _put_hashes(address: str, namespace: str, hashes: list[bytes]) -> None:
    with KVStoreClient(address) as client:
        client.put(namespace, hashes, _layers(len(hashes), 7))


def test_a_hash_prefix_of_several_blocks_names_them(
    server: InProcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    twins = [bytes.fromhex("abcd01") + bytes(29), bytes.fromhex("abcd02") + bytes(29)]
    _put_hashes(server.address, NS, twins)
    code, out, err = run(capsys, server.address, "show", "abcd", "--namespace", NS)
    assert (code, out) == (1, "")
    assert err.count("\n") == 1
    assert "names several blocks" in err and "give more digits" in err
    assert twins[0].hex()[:16] in err and twins[1].hex()[:16] in err
    assert run_json(capsys, server.address, "show", "abcd02", "--namespace", NS)["hash"] == twins[1].hex()
    code, _, err = run(capsys, server.address, "evict", "--block", "abcd", "--namespace", NS)
    assert code == 1 and "names several blocks" in err
    assert _stats(server.address)["blocks"] == 2  # nothing evicted


def test_an_unknown_hash_prefix_says_so(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    taken = {h.hex()[:4] for h in stored.chain}
    free = next(f"{i:04x}" for i in range(1 << 16) if f"{i:04x}" not in taken)
    code, out, err = run(capsys, stored.address, "show", free, "--namespace", NS)
    assert (code, out) == (1, "")
    assert f"no block in namespace {NS} has a hash starting with {free}" in err
    # in a namespace that holds nothing, the namespaces it may have meant
    code, _, err = run(capsys, stored.address, "show", free, "--namespace", "nss")
    assert code == 1 and "namespace nss holds no blocks; did you mean ns?" in err


def test_a_hash_prefix_is_found_past_the_first_page(
    server: InProcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    count = 1100  # more than one List page (1000)
    hashes = block_hashes("many", list(range(count)), 1)
    with KVStoreClient(server.address) as client:
        client.put("many", hashes, {"x": torch.zeros((count, 1), dtype=torch.uint8)})
    last = max(hashes)  # listed last, on the second page
    info = run_json(capsys, server.address, "show", last.hex()[:16], "--namespace", "many")
    assert info["hash"] == last.hex()


# ---- evict ----------------------------------------------------------------------------
def test_evict_of_a_namespace_that_holds_nothing_exits_1_naming_close_ones(
    stored: Stored, capsys: pytest.CaptureFixture[str]
) -> None:
    connector = "kvc2|org/model|bfloat16|bs4|kvh2|hd64|mha|cpu"
    _put_hashes(stored.address, connector + "|pp0of1", [bytes(32)])
    code, out, err = run(capsys, stored.address, "evict", "--namespace", "nss")
    assert (code, out) == (1, "evicted 0 blocks, freed 0 B\n")
    assert err == "kvstore-cli: namespace nss holds no blocks; did you mean ns?\n"
    # a connector namespace pasted without its stage suffix: the one with it first
    code, _, err = run(capsys, stored.address, "evict", "--namespace", connector)
    assert code == 1 and f"did you mean '{connector}|pp0of1'" in err
    # nothing like it: a few of the stored namespaces
    code, out, err = run(capsys, stored.address, "--json", "evict", "--namespace", "zzzzzzzz")
    assert (code, json.loads(out)) == (1, NOTHING_EVICTED)
    assert f"the namespaces stored are '{connector}|pp0of1', ns, {BIN_NS_ARG} (kvstore-cli ls)" in err
    assert _stats(stored.address)["blocks"] == stored.total_blocks + 1


def test_evict_namespace(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, stored.address, "evict", "--namespace", NS)
    assert (code, err) == (0, "")
    assert out == f"evicted 8 blocks, freed {8 * BLOCK_BYTES} B\n"
    assert _stored_prefix(stored.address, NS, stored.chain) == 0
    assert _stored_prefix(stored.address, BIN_NS, stored.bin_chain) == 3
    result = run_json(capsys, stored.address, "evict", "--namespace", BIN_NS_ARG)
    assert result == {"blocks_evicted": 3, "bytes_freed": 3 * BLOCK_BYTES}


def test_evict_block_and_descendants(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, stored.address, "evict", "--block", stored.chain[5].hex(), "--namespace", NS)
    assert result == {"blocks_evicted": 3, "bytes_freed": 3 * BLOCK_BYTES}
    assert _stored_prefix(stored.address, NS, stored.chain) == 5
    code, out, _ = run(capsys, stored.address, "evict", "--block", stored.chain[7].hex(), "--namespace", NS)
    assert (code, out) == (0, "evicted 0 blocks, freed 0 B\n")  # already gone


def test_evict_older_than(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_json(capsys, stored.address, "evict", "--older-than", "7d") == NOTHING_EVICTED
    code, out, _ = run(capsys, stored.address, "evict", "--older-than", "90s")
    assert (code, out) == (0, "evicted 0 blocks, freed 0 B\n")
    # Every block was last used before now.
    result = run_json(capsys, stored.address, "evict", "--older-than", "0")
    assert result == {"blocks_evicted": stored.total_blocks, "bytes_freed": stored.total_blocks * BLOCK_BYTES}


def test_evict_down_to(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_json(capsys, stored.address, "evict", "--down-to", "10GiB") == NOTHING_EVICTED
    target = 5 * BLOCK_BYTES
    code, out, err = run(capsys, stored.address, "evict", "--down-to", f"{target}B")
    assert (code, err) == (0, "")
    freed = (stored.total_blocks - 5) * BLOCK_BYTES
    assert out == f"evicted {stored.total_blocks - 5} blocks, freed {freed} B\n"
    assert _stats(stored.address)["bytes_used"] == target


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_evict_all_refused_without_a_terminal(
    stored: Stored, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped input is no confirmation
    code, out, err = run(capsys, stored.address, "evict", "--all")
    assert (code, out) == (1, "")
    assert "--yes" in err
    assert _stats(stored.address)["blocks"] == stored.total_blocks


@pytest.mark.parametrize("answer", ["n\n", "\n", ""])
def test_evict_all_declined(
    stored: Stored, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal(answer))
    code, out, err = run(capsys, stored.address, "evict", "--all")
    assert (code, out) == (1, "")
    assert "Evict every block? [y/N]" in err
    assert _stats(stored.address)["blocks"] == stored.total_blocks


def test_evict_all_confirmed(
    stored: Stored, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code, out, err = run(capsys, stored.address, "evict", "--all")
    assert code == 0
    assert "Evict every block? [y/N]" in err
    assert out == f"evicted {stored.total_blocks} blocks, freed {stored.total_blocks * BLOCK_BYTES} B\n"
    assert _stats(stored.address)["blocks"] == 0


def test_evict_all_yes(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, stored.address, "evict", "--all", "--yes")
    assert result == {"blocks_evicted": stored.total_blocks, "bytes_freed": stored.total_blocks * BLOCK_BYTES}
    assert run(capsys, stored.address, "ls") == (0, "no blocks stored\n", "")


# ---- the installed command --------------------------------------------------------------
def _installed_cli() -> str:
    found = shutil.which("kvstore-cli") or str(Path(sys.executable).parent / "kvstore-cli")
    assert os.access(found, os.X_OK), "kvstore-cli is not installed; run `pip install -e .`"
    return found


def test_installed_command(daemon: Daemon) -> None:
    stored = _store(daemon.address)
    proc = subprocess.run(
        [_installed_cli(), "--address", stored.address, "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    stats = json.loads(proc.stdout)
    assert stats["blocks"] == stored.total_blocks
    assert stats["capacity_bytes"] == 1 << 30


# ---- failures without a daemon ------------------------------------------------------------
@pytest.fixture
def refused_address() -> Iterator[str]:
    """A port that is bound but not listening: connecting is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("command", [["health"], ["stats"], ["ls"], ["evict", "--namespace", "ns"]])
def test_unreachable_daemon_exits_2(
    refused_address: str, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    code, out, err = run(capsys, refused_address, "--timeout", "5", *command)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert f"daemon at {refused_address} is unreachable" in err


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["--timeout", "0", "stats"],
        ["ls", "--limit", "-1"],
        ["ls", "--namespace", "0xzz"],
        ["show", "abc", "--namespace", "ns"],  # a prefix needs 4 digits
        ["show", "abcz", "--namespace", "ns"],
        ["show", "ab" * 32],
        ["evict"],
        ["evict", "--all", "--namespace", "ns"],
        ["evict", "--older-than", "1h", "--down-to", "1GiB"],
        ["evict", "--block", "ab" * 32],
        ["evict", "--older-than", "soon"],
        ["evict", "--down-to", "lots"],
        ["evict", "--down-to", "-1GiB"],
        ["--address", "localhost:http", "stats"],
    ],
)
def test_usage_errors_exit_2(
    refused_address: str, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    # Refused before any call: the (unreachable) address is never contacted.
    code, out, err = run(capsys, refused_address, *args)
    assert (code, out) == (2, "")
    assert "error:" in err
    assert "unreachable" not in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("health", "stats", "ls", "show", "evict"):
        assert command in out
    assert main(["evict", "--help"]) == 0
    assert "--older-than DURATION" in capsys.readouterr().out

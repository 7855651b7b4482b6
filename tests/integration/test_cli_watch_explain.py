"""kvstore-cli watch and explain against a real server, through kvstore_cli.main.main
(the in-process server), and `watch` as the installed command against a daemon process:
interrupted by Ctrl-C, and seeing the daemon shut down on SIGTERM."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.daemon import Daemon
from support.inproc import InProcServer

from kvstore_cli.main import main
from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes

NS = "cli-ns"
BLOCK = 4  # tokens per block in these tests
PROMPT = list(range(1000, 1000 + 6 * BLOCK + 2))  # six full blocks and two tokens more


def layers(n: int) -> dict[str, torch.Tensor]:
    return {"k": torch.zeros((n, 2, 4), dtype=torch.float16), "v": torch.ones((n, 2, 4), dtype=torch.float16)}


def run(capsys: pytest.CaptureFixture[str], address: str, *args: str) -> tuple[int, str, str]:
    code = main(["--address", address, *args])
    out, err = capsys.readouterr()
    return code, out, err


# ---- watch ------------------------------------------------------------------------------
def _make_events(address: str) -> list[bytes]:
    hashes = block_hashes(NS, PROMPT, BLOCK)
    with KVStoreClient(address) as kv:
        kv.put(NS, hashes[:3], layers(3))  # 1 stored
        kv.put("other", hashes[:1], layers(1))  # 2 stored, another namespace
        kv.evict(namespace=NS, block_hash=hashes[2])  # 3 removed
    return hashes


def test_watch_json_replays_and_stops_after_count(
    server: InProcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    hashes = _make_events(server.address)
    code, out, err = run(capsys, server.address, "watch", "--json", "--from", "1", "--count", "3")
    assert (code, err) == (0, "")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["sequence"], e["kind"], e["namespace"]) for e in lines] == [
        (1, "stored", NS), (2, "stored", "other"), (3, "removed", NS),
    ]  # fmt: skip
    assert lines[0]["block_hashes"] == [h.hex() for h in hashes[:3]]
    assert lines[0]["parent_hashes"] == ["", hashes[0].hex(), hashes[1].hex()]
    assert lines[2]["block_hashes"] == [hashes[2].hex()] and lines[2]["parent_hashes"] == []
    assert len({e["store_id"] for e in lines}) == 1
    assert all(isinstance(e["timestamp"], float) for e in lines)


def test_watch_human_lines_and_namespace_filter(
    server: InProcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    hashes = _make_events(server.address)
    code, out, err = run(capsys, server.address, "watch", "--from", "1", "--namespace", NS, "--count", "2")
    assert code == 0
    assert err.startswith(f"watching {server.address} (store ") and "from sequence 1" in err
    first, second = out.splitlines()
    short = [h.hex()[:16] for h in hashes]
    assert first.split("  ")[0] == "1" and second.split("  ")[0] == "3"
    assert f"stored   {NS}  3 blocks  {short[0]}..{short[2]}" in first
    assert f"removed  {NS}  1 block  {short[2]}" in second


def test_watch_from_a_lost_sequence_exits_1(server: InProcServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, server.address, "watch", "--from", "5")
    assert (code, out) == (1, "")
    assert "OUT_OF_RANGE" in err and "resync" in err


def test_installed_watch_prints_events_until_ctrl_c(daemon: Daemon) -> None:
    cli = shutil.which("kvstore-cli") or str(Path(sys.executable).parent / "kvstore-cli")
    proc = subprocess.Popen(
        [cli, "--address", daemon.address, "watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        # printed once the daemon holds the subscription: what happens next is seen
        assert proc.stderr.readline().startswith("watching ")
        hashes = block_hashes(NS, PROMPT, BLOCK)
        with KVStoreClient(daemon.address) as kv:
            kv.put(NS, hashes[:2], layers(2))
        line = proc.stdout.readline()
        assert line.startswith("1  ") and f"stored   {NS}  2 blocks" in line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr.read() == ""  # quietly: no traceback
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_installed_watch_reports_the_daemon_shutting_down(daemon: Daemon) -> None:
    cli = shutil.which("kvstore-cli") or str(Path(sys.executable).parent / "kvstore-cli")
    proc = subprocess.Popen(
        [cli, "--address", daemon.address, "watch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline().startswith("watching ")
        assert daemon.stop() == 0
        assert proc.wait(timeout=30) == 1
        out, err = proc.communicate()
        assert out == ""
        assert "the watch ended after 0 events: UNAVAILABLE: the daemon is shutting down" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---- explain ----------------------------------------------------------------------------
@pytest.fixture
def broken_chain(server: InProcServer) -> list[bytes]:
    """PROMPT's blocks 0, 1, 3 and 5 stored in NS: the chain breaks at block 2."""
    hashes = block_hashes(NS, PROMPT, BLOCK)
    with KVStoreClient(server.address) as kv:
        kv.put(NS, hashes[:2], layers(2))
        kv.put(NS, [hashes[3]], layers(1), parent_hash=hashes[2])
        kv.put(NS, [hashes[5]], layers(1), parent_hash=hashes[4])
    return hashes


def test_explain_shows_hits_the_break_and_what_lies_behind_it(
    server: InProcServer, broken_chain: list[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, PROMPT)))
    code, out, err = run(capsys, server.address, "explain", "--namespace", NS, "--block-size", str(BLOCK),
                         str(prompt))  # fmt: skip
    assert (code, err) == (0, "")
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (str(i), f"{i * BLOCK}-{i * BLOCK + BLOCK - 1}", broken_chain[i].hex()[:16]) for i in range(6)
    ]
    statuses = [" ".join(r[3:]) for r in rows]
    assert statuses == [
        "hit",
        "hit",
        "MISS <- the chain breaks here",
        "stored, unreachable (behind the break)",
        "missing",
        "stored, unreachable (behind the break)",
    ]
    assert "26: 6 full blocks + 2 in a partial block, never stored" in out
    assert out.rstrip().endswith("2 of 6 full blocks hit = 8 tokens reusable")


def test_explain_json_from_stdin(
    server: InProcServer,
    broken_chain: list[bytes],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(PROMPT)))
    code, out, err = run(capsys, server.address, "--json", "explain", "--namespace", NS, "--block-size", "4")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert {k: v for k, v in doc.items() if k != "blocks"} == {
        "namespace": NS,
        "hash_root": NS,
        "block_size": 4,
        "num_tokens": 26,
        "full_blocks": 6,
        "hit_blocks": 2,
        "break_at": 2,
        "max_reusable_blocks": 6,
        "reusable_blocks": 2,
        "reusable_tokens": 8,
        "hints": [],
    }
    assert doc["blocks"][3] == {
        "index": 3, "first_token": 12, "last_token": 15, "hash": broken_chain[3].hex(),
        "status": "unreachable",
    }  # fmt: skip
    statuses = [b["status"] for b in doc["blocks"]]
    assert statuses == ["hit", "hit", "miss", "unreachable", "missing", "unreachable"]


def test_explain_a_fully_stored_prompt_leaves_one_token_to_compute(
    server: InProcServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = PROMPT[: 3 * BLOCK]  # exactly three blocks, all stored
    with KVStoreClient(server.address) as kv:
        kv.put(NS, block_hashes(NS, prompt, BLOCK), layers(3))
    monkeypatch.setattr(sys, "stdin", io.StringIO(",".join(map(str, prompt))))
    code, out, _ = run(capsys, server.address, "explain", "--namespace", NS, "--block-size", "4", "-")
    assert code == 0
    assert out.rstrip().endswith(
        "3 of 3 full blocks hit = 8 tokens reusable "
        "(2 blocks: a prompt reuses at most the blocks that leave one token to compute)"
    )
    assert "MISS" not in out


def test_explain_derives_root_and_block_size_of_a_connector_namespace(
    server: InProcServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstore_connector.config import NamespaceInfo

    info = NamespaceInfo("org/model", "bfloat16", 8, 2, 64, False, "cpu", tp_size=2, pp_size=1)
    rank1 = info.namespace(0)
    prompt = list(range(3 * 8 + 1))
    # what the connector stores: hashed from the root, kept per pipeline stage
    hashes = block_hashes(info.hash_root, prompt, info.block_size)
    with KVStoreClient(server.address) as kv:
        kv.put(rank1, hashes, layers(3))
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(prompt))
    args = ["--json", "explain", "--namespace", rank1.decode(), str(path)]
    doc = json.loads(run(capsys, server.address, *args)[1])
    assert (doc["hash_root"], doc["block_size"]) == (info.hash_root, 8)
    assert (doc["hit_blocks"], doc["reusable_tokens"]) == (3, 24)
    code, out, _ = run(capsys, server.address, "explain", "--namespace", rank1.decode(), str(path))
    assert code == 0 and "stage suffix is not part of the root" in out
    # an explicit root wins: hashed from the namespace itself, nothing matches
    doc = json.loads(
        run(capsys, server.address, "--json", "explain", "--namespace", rank1.decode(),
            "--hash-root", rank1.decode(), str(path))[1]
    )  # fmt: skip
    assert (doc["hash_root"], doc["hit_blocks"], doc["break_at"]) == (rank1.decode(), 0, 0)


def test_explain_hints_at_the_block_size_when_nothing_of_the_prompt_is_stored(
    server: InProcServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = list(range(5000, 5000 + 64))
    with KVStoreClient(server.address) as kv:  # stored with 16 tokens per block (as the README's client)
        kv.put(NS, block_hashes(NS, prompt, 16), layers(4))
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(map(str, prompt)))
    code, out, err = run(capsys, server.address, "explain", "--namespace", NS, str(path))
    assert (code, err) == (0, "")
    hint = out.rstrip().splitlines()[-1]
    assert hint.startswith("hint: none of the prompt's 2 blocks is stored, but namespace cli-ns holds blocks")
    assert "this used 32 tokens per block (the default; --block-size N sets it)" in hint
    doc = json.loads(run(capsys, server.address, "--json", "explain", "--namespace", NS, str(path))[1])
    assert doc["hit_blocks"] == 0 and len(doc["hints"]) == 1 and "another block size" in doc["hints"][0]
    # with the writer's block size: every block hits, no hint
    code, out, _ = run(capsys, server.address, "explain", "--namespace", NS, "--block-size", "16", str(path))
    assert code == 0 and "hint:" not in out and "4 of 4 full blocks hit" in out
    # a prompt shorter than one block
    path.write_text("1 2 3")
    out = run(capsys, server.address, "explain", "--namespace", NS, str(path))[1]
    assert "hint: the prompt's 3 tokens fill no block of 32 tokens (the default;" in out


def test_explain_names_the_namespaces_a_missing_one_may_mean(
    server: InProcServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstore_connector.config import NamespaceInfo

    info = NamespaceInfo("org/model", "bfloat16", 8, 2, 64, False, "cpu", tp_size=1, pp_size=1)
    stage = info.namespace(0).decode()
    prompt = list(range(3 * 8 + 1))
    with KVStoreClient(server.address) as kv:
        kv.put(stage, block_hashes(info.hash_root, prompt, 8), layers(3))
        kv.put(NS, block_hashes(NS, PROMPT, BLOCK), layers(6))
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps(prompt))
    # a typo
    out = run(capsys, server.address, "explain", "--namespace", "cli-sn", str(path))[1]
    assert out.rstrip().splitlines()[-1] == "hint: namespace cli-sn holds no blocks; did you mean cli-ns?"
    # the connector's namespace without its |ppRofN: hashed with its bsN all the same
    suffixless = stage.rpartition("|")[0]
    doc = json.loads(
        run(capsys, server.address, "--json", "explain", "--namespace", suffixless, str(path))[1]
    )
    assert (doc["block_size"], doc["hash_root"], doc["hit_blocks"]) == (8, info.hash_root, 0)
    assert doc["hints"] == [f"namespace '{suffixless}' holds no blocks; did you mean '{stage}'?"]
    doc = json.loads(run(capsys, server.address, "--json", "explain", "--namespace", stage, str(path))[1])
    assert (doc["hit_blocks"], doc["hints"]) == (3, [])


@pytest.mark.parametrize(
    ("stdin", "args", "message"),
    [
        ("1 2 x", [], "stdin: not a token id: 'x'"),
        ("", [], "stdin: no token ids given"),
        ("1 2 3", ["/nonexistent/prompt.txt"], "cannot read /nonexistent/prompt.txt"),
        ("1 2 3", ["--block-size", "0"], "must be a positive integer"),
    ],
)
def test_explain_usage_errors_exit_2(
    server: InProcServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stdin: str,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, out, err = run(capsys, server.address, "explain", "--namespace", NS, *args)
    assert (code, out) == (2, "")
    assert message in err


def test_help_lists_the_new_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "watch" in out and "explain" in out
    assert main(["explain", "--help"]) == 0
    assert "--hash-root ROOT" in capsys.readouterr().out

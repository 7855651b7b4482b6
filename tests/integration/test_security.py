"""Auth (tokens, roles, tenants) and TLS on a real server (in-process, with the token file
and certificates of its config), and what the daemon refuses at start or allows by flag
(the safe-default bind check, --insecure, a bad token file: daemon processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from support.daemon import Daemon
from support.inproc import InProcServer
from support.pki import make_pki

from kvstore.service import SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, errors
from kvstore_client.hashing import block_hashes

TOKENS = {
    "a-reader": ("team-a", "reader"),
    "a-writer": ("team-a", "writer"),
    "a-admin": ("team-a", "admin"),
    "b-writer": ("team-b", "writer"),
    "b-admin": ("team-b", "admin"),
}


def token(name: str) -> str:
    return f"{name}-token-0123456789abcdef"


def token_file(path: Path) -> Path:
    """Write TOKENS as a daemon token file at `path`."""
    path.write_text(
        "".join(
            f'[[tokens]]\ntoken = "{token(name)}"\ntenant = "{tenant}"\nrole = "{role}"\n\n'
            for name, (tenant, role) in TOKENS.items()
        )
    )
    return path


@pytest.fixture
def secured(tmp_path: Path, make_server) -> InProcServer:
    return make_server(token_file=token_file(tmp_path / "tokens.toml"))


def layers(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn((n, 2, 8), generator=g).to(torch.bfloat16) for i in range(2)}


HASHES = block_hashes("chat", list(range(96)), 32)

# every KVStore RPC, called raw, with a well-formed request
CALLS = {
    "Lookup": ("unary_unary", pb.LookupRequest(namespace=b"chat", block_hashes=HASHES)),
    "Get": ("unary_stream", pb.GetRequest(namespace=b"chat", block_hashes=HASHES)),
    "DropSelect": ("unary_stream", pb.DropSelectRequest(namespace=b"chat", block_hashes=HASHES)),
    "Evict": ("unary_unary", pb.EvictRequest(namespace=b"chat")),
    "Stats": ("unary_unary", pb.StatsRequest()),
    "List": ("unary_unary", pb.ListRequest()),
    "Describe": ("unary_unary", pb.DescribeRequest(namespace=b"chat", block_hash=HASHES[0])),
    "Watch": ("unary_stream", pb.WatchRequest()),
    "LocalAccess": ("unary_unary", pb.LocalAccessRequest()),
    "Put": ("stream_unary", iter([pb.PutRequest(header=pb.PutHeader(namespace=b"chat"))])),
}


def raw_call(address: str, method: str, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    kind, request = CALLS[method]
    with grpc.insecure_channel(address) as channel:
        stub = getattr(channel, kind)(SERVICE_PREFIX + method, lambda m: m.SerializeToString(),
                                      lambda b: b)  # fmt: skip
        try:
            result = stub(request, timeout=10, metadata=metadata)
            if kind == "unary_stream":
                next(iter(result))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", sorted(CALLS))
def test_every_rpc_needs_a_valid_token(secured: InProcServer, method: str) -> None:
    assert raw_call(secured.address, method, []) == grpc.StatusCode.UNAUTHENTICATED
    wrong = [("authorization", "Bearer not-a-known-token-at-all")]
    assert raw_call(secured.address, method, wrong) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("name", "method", "allowed"),
    [
        ("a-reader", "Put", False),
        ("a-reader", "DropSelect", False),
        ("a-reader", "Evict", False),
        ("a-writer", "Evict", False),
        ("a-admin", "Evict", True),
        ("a-reader", "Lookup", True),
    ],
)
def test_roles_limit_what_a_token_may_call(
    secured: InProcServer, name: str, method: str, allowed: bool
) -> None:
    code = raw_call(secured.address, method, [("authorization", f"Bearer {token(name)}")])
    assert (code != grpc.StatusCode.PERMISSION_DENIED) == allowed
    assert code != grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_for_load_balancers(secured: InProcServer) -> None:
    with KVStoreClient(secured.address) as kv:
        assert kv.health() == "SERVING"


def test_a_token_file_with_a_tenant_name_outside_the_rule_is_refused_at_start(tmp_path: Path) -> None:
    # tenants "a" and "a\0b": ("a", b"b\0ns") and ("a\0b", b"ns") would store as one namespace
    path = tmp_path / "tokens.toml"
    path.write_text(
        '[[tokens]]\ntoken = "a-token-0123456789abcdef"\ntenant = "a"\nrole = "writer"\n\n'
        '[[tokens]]\ntoken = "b-token-0123456789abcdef"\ntenant = "a\\u0000b"\nrole = "writer"\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
         "--token-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: tokens[1]: tenant 'a\\x00b' must match [A-Za-z0-9._-]{{1,64}}" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "d").exists()


def test_tenants_never_see_each_others_blocks(secured: InProcServer) -> None:
    data = layers(3)
    with (
        KVStoreClient(secured.address, token=token("a-writer")) as a,
        KVStoreClient(secured.address, token=token("b-writer")) as b,
        KVStoreClient(secured.address, token=token("b-admin")) as b_admin,
        KVStoreClient(secured.address, token=token("a-admin")) as a_admin,
    ):
        watch_b = b.watch()
        a.put("chat", HASHES, data)
        # same namespace name, same hashes: still invisible to team-b
        assert a.lookup("chat", HASHES) == 3
        assert b.lookup("chat", HASHES) == 0
        assert b.select("chat", HASHES) == {}
        assert b_admin.list_blocks()[0] == []
        assert (b_admin.namespaces(), a_admin.namespaces()) == ([], [b"chat"])  # without the tenant prefix
        with pytest.raises(errors.BlockNotFound):
            b_admin.describe("chat", HASHES[0])
        assert b_admin.evict(namespace="chat").blocks_evicted == 0
        assert b_admin.evict(all=True).blocks_evicted == 0
        assert b_admin.evict(older_than=0).blocks_evicted == 0
        with pytest.raises(errors.AuthError):
            b_admin.evict(target_bytes=0)  # the budget is shared: no tenant may squeeze it
        with pytest.raises(errors.StoreTimeout):
            b.drop_select("chat", HASHES, timeout=0.2)
        # team-a still has everything, and sees its own names without any tenant prefix
        listed, _ = a_admin.list_blocks()
        assert {blk.namespace for blk in listed} == {b"chat"} and len(listed) == 3
        assert a_admin.describe("chat", HASHES[0]).block.namespace == b"chat"
        got = a.select("chat", HASHES)
        assert all(torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)) for k, v in data.items())
        # team-b's own put under the same name is its own; its watcher saw only that
        b.put("chat", HASHES[:1], layers(1, seed=1))
        event = next(iter(watch_b))
        assert (event.namespace, list(event.block_hashes)) == (b"chat", [HASHES[0]])
        watch_b.cancel()
        assert a.lookup("chat", HASHES) == 3
        assert a_admin.evict(all=True).blocks_evicted == 3
        assert b.lookup("chat", HASHES) == 1


# ---- TLS
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_handshake_with_generated_certificates(tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = {"tls_cert": pki["server"], "tls_key": pki["server.key"]}
    d = InProcServer(tmp_path / "data", settings=tls).start()
    try:
        with KVStoreClient(d.address, tls_ca=pki["ca"]) as kv:
            kv.put("ns", HASHES[:1], layers(1))
            assert kv.lookup("ns", HASHES) == 1
        with KVStoreClient(d.address, timeout=3) as plain, pytest.raises(errors.StoreUnavailable):
            plain.lookup("ns", HASHES)  # plaintext against a TLS port
        with (
            KVStoreClient(d.address, timeout=3, tls_ca=pki["other_ca"]) as wrong_ca,
            pytest.raises(errors.StoreUnavailable),
        ):
            wrong_ca.lookup("ns", HASHES)  # a CA that did not sign the server's certificate
    finally:
        d.stop()


def test_mutual_tls_requires_a_client_certificate(tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = {"tls_cert": pki["server"], "tls_key": pki["server.key"], "tls_client_ca": pki["ca"]}
    d = InProcServer(tmp_path / "data", settings=tls).start()
    try:
        with KVStoreClient(
            d.address, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client.key"]
        ) as kv:
            assert kv.lookup("ns", HASHES) == 0
        with (
            KVStoreClient(d.address, timeout=3, tls_ca=pki["ca"]) as anonymous,
            pytest.raises(errors.StoreUnavailable),
        ):
            anonymous.lookup("ns", HASHES)
    finally:
        d.stop()


# ---- safe defaults
def test_non_loopback_bind_without_tokens_or_tls_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore_server", "--listen", "0.0.0.0:0", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to listen on 0.0.0.0:0" in proc.stderr and "--insecure" in proc.stderr
    assert proc.stdout == ""  # never served
    assert not (tmp_path / "d").exists()  # nothing was created either


def test_insecure_flag_allows_a_non_loopback_bind(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "data", extra_args=["--listen", "0.0.0.0:0", "--insecure"]).start()
    try:
        port = d.address.rpartition(":")[2]
        with KVStoreClient(f"127.0.0.1:{port}") as kv:
            assert kv.health() == "SERVING"
    finally:
        d.stop()


def test_cli_sends_its_token_from_the_flag_or_the_environment(
    secured: InProcServer, monkeypatch, capsys
) -> None:
    from kvstore_cli.main import main as cli

    assert cli(["--address", secured.address, "stats", "--json"]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli(["--address", secured.address, "--token", token("a-reader"), "stats", "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("KVSTORE_TOKEN", token("a-reader"))
    assert cli(["--address", secured.address, "ls", "--json"]) == 0
    assert cli(["--address", secured.address, "evict", "--all", "--yes"]) == 1  # a reader may not
    assert "PERMISSION_DENIED" in capsys.readouterr().err

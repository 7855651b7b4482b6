"""The control socket (kvstore.control, kvstore_server.rpc.control): a same-host client's
unary calls and PinStream go over a Unix socket beside the arena, answered by the gRPC
handlers through the same interceptors; refusals keep their status codes; a client that
cannot reach it uses gRPC."""

from __future__ import annotations

import functools
import os
import socket
import stat
import struct
from pathlib import Path

import grpc
import pytest
from support.daemon import eventually
from support.hashes import NS, chain
from support.ports import free_port
from support.threads import run_all

from kvstore import control
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import Chain, KVStoreClient, LayerSpec, _control, errors
from kvstore_server.rpc import generic_handler
from kvstore_server.rpc.control import ControlSocket

from .helpers import assert_same, make_layers


def _socket(server) -> Path:
    ctl = server.running.control_socket
    assert ctl is not None
    return ctl.path


def _raw_call(path: Path, method: str, request: bytes, token: str | None = None) -> tuple[int, bytes]:
    """One call by hand: (0, the reply's bytes) or (status code, details)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        control.connect(sock, path)
        control.parse_ready(control.recv_frame(sock))
        control.send_frame(sock, control.call_head(method, 5.0, token), request)
        frame = control.recv_frame(sock)
        if frame[0] == control.REPLY:
            return 0, bytes(frame[1:])
        code, details = control.parse_status(frame)
        return code, details.encode()


def test_a_same_host_client_calls_over_the_socket_and_gets_the_same_answers(server) -> None:
    hashes, layers = chain("ctl", 4), make_layers(4)
    ctl = server.running.control_socket
    with (
        KVStoreClient(server.address, arena=True) as kv,
        KVStoreClient(server.address, arena=False) as grpc_kv,
    ):
        assert kv.lookup(NS, hashes) == 0
        kv.put(NS, hashes, layers)
        calls = ctl.calls
        assert kv.lookup(NS, hashes) == grpc_kv.lookup(NS, hashes) == 4
        assert ctl.calls == calls + 1  # the arena client's Lookup, not the gRPC one's
        assert_same(kv.select(NS, hashes), layers)
        where = kv.where(NS, hashes, lease_from=0)
        assert where.num_blocks == 4 and where.lease is not None
        pinned = kv.leased(where.lease, NS)
        assert pinned is not None and pinned.verify() is None
        pinned.release()
        for _ in range(5):
            streamed = kv.pin(NS, hashes, stream=True)
            assert streamed is not None and streamed.num_blocks == 4
            streamed.wait_layers(len(layers))
            streamed.release()
        # the caller's thread and the client's sender of Releases: a connection each,
        # reused by every call (a finished PinStream's too: were each closed, the five
        # would open five more; one more is allowed, for a PinStream whose end came late)
        assert ctl.accepted <= 3
    assert ctl.calls > calls + 4


def test_a_client_may_keep_every_call_on_grpc(server) -> None:
    hashes, layers = chain("grpc-only", 2), make_layers(2)
    ctl = server.running.control_socket
    with KVStoreClient(server.address, arena=True, control_socket=False) as kv:
        kv.put(NS, hashes, layers)  # through the arena
        assert kv.arena_available() and kv.lookup(NS, hashes) == 2
        assert_same(kv.select(NS, hashes), layers)
        assert kv._rpc.control is None
    assert ctl.calls == 0 and ctl.accepted == 0


def test_a_request_over_the_sockets_limit_goes_over_grpc(server) -> None:
    """The daemon holds a bounded number of bytes of socket requests; a larger request
    (here a ReserveMany of 6.8 MB of hashes) is sent over gRPC, and answered the same."""
    spec = LayerSpec("k", "bfloat16", (2,))
    chains = [Chain(chain(f"big-{i}", 1000)) for i in range(200)]
    assert sum(len(h) for c in chains for h in c.hashes) > control.MAX_REQUEST_BYTES
    ctl = server.running.control_socket
    with KVStoreClient(server.address, arena=True) as kv:
        kv.lookup(NS, chains[0].hashes[:1])
        calls = ctl.calls
        answers = kv.reserve_many(NS, chains, [spec])
        assert answers is not None and len(answers) == 200
        assert all(not isinstance(a, Exception) and a.num_blocks == 1000 for a in answers)
        assert ctl.calls == calls  # not on the socket
        for a in answers:
            a.abort()
        assert ctl.calls == calls + 200  # each Abort is small: on the socket


def test_refusals_keep_their_status_codes(server) -> None:
    spec = LayerSpec("k", "bfloat16", (2,))
    with KVStoreClient(server.address, arena=True) as kv:
        kv.lookup(NS, chain("x", 1))  # the socket is taken from here on
        assert kv._rpc.control is not None and kv._rpc.control.usable
        with pytest.raises(errors.InvalidRequest, match="hash"):
            kv.lookup(NS, [b"short"])
        with pytest.raises(errors.InvalidRequest):
            kv.reserve(NS, [b"\0" * 31], [spec])
        with pytest.raises(errors.KVStoreError) as refused:
            kv._rpc.unary(kv._rpc.arena["Commit"], pb.CommitRequest(reservation_id=12345), 5.0)
        assert refused.value.code == "NOT_FOUND"
        assert kv._rpc.control.usable  # a refusal is the call's, not the socket's


def test_the_socket_refuses_what_it_does_not_serve(server) -> None:
    path = _socket(server)
    code, details = _raw_call(path, "Put", b"")
    assert control.status_name(code) == "UNIMPLEMENTED" and b"gRPC" in details
    code, details = _raw_call(path, "Watch", pb.WatchRequest().SerializeToString())
    assert control.status_name(code) == "UNIMPLEMENTED" and b"gRPC" in details  # answers in metadata
    code, _ = _raw_call(path, "NoSuchMethod", b"")
    assert control.status_name(code) == "UNIMPLEMENTED"
    code, details = _raw_call(path, "Lookup", b"\xff\xff\xff")  # not a LookupRequest
    assert control.status_name(code) == "INVALID_ARGUMENT" and b"undecodable" in details
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        control.connect(sock, path)
        control.recv_frame(sock)
        sock.sendall(struct.pack("<I", control.MAX_CALL_FRAME_BYTES + 1))  # over the frame limit
        frame = control.recv_frame(sock)
        code, _ = control.parse_status(frame)
        assert control.status_name(code) == "RESOURCE_EXHAUSTED"
        assert sock.recv(1) == b""  # and the connection is closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        control.connect(sock, path)
        control.recv_frame(sock)
        control.send_frame(sock, bytes((control.CALL, 99)) + b"\0" * 8)  # an unknown version
        code, _ = control.parse_status(control.recv_frame(sock))
        assert control.status_name(code) == "INVALID_ARGUMENT"
    # the daemon serves on
    assert (
        _raw_call(
            path,
            "Lookup",
            pb.LookupRequest(namespace=NS.encode(), block_hashes=chain("y", 1)).SerializeToString(),
        )[0]
        == 0
    )


def test_it_checks_tokens_as_grpc_does(make_server, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[[tokens]]\ntoken = "writer-0123456789abcdef0123"\ntenant = "a"\nrole = "writer"\n'
        '[[tokens]]\ntoken = "reader-0123456789abcdef0123"\ntenant = "a"\nrole = "reader"\n'
    )
    os.chmod(tokens, 0o600)
    server = make_server(token_file=tokens, memory_clients=True)  # tenants: asked for
    path = _socket(server)
    lookup = pb.LookupRequest(namespace=NS.encode(), block_hashes=chain("t", 1)).SerializeToString()
    assert control.status_name(_raw_call(path, "Lookup", lookup)[0]) == "UNAUTHENTICATED"
    assert (
        control.status_name(_raw_call(path, "Lookup", lookup, "wrong-token-0123456789")[0])
        == "UNAUTHENTICATED"
    )
    assert _raw_call(path, "Lookup", lookup, "reader-0123456789abcdef0123")[0] == 0
    reserve = pb.ReserveRequest(namespace=NS.encode(), block_hashes=chain("t", 1)).SerializeToString()
    code, _ = _raw_call(path, "Reserve", reserve, "reader-0123456789abcdef0123")
    assert control.status_name(code) == "PERMISSION_DENIED"
    hashes, layers = chain("tok", 2), make_layers(2)
    with KVStoreClient(server.address, arena=True, token="writer-0123456789abcdef0123") as kv:
        kv.put(NS, hashes, layers)
        assert kv.lookup(NS, hashes) == 2
        assert kv._rpc.control is not None and kv._rpc.control.usable


def test_the_socket_is_the_arenas_to_open_and_goes_with_the_server(make_server) -> None:
    server = make_server()
    path = _socket(server)
    arena = server.running.store.memory.file.path
    assert path.parent == arena.parent and stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(arena.stat().st_mode) == 0o600
    with KVStoreClient(server.address, arena=True) as kv:
        assert kv.arena_access().control_socket == str(path)
    server.stop()
    assert not path.exists()


def test_no_arena_offered_no_socket(make_server) -> None:
    server = make_server(memory_clients=False)
    assert server.running.control_socket is None
    with KVStoreClient(server.address, arena=True) as kv:
        hashes = chain("off", 1)
        assert kv.lookup(NS, hashes) == 0  # over gRPC
        assert kv._rpc.control is None


def test_a_client_beyond_the_connection_limit_uses_grpc_then_tries_again(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_control, "_RETRY_SECONDS", 0.0)  # (its wait before trying again: none)
    server = make_server(workers=2)  # the socket serves as many connections as gRPC workers
    ctl = server.running.control_socket
    hashes, layers = chain("many", 2), make_layers(2)
    with KVStoreClient(server.address, arena=True) as first:
        first.put(NS, hashes, layers)
    eventually(lambda: ctl.connections() == 0)  # the daemon saw the first client's go
    held = []
    try:
        for _ in range(2):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            control.connect(sock, ctl.path)
            control.recv_frame(sock)  # READY: served
        with KVStoreClient(server.address, arena=True) as kv:
            calls = ctl.calls
            assert kv.lookup(NS, hashes) == 2  # refused a connection: over gRPC
            assert ctl.refused >= 1 and ctl.calls == calls
            for sock in held:
                sock.close()
            eventually(lambda: ctl.connections() == 0)  # the daemon saw them go
            assert kv.lookup(NS, hashes) == 2
            assert ctl.calls == calls + 1  # on the socket again
    finally:
        for sock in held:
            sock.close()


def test_calls_from_many_threads_each_get_their_own_answer(server) -> None:
    chains = [chain(f"thread-{i}", 3) for i in range(8)]
    layers = make_layers(3)
    with KVStoreClient(server.address, arena=True) as kv:

        def work(hashes: list[bytes]) -> None:
            for _ in range(5):
                kv.put(NS, hashes, layers)
                assert kv.lookup(NS, hashes) == 3
                assert_same(kv.select(NS, hashes), layers)

        failures = run_all([functools.partial(work, h) for h in chains])
    assert failures == []
    assert server.running.control_socket.calls >= 8 * 5 * 3


def test_a_stopped_daemons_pooled_connections_are_not_used_again(make_daemon) -> None:
    """A restart (same data dir, same socket path, a new run): the client's idle
    connections to the old run are dropped, and its calls reach the new run."""
    d = make_daemon(extra_args=["--listen", f"127.0.0.1:{free_port()}"])  # restarts keep the address
    hashes, layers = chain("restart", 2), make_layers(2)
    with KVStoreClient(d.address, timeout=20.0, arena=True) as kv:
        kv.put(NS, hashes, layers)
        assert kv.lookup(NS, hashes) == 2
        old = kv._rpc.control
        assert old is not None and old.usable
        d.restart()
        assert kv.lookup(NS, hashes) == 2  # written behind before the clean stop
        assert_same(kv.select(NS, hashes), layers)
        assert kv._rpc.control is not None and kv._rpc.control.usable
        assert kv._rpc.control.store_id != old.store_id


def test_long_socket_paths_are_reached_through_their_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "kvstore-0123456789abcdef.sock"
    assert len(os.fsencode(path)) > 108
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        control.bind(listener, path)
        listener.listen(1)
        assert stat.S_ISSOCK(path.stat().st_mode)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            control.connect(client, path)
            conn, _ = listener.accept()
            with conn:
                control.send_frame(conn, control.ready_frame("run-1"))
                assert control.parse_ready(control.recv_frame(client)) == "run-1"


def test_grpc_status_names_are_the_wires() -> None:
    assert [control.status_name(code.value[0]) for code in grpc.StatusCode] == [
        code.name for code in grpc.StatusCode
    ]


def test_a_connection_idle_too_long_is_closed(server, tmp_path: Path) -> None:
    ctl = ControlSocket(
        tmp_path / "idle.sock", generic_handler(server.running.servicer), (), "run-1", idle_seconds=0.3
    )
    try:
        lookup = pb.LookupRequest(namespace=NS.encode(), block_hashes=chain("idle", 1)).SerializeToString()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            control.connect(sock, ctl.path)
            assert control.parse_ready(control.recv_frame(sock)) == "run-1"
            control.send_frame(sock, control.call_head("Lookup", 5.0, None), lookup)
            assert control.recv_frame(sock)[0] == control.REPLY  # a call in time is answered
            assert sock.recv(1) == b""  # then, idle, the daemon closes it
        assert ctl.connections() == 0
    finally:
        ctl.close()
    assert not (tmp_path / "idle.sock").exists()

"""Network faults between client and daemon, through a fault-injecting TCP proxy (faultproxy.py).

Puts and Gets of multi-MiB blocks (8 blocks x 2 layers x 1 MiB) go through a proxy that
resets the connection (RST both ways) or stalls it (forwards nothing more, sockets open)
after K bytes in one direction, K placed at protocol points by HTTP/2 frame: inside the
HTTP/2 preface, inside the Put header / GetRequest / GetHeader, inside the first and the
last 4 MiB chunk, right after the commit, right before the answer or the trailers. The
client talks to the proxy; every check goes to the daemon's own address, with a second
client. What holds, for both backends:

- every call ends: the client call has a deadline (CALL_TIMEOUT) and runs in a thread
  joined within HANG_BOUND; not returning by then fails the test (a hang bound, not a
  timing assertion);
- a failed call raises a kvstore_client.errors.KVStoreError subclass (StoreTimeout for a
  stall), never a raw grpc.RpcError or anything else; a fault before the transfer's end
  always fails the call;
- nothing torn is visible: after each failed put the daemon has none of its blocks or
  all of them (a put whose connection broke after its commit was sent may commit), bit-exact,
  never fewer on a later look; still so at the end of the test;
- a Get that failed leaves the stored blocks intact (select directly, bit-exact);
- the daemon answers health SERVING after every fault (and during stalls, to another
  client), and a full round trip through the proxy set to pass-through works at the end;
- after a put that stalled, the client's close() returns while the connection is still
  stalled (test_close_after_a_stalled_put_returns: see there for the daemons it fails with).

The proxies count the faults they inject: > 0 for every case, printed per case and per
module (pytest -s).
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from integration.helpers import NS, assert_same, chain, make_layers
from support.daemon import Daemon

from kvstore_client import KVStoreClient, errors

from .faultproxy import C2S, H2_DATA, H2_END_STREAM, H2_HEADERS, S2C, Anchor, Fault, FaultProxy

N_BLOCKS = 8
SHAPE = (2, 256, 1024)  # float16: 1 MiB per block and layer; 2 layers: 16 MiB a put, in 4 MiB chunks
CALL_TIMEOUT = 3.0  # each client call's deadline (a put's: seconds without progress)
HANG_BOUND = 30.0  # a call that has not returned by then is a hang
# The clients of a proxy each get a connection of their own (by default gRPC shares one
# between equal channels of a process).
CHANNEL = [("grpc.use_local_subchannel_pool", 1)]

MiB = 1 << 20
FIRST_DATA = Anchor(H2_DATA)  # stream 1's first DATA frame: a put's header, a Get's request or GetHeader
INTO_FIRST_MESSAGE = 9 + 5  # past the frame header and the gRPC message prefix
# Where the faults go (a reset at each of them must fail the call)
PUT_POINTS: dict[str, Fault] = {
    "inside the HTTP/2 preface": Fault.reset(C2S, 10),
    "inside the put header": Fault.reset(C2S, INTO_FIRST_MESSAGE + 100, FIRST_DATA),
    "inside the first chunk": Fault.reset(C2S, 2 * MiB, FIRST_DATA),
    "inside the last chunk": Fault.reset(C2S, 16 * MiB - 64 * 1024, FIRST_DATA),
    "right after the commit": Fault.reset(C2S, 0, Anchor(H2_DATA, flags=H2_END_STREAM, from_end=True)),
    "right before the answer": Fault.reset(S2C, 0, Anchor(H2_HEADERS)),
}
GET_POINTS: dict[str, Fault] = {
    "inside the request": Fault.reset(C2S, INTO_FIRST_MESSAGE + 100, FIRST_DATA),
    "inside the GetHeader": Fault.reset(S2C, INTO_FIRST_MESSAGE + 3, FIRST_DATA),
    "inside the first chunk": Fault.reset(S2C, 2 * MiB, FIRST_DATA),
    "inside the last chunk": Fault.reset(S2C, 16 * MiB - 64 * 1024, FIRST_DATA),
    "right before the trailers": Fault.reset(S2C, 0, Anchor(H2_HEADERS, nth=2)),
}

FAULTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _fault_totals() -> Iterator[None]:
    yield
    print(f"\nfaults injected by {__name__}: {dict(FAULTS)}, total {sum(FAULTS.values())}")


def stall(point: Fault, *, both_ways: bool = False) -> Fault:
    return Fault.stall(point.direction, point.after_bytes, point.anchor, both_ways=both_ways)


# ---- calls under a hang bound, their outcomes ------------------------------------------------------
@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    def describe(self) -> str:
        return f"{'ok' if self.error is None else type(self.error).__name__} in {self.seconds:.2f}s"


def bounded(what: str, fn: Callable[[], Any]) -> Outcome:
    """Run `fn` in a thread; fail the test if it does not return within HANG_BOUND."""
    out = Outcome()

    def run() -> None:
        start = time.monotonic()
        try:
            out.value = fn()
        except BaseException as exc:  # noqa: BLE001 - judged by the test thread
            out.error = exc
        out.seconds = time.monotonic() - start

    thread = threading.Thread(target=run, name=f"call {what}", daemon=True)
    thread.start()
    thread.join(HANG_BOUND)
    if thread.is_alive():
        pytest.fail(f"{what}: did not return within {HANG_BOUND:g}s (deadline {CALL_TIMEOUT:g}s): a hang")
    return out


def assert_typed_failure(
    what: str, out: Outcome, kind: type[errors.KVStoreError] = errors.KVStoreError
) -> None:
    """The call failed, with a KVStoreError (of `kind`)."""
    err = out.error
    assert err is not None, f"{what}: the call succeeded despite the fault"
    detail = "".join(traceback.format_exception(err))
    assert isinstance(err, errors.KVStoreError), f"{what}: untyped {type(err).__name__}: {err}\n{detail}"
    assert isinstance(err, kind), f"{what}: {type(err).__name__} instead of {kind.__name__}: {err}"


def proxied(proxy: FaultProxy) -> KVStoreClient:
    return KVStoreClient(proxy.address, timeout=CALL_TIMEOUT, channel_options=CHANNEL, arena=False)


def close_bounded(what: str, kv: KVStoreClient) -> None:
    out = bounded(f"{what}: client close", kv.close)
    assert out.error is None, f"{what}: close raised {out.error!r}"


def close_both(proxy: FaultProxy, kv: KVStoreClient) -> None:
    """The proxy (its sockets) first: a client's close() waits while its connection is stalled."""
    try:
        proxy.close()
    finally:
        kv.close()


# ---- data and checks -------------------------------------------------------------------------------
def put_layers(tag: str, seed: int) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    return chain(tag, N_BLOCKS), make_layers(N_BLOCKS, shape=SHAPE, seed=seed)


def read_stream(kv: KVStoreClient, hashes: list[bytes]) -> dict[str, torch.Tensor]:
    """A Get through get_stream, layer by layer, as the connector loads."""
    return {name: tensor for name, tensor in kv.get_stream(NS, hashes, timeout=CALL_TIMEOUT)}


READERS: dict[str, Callable[[KVStoreClient, list[bytes]], dict[str, torch.Tensor]]] = {
    "select": lambda kv, hashes: kv.select(NS, hashes, timeout=CALL_TIMEOUT),
    "get_stream": read_stream,
}


def check_put(direct: KVStoreClient, what: str, hashes: list[bytes], layers: dict[str, torch.Tensor]) -> int:
    """None or all of a failed put's blocks are stored, bit-exact. Returns how many.

    The daemon may still be committing it (a connection lost after the commit was sent
    ends the client's call first): each look sees none or all, never fewer later."""
    first = direct.lookup(NS, hashes)
    got = direct.select(NS, hashes)
    then = direct.lookup(NS, hashes)
    assert first in (0, N_BLOCKS) and then in (0, N_BLOCKS), (
        f"{what}: a torn put: {first}, then {then} blocks"
    )
    if got:
        assert_same(got, layers)
        assert then == N_BLOCKS, f"{what}: select returned all blocks, then lookup said {then}"
    else:
        assert first == 0, f"{what}: lookup said {first}, then select returned nothing"
    return then


def check_intact(
    direct: KVStoreClient, what: str, hashes: list[bytes], layers: dict[str, torch.Tensor]
) -> None:
    assert direct.lookup(NS, hashes) == N_BLOCKS, f"{what}: stored blocks were lost"
    assert_same(direct.select(NS, hashes), layers)


def assert_serving(direct: KVStoreClient, what: str) -> None:
    assert direct.health() == "SERVING", f"{what}: the daemon is not serving"


def round_trip(proxy: FaultProxy, direct: KVStoreClient, tag: str) -> None:
    """A full put + select + lookup through the proxy, set to pass-through."""
    proxy.set_fault(None)
    hashes, layers = put_layers(tag, seed=99)
    kv = proxied(proxy)
    try:
        out = bounded("pass-through put", lambda: kv.put(NS, hashes, layers, timeout=CALL_TIMEOUT))
        assert out.error is None, f"pass-through put failed: {out.error!r}"
        assert out.value.blocks_written == N_BLOCKS
        out = bounded("pass-through select", lambda: kv.select(NS, hashes, timeout=CALL_TIMEOUT))
        assert out.error is None, f"pass-through select failed: {out.error!r}"
        assert_same(out.value, layers)
        assert kv.lookup(NS, hashes) == N_BLOCKS
    finally:
        close_bounded("pass-through", kv)
    check_intact(direct, "pass-through", hashes, layers)


def count(backend: str, kind: str, injected: int) -> None:
    assert injected > 0
    FAULTS[f"{backend} {kind}"] += injected


def one_call(
    proxy: FaultProxy, fault: Fault, what: str, call: Callable[[KVStoreClient], Any]
) -> tuple[Outcome, int]:
    """`call` on a fresh client (and connection) through `proxy` with `fault`; the faults it took."""
    proxy.set_fault(fault)
    before = proxy.faults_injected
    kv = proxied(proxy)
    try:
        out = bounded(what, lambda: call(kv))
    finally:
        close_bounded(what, kv)
    assert proxy.wait_idle(HANG_BOUND), f"{what}: a connection stayed open"
    injected = proxy.faults_injected - before
    assert injected >= 1, f"{what}: the fault was never injected"
    return out, injected


# ---- the tests ---------------------------------------------------------------------------------------
def test_put_through_resets(daemon: Daemon, backend: str) -> None:
    """Puts reset at each point: a typed error, none or all blocks stored, the daemon serving."""
    done: list[tuple[str, list[bytes], dict[str, torch.Tensor]]] = []
    with (
        KVStoreClient(daemon.address, timeout=20.0, arena=False) as direct,
        FaultProxy(daemon.address) as proxy,
    ):
        for i, (point, fault) in enumerate(PUT_POINTS.items(), start=1):
            what = f"[{backend}] put, {fault.kind.value} {fault.direction.value} {point}"
            hashes, layers = put_layers(f"put-reset-{i}", seed=i)
            out, injected = one_call(
                proxy,
                fault,
                what,
                lambda kv: kv.put(NS, hashes, layers, timeout=CALL_TIMEOUT),  # noqa: B023
            )
            assert_typed_failure(what, out)
            n = check_put(direct, what, hashes, layers)
            assert_serving(direct, what)
            count(backend, "reset", injected)
            done.append((what, hashes, layers))
            print(f"\n{what}: {out.describe()}, {injected} fault(s), {n}/{N_BLOCKS} blocks stored")
        round_trip(proxy, direct, "put-reset-final")
        for what, hashes, layers in done:  # and nothing turned torn since
            check_put(direct, f"{what} (at the end)", hashes, layers)


def test_get_through_resets(daemon: Daemon, backend: str) -> None:
    """Gets (select, get_stream) reset at each point: typed errors, the stored blocks intact."""
    hashes, layers = put_layers("get-seed", seed=7)
    with (
        KVStoreClient(daemon.address, timeout=20.0, arena=False) as direct,
        FaultProxy(daemon.address) as proxy,
    ):
        assert direct.put(NS, hashes, layers).blocks_written == N_BLOCKS
        for point, fault in GET_POINTS.items():
            for name, read in READERS.items():
                what = f"[{backend}] {name}, {fault.kind.value} {fault.direction.value} {point}"
                out, injected = one_call(proxy, fault, what, lambda kv: read(kv, hashes))  # noqa: B023
                assert_typed_failure(what, out)
                check_intact(direct, what, hashes, layers)
                assert_serving(direct, what)
                count(backend, "reset", injected)
                print(f"\n{what}: {out.describe()}, {injected} fault(s)")
        round_trip(proxy, direct, "get-reset-final")


@dataclass
class StallCase:
    what: str
    op: str  # "put" or a READERS name
    proxy: FaultProxy
    kv: KVStoreClient
    hashes: list[bytes]
    layers: dict[str, torch.Tensor]
    outcome: Outcome | None = None

    def call(self) -> Any:
        if self.op == "put":
            return self.kv.put(NS, self.hashes, self.layers, timeout=CALL_TIMEOUT)
        return READERS[self.op](self.kv, self.hashes)


STALLS = [  # (op, point of PUT_POINTS or GET_POINTS, both ways)
    ("put", "inside the put header", False),
    ("put", "inside the first chunk", False),
    ("put", "inside the first chunk", True),
    ("put", "inside the last chunk", False),
    ("put", "right before the answer", False),
    ("select", "inside the request", False),
    ("select", "inside the GetHeader", False),
    ("get_stream", "inside the first chunk", False),
    ("get_stream", "inside the last chunk", True),
]


def test_stalls_end_in_timeouts(daemon: Daemon, backend: str) -> None:
    """Puts and Gets stalled at each point, all at once, each through its own proxy: each ends
    in StoreTimeout by its deadline while the daemon serves another client; after the release,
    none or all of each put's blocks are stored (bit-exact), the Gets' blocks are intact."""
    seed_hashes, seed_layers = put_layers("stall-seed", seed=8)
    with KVStoreClient(daemon.address, timeout=20.0, arena=False) as direct, ExitStack() as stack:
        assert direct.put(NS, seed_hashes, seed_layers).blocks_written == N_BLOCKS
        cases: list[StallCase] = []
        for i, (op, point, both_ways) in enumerate(STALLS, start=1):
            fault = stall((PUT_POINTS if op == "put" else GET_POINTS)[point], both_ways=both_ways)
            ways = " (both ways)" if both_ways else ""
            what = f"[{backend}] {op}, stall {fault.direction.value}{ways} {point}"
            proxy = stack.enter_context(FaultProxy(daemon.address, fault))
            kv = proxied(proxy)
            stack.callback(close_both, proxy, kv)  # on a failure: the proxy first, then the client
            if op == "put":
                hashes, layers = put_layers(f"put-stall-{i}", seed=10 + i)
            else:
                hashes, layers = seed_hashes, seed_layers
            cases.append(StallCase(what, op, proxy, kv, hashes, layers))

        threads = []
        for case in cases:

            def run(case: StallCase = case) -> None:
                case.outcome = bounded(case.what, case.call)

            threads.append(threading.Thread(target=run, name=case.what, daemon=True))
            threads[-1].start()
        # all of them stall; meanwhile the daemon serves a client of its own
        for case in cases:
            assert case.proxy.wait_faults(1, HANG_BOUND), f"{case.what}: the stall never happened"
        assert_serving(direct, "during the stalls")
        check_intact(direct, "during the stalls", seed_hashes, seed_layers)
        for thread in threads:
            thread.join(HANG_BOUND + 5)
            assert not thread.is_alive(), f"{thread.name}: a hang"
        for case in cases:
            assert case.outcome is not None
            assert_typed_failure(case.what, case.outcome, errors.StoreTimeout)
            # The held bytes, then the client's cancel, reach the daemon. Released before the
            # client's close(), which may wait while its connection is stalled (see the last test).
            case.proxy.release()
            close_bounded(case.what, case.kv)
        for case in cases:
            assert case.proxy.wait_idle(HANG_BOUND), (
                f"{case.what}: a connection stayed open after the release"
            )
            injected = case.proxy.faults_injected
            count(backend, "stall", injected)
            stored = ""
            if case.op == "put":
                n = check_put(direct, case.what, case.hashes, case.layers)
                stored = f", {n}/{N_BLOCKS} blocks stored after the release"
            else:
                check_intact(direct, case.what, seed_hashes, seed_layers)
            assert_serving(direct, case.what)
            assert case.outcome is not None
            print(f"\n{case.what}: {case.outcome.describe()}, {injected} fault(s){stored}")
        round_trip(cases[0].proxy, direct, "stall-final")
        for case in cases:  # and nothing turned torn since
            if case.op == "put":
                check_put(direct, f"{case.what} (at the end)", case.hashes, case.layers)


CLOSE_BOUND = 3.0  # a client's close() takes milliseconds: a hang bound


@pytest.mark.parametrize("backend", ["lmdb"])  # the client's side: one backend shows it
def test_close_after_a_stalled_put_returns(daemon: Daemon, backend: str) -> None:
    """A put stalled inside its header ends in StoreTimeout; the client's close() then returns
    while the connection is still stalled.

    gRPC's Channel.close waits for the cancelled Put call, and that call ends only once its
    stuck socket write does: where the daemon's flow-control windows let the client write
    more than the socket buffers hold (BDP probing on, as in the daemon of commit 8581cc1),
    close() blocks for as long as the connection stays stalled (a daemon stopped by SIGSTOP
    does the same to a client with a warm connection)."""
    fault = stall(PUT_POINTS["inside the put header"])
    what = f"[{backend}] put, stall {fault.direction.value} inside the put header, then close()"
    hashes, layers = put_layers("close-after-stall", seed=61)
    with KVStoreClient(daemon.address, timeout=20.0, arena=False) as direct:
        with FaultProxy(daemon.address, fault) as proxy:
            kv = proxied(proxy)
            closing = threading.Thread(target=kv.close, name="close", daemon=True)
            try:
                out = bounded(what, lambda: kv.put(NS, hashes, layers, timeout=1.0))
                assert_typed_failure(what, out, errors.StoreTimeout)
                started = time.monotonic()
                closing.start()
                closing.join(CLOSE_BOUND)
                hung = closing.is_alive()
            finally:
                proxy.release()  # lets a blocked close() finish
                if closing.ident is None:
                    close_bounded(what, kv)
            closing.join(HANG_BOUND)
            assert not closing.is_alive(), f"{what}: close() did not return even after the release"
            took = time.monotonic() - started
            count(backend, "stall", proxy.faults_injected)
            state = "hung while stalled, returned once released" if hung else "returned while stalled"
            print(f"\n{what}: put {out.describe()}; close() {state}, {took:.2f}s after the call")
        check_put(direct, what, hashes, layers)
        assert_serving(direct, what)
        assert not hung, (
            f"{what}: close() did not return within {CLOSE_BOUND:g}s while the connection stalled"
        )

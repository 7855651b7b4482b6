"""A small fault-injecting TCP proxy for chaos tests (loopback only, one selector thread).

    with FaultProxy(daemon.address, Fault.reset(C2S, 4096)) as proxy:
        KVStoreClient(proxy.address) ...      # every connection is forwarded to the daemon
        proxy.faults_injected                 # how many connections were hit so far

Each connection accepted on 127.0.0.1 (a port the OS chose) is forwarded to the target,
also loopback. The fault in effect when a connection is accepted applies to it, once,
when the K-th byte in the fault's direction has been read from its sender:

    None (pass-through)  forward everything, both ways, half-closes included
    Fault.reset          forward exactly K bytes, then close both sockets with
                         SO_LINGER 0: both peers get a RST
    Fault.stall          forward exactly K bytes in that direction, then nothing more
                         (nothing more is read, so the sender's TCP window fills up);
                         with both_ways, nothing more the other way either. Sockets
                         stay open until `release()` resumes forwarding.

K is `after_bytes` counted from the connection's first byte, or, with an `anchor`,
from an HTTP/2 frame of that direction (the connection is taken to speak HTTP/2 with
prior knowledge, as gRPC does without TLS): e.g. `Anchor(H2_HEADERS, nth=2)` is the
server's trailers of the first call, so `Fault.reset(S2C, 0, Anchor(H2_HEADERS, nth=2))`
resets right before them. An anchor that never comes means no fault.

`faults_injected` counts the hits; `wait_faults(n)` waits for the n-th. `connections()`
tells what each connection carried (and its first `capture_bytes` each way). `close()`
(or leaving the `with` block) closes every socket and joins the thread, and raises an
error the proxy's thread had, if any.
"""

from __future__ import annotations

import enum
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

_RECV_BYTES = 256 << 10
# Bytes read from one side and not yet written to the other, before reading pauses.
_MAX_PENDING = 1 << 20
_LINGER_RST = struct.pack("ii", 1, 0)
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_DATA = 0x0
H2_HEADERS = 0x1
H2_END_STREAM = 0x1


class Direction(enum.Enum):
    CLIENT_TO_SERVER = "client->server"
    SERVER_TO_CLIENT = "server->client"

    @property
    def other(self) -> Direction:
        return S2C if self is C2S else C2S


C2S = Direction.CLIENT_TO_SERVER
S2C = Direction.SERVER_TO_CLIENT


class FaultKind(enum.Enum):
    RESET = "reset"
    STALL = "stall"


@dataclass(frozen=True, slots=True)
class Anchor:
    """The `nth` HTTP/2 frame of `type` on `stream_id` with all of `flags` set, in the
    fault's direction; K counts from its first byte (its 9-byte frame header), or, with
    `from_end`, from the byte after its payload."""

    type: int
    stream_id: int = 1
    flags: int = 0
    nth: int = 1
    from_end: bool = False

    def __str__(self) -> str:
        kind = {H2_DATA: "DATA", H2_HEADERS: "HEADERS"}.get(self.type, f"type-{self.type}")
        flags = f" flags {self.flags:#x}" if self.flags else ""
        edge = "end" if self.from_end else "start"
        return f"{edge} of {kind} #{self.nth} of stream {self.stream_id}{flags}"


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    direction: Direction
    after_bytes: int
    anchor: Anchor | None = None
    both_ways: bool = False  # stalls only

    def __post_init__(self) -> None:
        if self.after_bytes < 0:
            raise ValueError("after_bytes must not be negative")

    @classmethod
    def reset(cls, direction: Direction, after_bytes: int, anchor: Anchor | None = None) -> Fault:
        return cls(FaultKind.RESET, direction, after_bytes, anchor)

    @classmethod
    def stall(
        cls, direction: Direction, after_bytes: int, anchor: Anchor | None = None, *, both_ways: bool = False
    ) -> Fault:
        return cls(FaultKind.STALL, direction, after_bytes, anchor, both_ways)

    def __str__(self) -> str:
        where = (
            f"{self.after_bytes} B after the {self.anchor}" if self.anchor else f"after {self.after_bytes} B"
        )
        ways = " (both ways)" if self.both_ways else ""
        return f"{self.kind.value} {self.direction.value}{ways} {where}"


@dataclass(frozen=True)
class ConnectionStats:
    """What one proxied connection carried (a snapshot; see FaultProxy.connections)."""

    fault: Fault | None
    carried: dict[Direction, int]
    """Bytes read from each direction's sender (forwarded, or held back by a stall)."""
    head: dict[Direction, bytes]
    """The first `capture_bytes` of them."""
    fault_at: int | None
    """The K at which the fault hit, or None."""
    open: bool


def _per_direction(make: Callable[[], object]) -> Callable[[], dict]:
    return lambda: {C2S: make(), S2C: make()}


@dataclass(eq=False)
class _Frames:
    """Walks one direction's HTTP/2 frame headers as the bytes come in."""

    next: int  # offset of the next frame header
    header: bytearray = field(default_factory=bytearray)
    matches: int = 0

    def find(self, anchor: Anchor, start: int, data: bytes) -> int | None:
        """The anchor's offset, once a chunk [start, start + len(data)) reveals it."""
        end = start + len(data)
        while self.next + len(self.header) < end:
            pos = self.next + len(self.header)  # >= start: every chunk comes through here
            self.header += data[pos - start : pos - start + 9 - len(self.header)]
            if len(self.header) < 9:
                return None
            length = int.from_bytes(self.header[:3], "big")
            kind, flags = self.header[3], self.header[4]
            stream_id = int.from_bytes(self.header[5:9], "big") & 0x7FFFFFFF
            frame, self.next = self.next, self.next + 9 + length
            self.header.clear()
            if kind == anchor.type and stream_id == anchor.stream_id and flags & anchor.flags == anchor.flags:
                self.matches += 1
                if self.matches == anchor.nth:
                    return self.next if anchor.from_end else frame
        return None


@dataclass(eq=False)
class _Conn:
    client: socket.socket
    server: socket.socket
    fault: Fault | None
    capture: int
    read: dict[Direction, int] = field(default_factory=_per_direction(int))
    head: dict[Direction, bytearray] = field(default_factory=_per_direction(bytearray))
    pending: dict[Direction, bytearray] = field(default_factory=_per_direction(bytearray))
    eof: dict[Direction, bool] = field(default_factory=_per_direction(bool))
    shut: dict[Direction, bool] = field(default_factory=_per_direction(bool))
    frames: _Frames | None = None
    fault_k: int | None = None  # K, once known
    fault_at: int | None = None  # K, once hit
    resetting: bool = False  # a reset waits for the K bytes to be written, then RSTs
    no_read: set[Direction] = field(default_factory=set)  # during a stall
    no_write: set[Direction] = field(default_factory=set)  # during a both-ways stall
    held: bytearray = field(default_factory=bytearray)  # read past K, during a stall
    closed: bool = False

    def __post_init__(self) -> None:
        if self.fault is not None:
            if self.fault.anchor is None:
                self.fault_k = self.fault.after_bytes
            else:
                self.frames = _Frames(len(HTTP2_PREFACE) if self.fault.direction is C2S else 0)

    def src(self, d: Direction) -> socket.socket:
        return self.client if d is C2S else self.server

    def dst(self, d: Direction) -> socket.socket:
        return self.server if d is C2S else self.client

    def wants_read(self, d: Direction) -> bool:
        return (
            not self.resetting
            and d not in self.no_read
            and not self.eof[d]
            and len(self.pending[d]) < _MAX_PENDING
        )

    def wants_write(self, d: Direction) -> bool:
        return bool(self.pending[d]) and d not in self.no_write

    def stats(self) -> ConnectionStats:
        head = {d: bytes(h) for d, h in self.head.items()}
        return ConnectionStats(self.fault, dict(self.read), head, self.fault_at, not self.closed)


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target` ("127.0.0.1:port"), injecting `fault` (see the module)."""

    def __init__(self, target: str, fault: Fault | None = None, *, capture_bytes: int = 0) -> None:
        host, _, port = target.rpartition(":")
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"loopback targets only, got {target!r}")
        self._target = ("127.0.0.1", int(port))
        self._fault = fault
        self._capture = capture_bytes
        self._lock = threading.Condition()
        self._faults = 0
        self._conns: list[_Conn] = []
        self._calls: list[tuple[Callable[[], None], threading.Event]] = []
        self._error: BaseException | None = None
        self._closing = False
        self._sel = selectors.DefaultSelector()
        self._registered: dict[socket.socket, int] = {}
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(64)
            self._listener.setblocking(False)
            self._wake_r, self._wake_w = socket.socketpair()
        except BaseException:
            self._listener.close()
            self._sel.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, name=f"faultproxy-{self.address}", daemon=True)
        self._thread.start()

    # ---- control (any thread)
    @property
    def fault(self) -> Fault | None:
        return self._fault

    def set_fault(self, fault: Fault | None) -> None:
        """The fault for connections accepted from now on (None: pass-through)."""
        self._fault = fault

    @property
    def faults_injected(self) -> int:
        with self._lock:
            return self._faults

    def wait_faults(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Wait until at least `n` faults were injected; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._faults >= n, timeout)

    def release(self) -> None:
        """Resume forwarding on every stalled connection (a connection stalls only once)."""
        self._call(self._release_all)

    def connections(self) -> list[ConnectionStats]:
        """Every connection accepted so far, in order."""
        out: list[ConnectionStats] = []
        self._call(lambda: out.extend(c.stats() for c in self._conns))
        return out

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no connection is open (both peers closed theirs, or a reset); False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: all(c.closed for c in self._conns), timeout)

    def close(self) -> None:
        """Close every socket and stop the thread. Idempotent; raises the thread's error, if any."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(30.0)
        if self._thread.is_alive():
            raise RuntimeError("the fault proxy's thread did not stop")
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the fault proxy's thread failed") from error

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed (the thread ended), or full (it wakes anyway)
            pass

    def _call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the proxy's thread, which owns every socket, and wait for it."""
        done = threading.Event()
        with self._lock:
            if self._closing:
                raise RuntimeError("the fault proxy is closed")
            self._calls.append((fn, done))
        self._wake()
        while not done.wait(1.0):
            if not self._thread.is_alive():
                raise RuntimeError("the fault proxy's thread stopped")

    # ---- the loop (the proxy's thread)
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        break
                    calls, self._calls = self._calls, []
                for fn, done in calls:
                    fn()
                    done.set()
                self._update_interest()
                for key, mask in self._sel.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wakeups()
                    else:
                        # a connection's socket: it sends direction d, receives d.other
                        conn, d = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(conn, d.other)
                        if mask & selectors.EVENT_READ:
                            self._read(conn, d)
        except BaseException as exc:  # noqa: BLE001 - raised again by close()
            self._error = exc
        finally:
            with self._lock:
                self._closing = True
                calls, self._calls = self._calls, []
            for _, done in calls:
                done.set()
            for conn in self._conns:
                self._close(conn, rst=True)
            self._sel.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            server.settimeout(5.0)
            server.connect(self._target)
        except OSError:  # the target is down: refuse the client the same way
            server.close()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(client, server, self._fault, self._capture)
        with self._lock:
            self._conns.append(conn)

    def _update_interest(self) -> None:
        for conn in self._conns:
            if conn.closed:
                continue
            for d in (C2S, S2C):
                sock = conn.src(d)
                events = (selectors.EVENT_READ if conn.wants_read(d) else 0) | (
                    selectors.EVENT_WRITE if conn.wants_write(d.other) else 0
                )
                old = self._registered.get(sock, 0)
                if events == old:
                    continue
                if not events:
                    self._sel.unregister(sock)
                    del self._registered[sock]
                elif not old:
                    self._sel.register(sock, events, (conn, d))
                    self._registered[sock] = events
                else:
                    self._sel.modify(sock, events, (conn, d))
                    self._registered[sock] = events

    def _read(self, conn: _Conn, d: Direction) -> None:
        if conn.closed or not conn.wants_read(d):
            return
        try:
            data = conn.src(d).recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the sender reset: pass the reset on
            self._close(conn, rst=True)
            return
        if not data:
            conn.eof[d] = True
            self._flush(conn, d)
            return
        if len(conn.head[d]) < conn.capture:
            conn.head[d] += data[: conn.capture - len(conn.head[d])]
        start = conn.read[d]
        conn.read[d] += len(data)
        fault = conn.fault
        if fault is not None and fault.direction is d and conn.fault_at is None:
            if conn.fault_k is None and conn.frames is not None and fault.anchor is not None:
                found = conn.frames.find(fault.anchor, start, data)
                if found is not None:
                    conn.fault_k = max(start, found + fault.after_bytes)
            if conn.fault_k is not None and conn.read[d] >= conn.fault_k:
                self._inject(conn, d, start, data)
                return
        conn.pending[d] += data
        self._flush(conn, d)

    def _inject(self, conn: _Conn, d: Direction, start: int, data: bytes) -> None:
        assert conn.fault is not None and conn.fault_k is not None
        keep = conn.fault_k - start
        conn.fault_at = conn.fault_k
        conn.pending[d] += data[:keep]
        if conn.fault.kind is FaultKind.RESET:
            conn.resetting = True  # counted once the K bytes are out, at the RST
        else:
            conn.held += data[keep:]
            conn.no_read.add(d)
            if conn.fault.both_ways:
                conn.no_read.add(d.other)
                conn.no_write.add(d.other)
            self._count()
        self._flush(conn, d)

    def _flush(self, conn: _Conn, d: Direction) -> None:
        """Write what is pending in direction d; then the due reset or half-close."""
        if conn.closed:
            return
        if conn.wants_write(d):
            try:
                sent = conn.dst(d).send(conn.pending[d])
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # the receiver went away: reset the sender too
                self._close(conn, rst=True)
                return
            del conn.pending[d][:sent]
        if conn.pending[d]:
            return
        if conn.resetting:
            self._close(conn, rst=True)
            self._count()
        elif conn.eof[d] and not conn.shut[d] and d not in conn.no_write:
            conn.shut[d] = True
            try:
                conn.dst(d).shutdown(socket.SHUT_WR)
            except OSError:
                self._close(conn, rst=True)
                return
            if conn.shut[d.other]:
                self._close(conn, rst=False)

    def _release_all(self) -> None:
        for conn in self._conns:
            if conn.no_read and not conn.closed:
                assert conn.fault is not None
                conn.no_read.clear()
                conn.no_write.clear()
                conn.pending[conn.fault.direction] += conn.held
                conn.held.clear()
                for d in (C2S, S2C):
                    self._flush(conn, d)

    def _count(self) -> None:
        with self._lock:
            self._faults += 1
            self._lock.notify_all()

    def _close(self, conn: _Conn, *, rst: bool) -> None:
        """Close both sockets; with `rst` (SO_LINGER 0) each peer gets a RST."""
        if conn.closed:
            return
        for sock in (conn.client, conn.server):
            if self._registered.pop(sock, 0):
                self._sel.unregister(sock)
            if rst:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                except OSError:
                    pass
            sock.close()
        with self._lock:
            conn.closed = True
            self._lock.notify_all()

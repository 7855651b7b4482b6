"""The store's events in vLLM's KV events format, for the routers that already read it.

    kvstore-server --kv-events-endpoint tcp://127.0.0.1:5557 --kv-events-replay-endpoint tcp://127.0.0.1:5558

A ZMQ PUB socket sends each batch as three frames: the topic, an 8-byte big-endian
sequence number (0, 1, 2, ... per daemon run) and a msgpack `EventBatch` of
`BlockStored` (block hashes, the first one's parent, token ids, block size, medium),
`BlockRemoved` and `AllBlocksCleared` events. The first batch of a run is an
`AllBlocksCleared`: a subscriber's earlier sequence means nothing after a restart.
The medium is vLLM's name for the tier a commit put the blocks in ("CPU": the memory
tier; "STORAGE": the persistent tier), and a removal (the block left every tier) comes
once per medium of the daemon's tiers: kvstore.kv_events_media says why.
A ROUTER socket replays: a request of an 8-byte big-endian start sequence gets every
batch still held from there, then an end frame (sequence -1, empty payload).

The classes below encode as vLLM's own (`vllm/distributed/kv_events.py`: tagged
structs, an array-like batch, defaults omitted); the tests decode with vLLM's. Block
hashes are the store's (32-byte chained SHA-256, the namespace in their root), so
routers need no namespace field. Token ids are those a put gave (the connector gives
them); a block stored without them has none (block_size 0).

`listener` runs inside the store's commit: it builds the event (work in proportion to its
blocks and tokens) and appends it to a bounded queue (a full queue drops it, counted and
warned of once); a thread encodes and sends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from kvstore.kv_events_media import MEDIUM, PERSISTENT, removal_media

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """The base of the events: tagged with the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    # NOTE: vLLM's has more fields with defaults (extra_keys, group_idx, locality, ...,
    # vLLM 0.34's lookahead_token_ids): left out, they decode as their defaults. No
    # lookahead tokens: the store's hashes cover a block's own tokens only.
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventsPublisher:
    """PUB (and optionally ROUTER replay) sockets fed by the store's listener."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "kvstore",
                 buffer_batches: int = 10_000, max_queue: int = 100_000,
                 tiers: Sequence[str] = (PERSISTENT,)) -> None:  # fmt: skip
        """`tiers`: the daemon's tiers (kvstore.kv_events_media), whose media a removal is
        reported under."""
        self.topic = topic.encode()
        self._removal_media = removal_media(tiers)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(100_000)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot bind {endpoint} / {replay_endpoint}: {exc}") from exc
        log.info("KV events on %s%s", self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
                 f", replay on {replay_endpoint}" if replay_endpoint else "")  # fmt: skip
        self._queue: deque[KVCacheEvent] = deque()
        self._max_queue = max_queue
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self.dropped = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._queue.append(AllBlocksCleared())  # a new run: its sequences start again
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    def listener(self, kind: str, namespace: bytes, hashes: Sequence[bytes], parents: Sequence[bytes],
                 tokens: Sequence[Sequence[int]] | None, tier: str | None = None) -> None:  # fmt: skip
        """The store's listener: queue the change (never blocks)."""
        events: list[KVCacheEvent]
        if kind == "stored":
            flat = [t for block in tokens for t in block] if tokens else []
            stored = BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=(parents[0] or None) if parents else None,
                token_ids=flat,
                block_size=len(tokens[0]) if tokens else 0,
                lora_id=None,
                medium=MEDIUM[tier or PERSISTENT],
                lora_name=None,
            )
            events = [stored]
        else:
            events = [BlockRemoved(block_hashes=list(hashes), medium=m) for m in self._removal_media]
        with self._cond:
            if len(self._queue) + len(events) > self._max_queue:
                if not self.dropped:
                    log.warning("KV events: %d events wait to be sent; dropping more", self._max_queue)
                self.dropped += 1
                return
            self._queue.extend(events)
            self._cond.notify()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    # NOTE: a bounded wait, so replay requests are served while nothing happens
                    self._cond.wait(0.05)
                events = list(self._queue)
                self._queue.clear()
                stopping = self._stopping
            if events:
                payload = encoder.encode(EventBatch(ts=time.time(), events=events))
                seq, self._seq = self._seq, self._seq + 1
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            if self._replay is not None:
                while poller.poll(0):
                    self._serve_replay(self._replay)
            if stopping:
                return

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning(
                "KV events: a replay request of %d frames is not (id, empty, 8-byte sequence)", len(frames)
            )
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

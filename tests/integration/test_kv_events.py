"""The daemon's KV events (--kv-events-endpoint) read the way routers read vLLM's: a ZMQ
SUB of (topic, sequence, msgpack batch) decoded with the installed vLLM's own classes,
and replay over a DEALER socket after a gap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

vllm_kv_events = pytest.importorskip("vllm.distributed.kv_events")
import msgspec  # noqa: E402
import zmq  # noqa: E402
from support.ports import free_port  # noqa: E402

from kvstore_client import KVStoreClient, errors  # noqa: E402
from kvstore_client.hashing import block_hashes  # noqa: E402

from .helpers import NS, make_layers  # noqa: E402

BS = 4
DECODE = msgspec.msgpack.Decoder(type=vllm_kv_events.KVEventBatch)
END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def receive(sub: zmq.Socket, timeout_ms: int = 10_000) -> tuple[int, object]:
    """The next batch on `sub`: (sequence, vLLM's KVEventBatch)."""
    if not sub.poll(timeout_ms):
        raise AssertionError(f"no KV event batch within {timeout_ms} ms")
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kvstore"
    return int.from_bytes(seq, "big"), DECODE.decode(payload)


def test_stored_and_removed_blocks_decode_with_vllms_classes_and_replay_fills_a_gap(make_server, zmq_context):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = make_server(kv_events_endpoint=pub, kv_events_replay_endpoint=replay)
    sub = zmq_context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvstore")
    sub.connect(pub)
    with KVStoreClient(server.address, arena=False) as kv:
        # a SUB sees only what is sent after it joined: put probe blocks until one arrives
        probes = 0
        while True:
            kv.put("probe", block_hashes("probe", list(range(probes, probes + BS)), BS), make_layers(1))
            probes += 1
            if sub.poll(100):
                seq, batch = receive(sub)
                break
        while sub.poll(100):  # the other probes' batches, if any arrived late
            seq, batch = receive(sub)
        tokens = list(range(100, 100 + 3 * BS))
        hashes = block_hashes(NS, tokens, BS)
        kv.put(NS, hashes[:2], make_layers(2), token_ids=tokens[: 2 * BS])
        kv.put(NS, hashes[2:], make_layers(1, seed=3), parent_hash=hashes[1], token_ids=tokens[2 * BS :])
        kv.put("untokened", block_hashes("untokened", [1] * BS, BS), make_layers(1))
        kv.evict(namespace=NS, block_hash=hashes[2])
        # a save through the arena lands in the memory tier
        with KVStoreClient(server.address, arena=True) as arena_kv:
            assert arena_kv.arena_available()
            arena_tokens = list(range(500, 500 + BS))
            arena_kv.put(
                "arena", block_hashes("arena", arena_tokens, BS), make_layers(1), token_ids=arena_tokens
            )
        # a put whose token ids do not divide into its blocks is refused, and stores nothing
        with pytest.raises(errors.InvalidRequest, match="token ids"):
            kv.put(NS, block_hashes(NS, [9] * 2 * BS, BS), make_layers(2), token_ids=[9] * (2 * BS - 1))

    live = []
    while len([e for _, b in live for e in b.events]) < 6:
        live.append(receive(sub))
    assert [s for s, _ in live] == list(range(seq + 1, seq + 1 + len(live)))  # in order, no gap
    events = [e for _, b in live for e in b.events]
    first, second, untokened, removed_cpu, removed_storage, in_arena = events
    assert isinstance(first, vllm_kv_events.BlockStored)
    # a Put is in the persistent tier: vLLM's "STORAGE" (kvstore.kv_events_media)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids, first.block_size, first.medium) == (
        hashes[:2], None, tokens[: 2 * BS], BS, vllm_kv_events.MEDIUM_STORAGE)  # fmt: skip
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == (
        hashes[2:], hashes[1], tokens[2 * BS :])  # fmt: skip
    assert (untokened.token_ids, untokened.block_size) == ([], 0)
    # a block leaving the store is removed under each medium of the daemon's tiers
    for removed, medium in (
        (removed_cpu, vllm_kv_events.MEDIUM_CPU),
        (removed_storage, vllm_kv_events.MEDIUM_STORAGE),
    ):
        assert isinstance(removed, vllm_kv_events.BlockRemoved)
        assert (removed.block_hashes, removed.medium) == ([hashes[2]], medium)
    # a save through the arena is in the memory tier: vLLM's "CPU"
    assert isinstance(in_arena, vllm_kv_events.BlockStored)
    assert (in_arena.medium, in_arena.token_ids) == (vllm_kv_events.MEDIUM_CPU, list(range(500, 500 + BS)))

    # a subscriber that missed batches asks for them from a sequence: everything from
    # the daemon's start, beginning with AllBlocksCleared (its sequences restarted)
    dealer = zmq_context.socket(zmq.DEALER)
    dealer.connect(replay)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(10_000), "the replay did not end"
        _, topic, seq_bytes, payload = dealer.recv_multipart()
        if seq_bytes == END:
            assert (topic, payload) == (b"", b"")
            break
        replayed.append((int.from_bytes(seq_bytes, "big"), DECODE.decode(payload)))
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    assert isinstance(replayed[0][1].events[0], vllm_kv_events.AllBlocksCleared)
    assert [e for _, b in replayed[-len(live) :] for e in b.events] == events


def test_kv_events_are_refused_with_tenants_or_on_a_public_address_unless_insecure() -> None:
    from kvstore_server.config import ServerConfig

    tenants = ServerConfig(kv_events_endpoint="tcp://127.0.0.1:5557", token_file="tokens.toml")
    assert "tenant" in (tenants.exposure_problem() or "")
    public = ServerConfig(kv_events_endpoint="tcp://0.0.0.0:5557")
    assert "loopback" in (public.exposure_problem() or "")
    assert ServerConfig(kv_events_endpoint="tcp://0.0.0.0:5557", insecure=True).exposure_problem() is None
    assert ServerConfig(kv_events_endpoint="tcp://127.0.0.1:5557").exposure_problem() is None
    with pytest.raises(ValueError, match="tcp://HOST:PORT or ipc://PATH"):
        ServerConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        ServerConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")

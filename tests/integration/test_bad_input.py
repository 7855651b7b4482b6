"""Malformed and oversized requests: the right error, the server stays up, nothing stored is lost.

Against the in-process server (the backend does not matter here: requests are refused
before they reach it)."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import pytest
import torch
from support.daemon import settled

from kvstore.service import SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, LayerSpec, errors

from .helpers import (
    NS,
    assert_intact,
    chain,
    chunk,
    commit,
    header,
    make_layers,
    raw_put,
    raw_stream,
    raw_unary,
    rows,
    rpc_code,
    seed_store,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
H = chain("bad-input", 3)
FP16_4x8 = 64  # bytes of one block of the default raw header's layer (float16 [4, 8])
TWO_LAYERS = (("l0", "float16", (4, 8)), ("l1", "float16", (4, 8)))


def blocks(n: int) -> bytes:
    return bytes(range(256)) * (n * FP16_4x8 // 256) + bytes(n * FP16_4x8 % 256)


# Each case: the messages of one Put stream, and the status the daemon must answer.
PUT_CASES: dict[str, tuple[list[pb.PutRequest | bytes], grpc.StatusCode]] = {
    "empty_stream": ([], INVALID),
    "first_message_a_chunk": ([chunk(0, 0, blocks(1)), commit()], INVALID),
    "first_message_a_commit": ([commit()], INVALID),
    "second_header": ([header(H[:1]), header(H[:1]), commit()], INVALID),
    "more_blocks_than_declared_in_one_chunk": ([header(H[:2]), chunk(0, 0, blocks(3)), commit()], INVALID),
    "more_blocks_than_declared_in_a_later_chunk": (
        [header(H[:2]), chunk(0, 0, blocks(2)), chunk(0, 2, blocks(1)), commit()],
        INVALID,
    ),
    "commit_before_all_layers": ([header(H[:2], TWO_LAYERS), chunk(0, 0, blocks(2)), commit()], INVALID),
    "commit_before_all_blocks": ([header(H[:2]), chunk(0, 0, blocks(1)), commit()], INVALID),
    "chunk_for_undeclared_layer": ([header(H[:1]), chunk(1, 0, blocks(1)), commit()], INVALID),
    "chunk_out_of_block_order": (
        [header(H[:2]), chunk(0, 1, blocks(1)), chunk(0, 0, blocks(1)), commit()],
        INVALID,
    ),
    "chunk_not_whole_blocks": ([header(H[:2]), chunk(0, 0, blocks(1)[:50]), commit()], INVALID),
    # float32 data for a float16 [4, 8] header: twice the bytes, so more blocks than declared
    "dtype_mismatch_data": (
        [header(H[:2]), chunk(0, 0, torch.zeros(2, 4, 8).numpy().tobytes()), commit()],
        INVALID,
    ),
    # a [4, 8] tensor's bytes for a header declaring [4, 6]: not a whole number of blocks
    "shape_mismatch_data": (
        [header(H[:1], (("l0", "float16", (4, 6)),)), chunk(0, 0, blocks(1)), commit()],
        INVALID,
    ),
    "zero_length_chunk": ([header(H[:1]), chunk(0, 0, b""), commit()], INVALID),
    "undecodable_chunk": ([header(H[:1]), b"\x12\x7f\x08\x00", commit()], INVALID),
    "empty_message": ([header(H[:1]), pb.PutRequest(), commit()], INVALID),
    "unsupported_dtype": (
        [header(H[:1], (("l0", "complex64", (4, 8)),)), chunk(0, 0, blocks(4)), commit()],
        INVALID,
    ),
    "unknown_dtype": ([header(H[:1], (("l0", "float4", (4, 8)),)), commit()], INVALID),
    "zero_dimension": ([header(H[:1], (("l0", "float16", (0, 8)),)), commit()], INVALID),
    "empty_shape": ([header(H[:1], (("l0", "float16", ()),)), commit()], INVALID),
    "too_many_dims": ([header(H[:1], (("l0", "float16", (1,) * 9),)), commit()], INVALID),
    "no_layers": ([header(H[:1], ()), commit()], INVALID),
    "repeated_layer_name": ([header(H[:1], (("l0", "float16", (4, 8)),) * 2), commit()], INVALID),
    "reserved_layer_name": ([header(H[:1], (("__metadata__", "float16", (4, 8)),)), commit()], INVALID),
    "empty_layer_name": ([header(H[:1], (("", "float16", (4, 8)),)), commit()], INVALID),
    "empty_namespace": ([header(H[:1], namespace=b""), chunk(0, 0, blocks(1)), commit()], INVALID),
    "namespace_over_256_bytes": (
        [header(H[:1], namespace=b"n" * 257), chunk(0, 0, blocks(1)), commit()],
        INVALID,
    ),
    "no_hashes": ([header([]), commit()], INVALID),
    "hash_too_short": ([header([H[0][:31]]), chunk(0, 0, blocks(1)), commit()], INVALID),
    "hash_too_long": ([header([H[0] + b"x"]), chunk(0, 0, blocks(1)), commit()], INVALID),
    "repeated_hash": ([header([H[0], H[1], H[0]]), chunk(0, 0, blocks(3)), commit()], INVALID),
    "parent_hash_wrong_length": (
        [header(H[:1], parent_hash=b"p" * 16), chunk(0, 0, blocks(1)), commit()],
        INVALID,
    ),
    "closed_without_commit": ([header(H[:2]), chunk(0, 0, blocks(2))], grpc.StatusCode.ABORTED),
    "closed_after_header": ([header(H[:2])], grpc.StatusCode.ABORTED),
}


def test_malformed_put_streams(server, kv: KVStoreClient, subtests: pytest.Subtests) -> None:
    """Every case of the table against one server, which must come through all of them."""
    seeded = seed_store(kv)
    puts_before = kv.stats()["puts"]
    for case, (messages, want) in PUT_CASES.items():
        with subtests.test(case):
            with pytest.raises(grpc.RpcError) as info:
                raw_put(server.address, messages)
            assert info.value.code() == want, info.value.details()
            # the client maps the status to its exception tree
            expected_class = errors.InvalidRequest if want == INVALID else errors.PutAborted
            assert type(errors.from_rpc_error(info.value)) is expected_class

            assert kv.lookup(NS, H) == 0
            stats = kv.stats()
            assert (stats["blocks"], stats["puts"]) == (len(seeded[0]), puts_before)
            assert_intact(kv, seeded)
    assert kv.health() == "SERVING"  # still serving after every case


def test_the_raw_stream_helper_can_store(server, kv: KVStoreClient) -> None:
    """Control for the table above: the same helper with a well-formed stream succeeds."""
    response = raw_put(
        server.address, [header(H[:2]), chunk(0, 0, blocks(1)), chunk(0, 1, blocks(1)), commit()]
    )
    assert (response.blocks_written, response.bytes_written) == (2, 2 * FP16_4x8)
    got = kv.select(NS, H)
    assert got["l0"].reshape(-1).view(torch.uint8).numpy().tobytes() == blocks(2)


def test_oversize_message_is_resource_exhausted(server, kv: KVStoreClient) -> None:
    seeded = seed_store(kv)
    per_block = 34 << 20  # a valid header: two blocks of 34 MiB each, within every per-block limit
    layer = (("l0", "uint8", (per_block,)),)
    with pytest.raises(grpc.RpcError) as info:
        # both blocks in one 68 MiB message, above the 64 MiB cap; the sending
        # side allows anything, so only the daemon's limit applies
        raw_put(
            server.address,
            [header(H[:2], layer), chunk(0, 0, bytes(2 * per_block)), commit()],
            options=[("grpc.max_send_message_length", -1)],
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert "larger than max" in info.value.details()
    assert type(errors.from_rpc_error(info.value)) is errors.CapacityExceeded
    assert kv.lookup(NS, H) == 0
    assert_intact(kv, seeded)


def test_put_above_max_put_bytes(make_server) -> None:
    d = make_server(max_put_bytes="4KiB")
    with KVStoreClient(d.address) as kv:
        seeded = seed_store(kv)  # 3 blocks of 256 bytes
        hashes = chain("max-put", 17)
        layers = make_layers(17)  # 17 * 256 bytes > 4 KiB
        with pytest.raises(errors.CapacityExceeded):
            kv.put(NS, hashes, layers)
        assert kv.lookup(NS, hashes) == 0
        # exactly at the limit is allowed
        assert kv.put(NS, hashes[:16], {k: v[:16] for k, v in layers.items()}).blocks_written == 16
        assert_intact(kv, seeded)


# ---- client-visible errors -----------------------------------------------------------
CLIENT_CASES: dict[str, tuple[Callable[[KVStoreClient], object], type[errors.KVStoreError]]] = {
    "lookup_empty_namespace": (lambda kv: kv.lookup("", H), errors.InvalidRequest),
    "put_empty_namespace": (lambda kv: kv.put(b"", H[:1], make_layers(1)), errors.InvalidRequest),
    "lookup_namespace_over_256": (lambda kv: kv.lookup("n" * 257, H), errors.InvalidRequest),
    "put_namespace_over_256": (lambda kv: kv.put("é" * 129, H[:1], make_layers(1)), errors.InvalidRequest),
    "lookup_short_hash": (lambda kv: kv.lookup(NS, [H[0], H[1][:31]]), errors.InvalidRequest),
    "put_long_hash": (lambda kv: kv.put(NS, [H[0] + b"\0"], make_layers(1)), errors.InvalidRequest),
    "select_short_hash": (lambda kv: kv.select(NS, [b"\0" * 8]), errors.InvalidRequest),
    "put_repeated_hash": (lambda kv: kv.put(NS, [H[0], H[0]], make_layers(2)), errors.InvalidRequest),
    "lookup_repeated_hash": (lambda kv: kv.lookup(NS, [H[0], H[1], H[0]]), errors.InvalidRequest),
    "put_bad_parent": (lambda kv: kv.put(NS, H[:1], make_layers(1), parent_hash=b"p"), errors.InvalidRequest),
    "lookup_too_many_hashes": (
        lambda kv: kv.lookup(NS, [i.to_bytes(32, "big") for i in range(65537)]),
        errors.InvalidRequest,
    ),
    "select_no_hashes": (lambda kv: kv.select(NS, []), errors.InvalidRequest),
    "describe_short_hash": (lambda kv: kv.describe(NS, b"\1" * 31), errors.InvalidRequest),
    "evict_negative_age": (lambda kv: kv.evict(older_than=-1.0), errors.InvalidRequest),
    "evict_nan_age": (lambda kv: kv.evict(older_than=math.nan), errors.InvalidRequest),
    "evict_block_short_hash": (lambda kv: kv.evict(namespace=NS, block_hash=b"\1"), errors.InvalidRequest),
    "list_limit_above_10000": (lambda kv: kv.list_blocks(limit=10001), errors.InvalidRequest),
    "list_bad_page_token": (lambda kv: kv.list_blocks(page_token=b"\0\5abc"), errors.InvalidRequest),
}


def test_client_calls_refused(server, kv: KVStoreClient, subtests: pytest.Subtests) -> None:
    seeded = seed_store(kv)
    for case, (call, expected) in CLIENT_CASES.items():
        with subtests.test(case):
            with pytest.raises(expected) as info:
                call(kv)
            assert type(info.value) is expected
            assert info.value.code == "INVALID_ARGUMENT"
            assert kv.stats()["blocks"] == len(seeded[0])
            assert_intact(kv, seeded)
    assert kv.health() == "SERVING"  # still serving after every case


def test_namespace_of_exactly_256_bytes_is_accepted(kv: KVStoreClient) -> None:
    name = b"n" * 256
    hashes = chain("ns-256", 2, namespace=name)
    assert kv.put(name, hashes, make_layers(2)).blocks_written == 2
    assert kv.lookup(name, hashes) == 2


def test_raw_requests_the_client_cannot_build(server, kv: KVStoreClient) -> None:
    seeded = seed_store(kv)
    hashes = seeded[0]
    addr = server.address
    nan_wait = pb.DropSelectRequest(namespace=NS.encode(), block_hashes=hashes, wait_seconds=math.nan)
    negative_wait = pb.DropSelectRequest(namespace=NS.encode(), block_hashes=hashes, wait_seconds=-1)
    assert rpc_code(lambda: raw_stream(addr, "DropSelect", nan_wait)) == INVALID
    assert rpc_code(lambda: raw_stream(addr, "DropSelect", negative_wait)) == INVALID
    assert rpc_code(lambda: raw_unary(addr, "Evict", pb.EvictRequest(), pb.EvictResponse)) == INVALID
    assert rpc_code(lambda: raw_unary(addr, "Evict", pb.EvictRequest(all=False), pb.EvictResponse)) == INVALID
    empty_ns = pb.EvictRequest(namespace=b"")
    assert rpc_code(lambda: raw_unary(addr, "Evict", empty_ns, pb.EvictResponse)) == INVALID
    get_empty_ns = pb.GetRequest(namespace=b"", block_hashes=hashes)
    assert rpc_code(lambda: raw_stream(addr, "Get", get_empty_ns)) == INVALID
    # a DropSelect that was refused took nothing
    assert_intact(kv, seeded)


def test_client_side_checks_send_nothing(kv: KVStoreClient) -> None:
    """Shape/dtype mismatches and unsupported dtypes are caught before the wire (ValueError)."""
    seeded = seed_store(kv)
    layers = make_layers(2)
    specs = [LayerSpec.of(n, t) for n, t in layers.items()]
    with kv.put_stream(NS, H[:2], specs) as stream:
        with pytest.raises(ValueError, match="expected float16"):
            stream.write_layer("layer.0", torch.zeros(2, 2, 4, 8))  # float32
        with pytest.raises(ValueError, match="expected"):
            stream.write_layer("layer.0", torch.zeros(2, 2, 4, 4, dtype=torch.float16))  # shape
        with pytest.raises(ValueError, match="commit without layers"):
            stream.commit()
    with pytest.raises(ValueError, match="not supported"):
        kv.put(NS, H[:1], {"c": torch.zeros(1, 4, dtype=torch.complex64)})
    assert kv.lookup(NS, H) == 0
    assert_intact(kv, seeded)


def test_parent_links_forming_a_cycle_are_refused(kv: KVStoreClient) -> None:
    """Parent hashes are the client's word: a put that would close a loop is INVALID_ARGUMENT."""
    seeded = seed_store(kv)
    a, b, c = chain("cycle", 3)
    layers = make_layers(2, seed=6)
    with pytest.raises(errors.InvalidRequest, match="cycle"):
        kv.put(NS, [a, b], layers, parent_hash=b)  # b would be its own ancestor
    kv.put(NS, [b], rows(layers, 0, 1), parent_hash=a)
    kv.put(NS, [c], rows(layers, 0, 1), parent_hash=b)
    with pytest.raises(errors.InvalidRequest, match="cycle"):
        kv.put(NS, [a], rows(layers, 0, 1), parent_hash=c)  # a -> b -> c -> a
    assert kv.lookup(NS, [a]) == 0
    assert kv.stats(timeout=10)["blocks"] == len(seeded[0]) + 2
    assert_intact(kv, seeded)


# ---- puts that never commit ------------------------------------------------------------
def test_put_stream_abort_mid_stream_stores_nothing(server, kv: KVStoreClient) -> None:
    seeded = seed_store(kv)
    layers = make_layers(3, num_layers=3, seed=5)
    specs = [LayerSpec.of(n, t) for n, t in layers.items()]

    stream = kv.put_stream(NS, H, specs)
    stream.write_layer("layer.0", layers["layer.0"])
    stream.write_layer("layer.1", layers["layer.1"])
    stream.abort()
    stream.abort()  # idempotent

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with kv.put_stream(NS, H, specs) as second:
            second.write_layer("layer.2", layers["layer.2"])
            raise Boom  # leaving the block by an exception cancels the put

    assert kv.lookup(NS, H) == 0
    assert kv.stats()["puts"] == 1  # only the seed
    assert_intact(kv, seeded)
    # after both cancellations, the same blocks can still be put whole
    assert kv.put(NS, H, layers).blocks_written == 3
    server.stop()  # the daemon's clean shutdown; raises if any step fails
    # a cancel that reached a running handler is logged as such; none is an error
    assert "ERROR" not in server.log() and "Traceback" not in server.log()


def test_put_stream_closed_without_commit_is_put_aborted(server, kv: KVStoreClient) -> None:
    seeded = seed_store(kv)
    with pytest.raises(grpc.RpcError) as info:
        raw_put(server.address, [header(H[:1]), chunk(0, 0, blocks(1))])
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "nothing was stored" in info.value.details()
    with pytest.raises(errors.PutAborted):
        raise errors.from_rpc_error(info.value)
    assert kv.lookup(NS, H) == 0
    assert_intact(kv, seeded)


KVSTORE_METHODS = pb.DESCRIPTOR.services_by_name["KVStore"].methods


@pytest.mark.parametrize(
    "garbage", [b"\xff\xff\xff", b"\x0a\xff\x01", b"\x12\x05ab"], ids=["varint", "len", "short"]
)
def test_undecodable_requests_are_invalid_argument_on_every_method(
    server, kv: KVStoreClient, garbage: bytes
) -> None:
    """gRPC itself answers a deserializer that raises with INTERNAL; the daemon answers
    INVALID_ARGUMENT with a message naming the message type, on every method."""
    seeded = seed_store(kv, "undecodable")
    with grpc.insecure_channel(server.address) as channel:
        for method in KVSTORE_METHODS:
            path = SERVICE_PREFIX + method.name
            if method.client_streaming:
                call = channel.stream_unary(path)
                fn: Callable[[], object] = lambda call=call: call(iter([garbage]), timeout=10)  # noqa: E731
            elif method.server_streaming:
                call = channel.unary_stream(path)
                fn = lambda call=call: list(call(garbage, timeout=10))  # noqa: E731
            else:
                call = channel.unary_unary(path)
                fn = lambda call=call: call(garbage, timeout=10)  # noqa: E731
            with pytest.raises(grpc.RpcError) as info:
                fn()
            assert info.value.code() == INVALID, (method.name, info.value.details())
            assert method.input_type.name in info.value.details(), method.name
    assert_intact(kv, seeded)


def test_metadata_larger_than_the_data_it_describes_is_refused(server, kv: KVStoreClient) -> None:
    """Capacity counts a block's data; its metadata record (names, specs) may not dwarf it:
    1024 one-byte layers with long names would store ~300 KB per block charged 1 KB."""
    seeded = seed_store(kv, "record-size")
    bloated = [(f"{'n' * 200}.{i}", "bool", (1,)) for i in range(1024)]
    code = rpc_code(lambda: raw_put(server.address, [header(H[:2], bloated), commit()]))
    assert code == INVALID
    with pytest.raises(errors.InvalidRequest, match="names and specs take .* bytes per block"):
        kv.put(NS, H[:1], {f"{'n' * 200}.{i}": torch.zeros((1, 1), dtype=torch.bool) for i in range(1024)})
    # small blocks with short names stay fine: the floor is 4 KiB per block
    small = {f"l{i}": torch.zeros((1, 1), dtype=torch.bool) for i in range(16)}
    assert kv.put(NS, H[:1], small).blocks_written == 1
    assert_intact(kv, seeded)


def test_lease_requests_the_client_cannot_build_are_refused(server, kv: KVStoreClient) -> None:
    seeded = seed_store(kv)
    settled(kv)
    hashes = seeded[0]
    for fields in ({"probe": True}, {"lease_from": len(hashes) + 1}, {"lease_holders": 1025}):
        request = pb.LookupRequest(namespace=NS.encode(), block_hashes=hashes, lease=True, **fields)
        assert (
            rpc_code(lambda r=request: raw_unary(server.address, "Lookup", r, pb.LookupResponse)) == INVALID
        )
    with pytest.raises(ValueError, match="lease_holders"):
        kv.where(NS, hashes, lease_from=0, lease_holders=0)
    assert kv.stats()["pinned_bytes"] == 0  # nothing leased
    assert_intact(kv, seeded)

"""kvstore.wire: the hand-rolled LayerChunk codec must be byte-compatible with protobuf."""

from __future__ import annotations

import pytest

from kvstore import wire
from kvstore.v1 import kvstore_pb2 as pb

PAYLOAD = bytes(range(256)) * 3


@pytest.mark.parametrize(
    ("layer", "first", "data"),
    [
        (0, 0, b""),
        (0, 0, b"x"),
        (3, 17, PAYLOAD),
        (1023, 8191, PAYLOAD * 200),  # multi-byte varints for both length fields
        (2**32 - 1, 2**32 - 1, b"\x00" * 130),  # uint32 maxima
    ],
)
def test_encode_chunk_parses_with_generated_classes(layer: int, first: int, data: bytes) -> None:
    raw = wire.encode_chunk(layer, first, [data])
    put = pb.PutRequest.FromString(raw)
    assert put.WhichOneof("msg") == "chunk"
    assert (put.chunk.layer_index, put.chunk.first_block, put.chunk.data) == (layer, first, data)
    get = pb.GetResponse.FromString(raw)
    assert get.WhichOneof("msg") == "chunk"
    assert (get.chunk.layer_index, get.chunk.first_block, get.chunk.data) == (layer, first, data)


def test_encode_chunk_accepts_memoryviews_of_any_format() -> None:
    import array

    floats = array.array("f", [1.0, 2.5, -3.0])
    raw = wire.encode_chunk(2, 5, [memoryview(floats), b"tail"])
    msg = pb.PutRequest.FromString(raw)
    assert msg.chunk.data == floats.tobytes() + b"tail"


def test_multi_part_encode_equals_concatenation() -> None:
    parts = [PAYLOAD[:10], memoryview(PAYLOAD)[10:300], b"", PAYLOAD[300:]]
    assert wire.encode_chunk(4, 9, parts) == wire.encode_chunk(4, 9, [PAYLOAD])
    assert (
        wire.encode_chunk(4, 9, parts)
        == pb.PutRequest(chunk=pb.LayerChunk(layer_index=4, first_block=9, data=PAYLOAD)).SerializeToString()
    )


@pytest.mark.parametrize(("layer", "first"), [(0, 0), (0, 6), (5, 0), (300, 70000)])
def test_decode_put_request_reads_protobuf_serialized_chunks(layer: int, first: int) -> None:
    # protobuf omits zero-valued fields; the decoder must default them
    raw = pb.PutRequest(
        chunk=pb.LayerChunk(layer_index=layer, first_block=first, data=PAYLOAD)
    ).SerializeToString()
    decoded = wire.decode_put_request(raw)
    assert isinstance(decoded, wire.Chunk)
    assert (decoded.layer_index, decoded.first_block) == (layer, first)
    assert isinstance(decoded.data, memoryview)
    assert decoded.data.tobytes() == PAYLOAD


def test_decoded_chunk_data_is_a_view_not_a_copy() -> None:
    raw = wire.encode_chunk(1, 2, [PAYLOAD])
    decoded = wire.decode_put_request(raw)
    assert isinstance(decoded, wire.Chunk)
    assert decoded.data.obj is raw


def test_decode_put_request_header_and_commit_go_through_protobuf() -> None:
    header = pb.PutRequest(
        header=pb.PutHeader(
            namespace=b"ns",
            block_hashes=[b"a" * 32, b"b" * 32],
            layers=[pb.LayerSpec(name="k", dtype="bfloat16", shape=[16, 8, 128])],
            parent_hash=b"p" * 32,
        )
    )
    decoded = wire.decode_put_request(header.SerializeToString())
    assert isinstance(decoded, pb.PutRequest)
    assert decoded == header
    commit = wire.decode_put_request(pb.PutRequest(commit=pb.PutCommit()).SerializeToString())
    assert isinstance(commit, pb.PutRequest)
    assert commit.WhichOneof("msg") == "commit"


def test_decode_get_response() -> None:
    header = pb.GetResponse(
        header=pb.GetHeader(
            num_blocks=3, layers=[pb.LayerSpec(name="v", dtype="float8_e4m3fn", shape=[2, 4])]
        )
    )
    assert wire.decode_get_response(header.SerializeToString()) == header
    raw = pb.GetResponse(chunk=pb.LayerChunk(layer_index=2, first_block=1, data=b"abc")).SerializeToString()
    chunk = wire.decode_get_response(raw)
    assert isinstance(chunk, wire.Chunk)
    assert (chunk.layer_index, chunk.first_block, chunk.data.tobytes()) == (2, 1, b"abc")
    chunk = wire.decode_get_response(wire.encode_chunk(7, 8, [b"xyz"]))
    assert isinstance(chunk, wire.Chunk)
    assert (chunk.layer_index, chunk.first_block, chunk.data.tobytes()) == (7, 8, b"xyz")


def test_encoders_pass_bytes_through_and_serialize_messages() -> None:
    raw = wire.encode_chunk(0, 0, [b"q"])
    assert wire.encode_put_request(raw) is raw
    assert wire.encode_get_response(raw) is raw
    msg = pb.PutRequest(commit=pb.PutCommit())
    assert wire.encode_put_request(msg) == msg.SerializeToString()
    resp = pb.GetResponse(header=pb.GetHeader(num_blocks=1))
    assert wire.encode_get_response(resp) == resp.SerializeToString()


_GOOD = wire.encode_chunk(1, 2, [b"abcdef"])


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12",  # tag without a length
        b"\x12\x80",  # truncated length varint
        _GOOD[:-1],  # shorter than its declared length
        _GOOD + b"\x00",  # longer than its declared length
        b"\x12\x03\x1a\x05ab",  # data longer than the message
        b"\x12\x02\x08\x80",  # truncated varint inside the chunk
        b"\x12\x02\x02\x00",  # field number 0 is invalid protobuf
        b"\x12\x0b\x08" + b"\xff" * 10,  # varint over 64 bits
        b"\xff\xff\xff",  # not protobuf at all
        b"\x0a\x05ab",  # header with truncated payload
    ],
)
def test_malformed_put_requests_give_malformed(raw: bytes) -> None:
    decoded = wire.decode_put_request(raw)
    assert isinstance(decoded, wire.Malformed)
    assert decoded.reason.startswith("undecodable PutRequest")


def test_decode_get_response_raises_on_garbage() -> None:
    with pytest.raises(ValueError):
        wire.decode_get_response(b"\x12\x05\x08")


def test_limits_are_consistent() -> None:
    assert wire.MAX_CHUNK_BYTES < wire.MAX_MESSAGE_BYTES
    assert wire.DEFAULT_CHUNK_BYTES <= wire.MAX_CHUNK_BYTES
    assert wire.HASH_BYTES == 32
    # the framing of a max-size chunk fits the gRPC message cap
    framing = len(wire.encode_chunk(2**32 - 1, 2**32 - 1, [b""])) + 10
    assert wire.MAX_CHUNK_BYTES + framing <= wire.MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("dtype", "shape", "expected"),
    [
        ("bfloat16", (16, 8, 128), 32768),
        ("float8_e4m3fn", (3, 5), 15),
        ("float64", (2,), 16),
        ("bool", (7,), 7),
    ],
)
def test_layer_block_bytes(dtype: str, shape: tuple[int, ...], expected: int) -> None:
    assert wire.layer_block_bytes(dtype, shape) == expected


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x0c\x08\x01\x10\x02\x1a\x06abcdef\x20\x07",  # an unknown field inside the LayerChunk
        _GOOD + b"\x28\x01",  # an unknown field after the chunk
        b"\x12\x02\x08\x01\x12\x0a\x10\x02\x1a\x06abcdef",  # the chunk in two occurrences (merged)
    ],
    ids=["unknown-inner-field", "unknown-outer-field", "split-chunk"],
)
def test_valid_encodings_the_fast_decoder_does_not_read_go_to_protobuf(raw: bytes) -> None:
    """Any valid protobuf encoding is accepted, so a client with newer fields still works."""
    decoded = wire.decode_put_request(raw)
    assert isinstance(decoded, pb.PutRequest) and decoded.WhichOneof("msg") == "chunk"
    assert (decoded.chunk.layer_index, decoded.chunk.first_block, decoded.chunk.data) == (1, 2, b"abcdef")

"""Shared wire facts: limits, dtypes and the fast codec for bulk data messages.

The bulk messages (PutRequest and GetResponse carrying a LayerChunk) are
encoded and decoded here by hand, with memoryviews instead of protobuf bytes
fields, so a chunk's payload is copied once per side instead of three times.
The bytes on the wire are exactly the protobuf encoding of the messages in
protos/kvstore/v1/kvstore.proto: a client built from the generated stubs alone
interoperates with the daemon, and the daemon with it. Every other message goes
through the generated protobuf classes.

Used by both the daemon and the client; imports neither torch nor numpy.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from kvstore.v1 import kvstore_pb2 as pb

# ---- limits (documented in README "Limits"); the daemon may lower some by config
HASH_BYTES: Final = 32
MAX_NAMESPACE_BYTES: Final = 256
MAX_LAYER_NAME_BYTES: Final = 256
MAX_LAYERS: Final = 4096  # the connector stores each KV head of each layer as one
MAX_SHAPE_DIMS: Final = 8
MAX_BLOCKS_PER_LOOKUP: Final = 65536
MAX_LOOKUP_NAMESPACES: Final = 64
MAX_BLOCKS_PER_PUT: Final = 8192
MAX_MANY: Final = 1024  # chains of one ReserveMany or PinMany, commits of one CommitMany
MAX_LEASE_HOLDERS: Final = 1024  # LookupRequest.lease_holders
# A Lookup's leases answer with where each block lies and its checksums: beyond this many
# bytes in all, none is taken (the loads pin their own), so a long prompt's lookup never
# grows past the message limit
MAX_LEASE_ANSWER_BYTES: Final = 16 << 20
MAX_TOKENS_PER_BLOCK: Final = 4096  # token ids a put may give per block (KV events)
# A block's metadata record may be as large as its data, or this when the data is smaller.
MAX_RECORD_FLOOR: Final = 4096
DEFAULT_CHUNK_BYTES: Final = 4 << 20
# gRPC message cap on both sides; a chunk plus its few bytes of framing must fit.
MAX_MESSAGE_BYTES: Final = 64 << 20
MAX_CHUNK_BYTES: Final = MAX_MESSAGE_BYTES - 1024

# HTTP/2 keepalive. The client pings every 10 s while it has calls open and drops a
# connection whose pings go unanswered for 5 s (a stalled or vanished daemon would
# otherwise keep close() waiting); the daemon accepts those pings, and pings its own
# clients every 30 s, so a client that vanished without a FIN releases what its
# calls hold (a Put's budget, a worker thread) within 40 s.
CLIENT_KEEPALIVE: Final = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)
SERVER_KEEPALIVE: Final = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
)

# torch dtype name -> (element size, safetensors dtype code)
DTYPES: Final[dict[str, tuple[int, str]]] = {
    "bool": (1, "BOOL"),
    "uint8": (1, "U8"),
    "int8": (1, "I8"),
    "int16": (2, "I16"),
    "uint16": (2, "U16"),
    "int32": (4, "I32"),
    "uint32": (4, "U32"),
    "int64": (8, "I64"),
    "uint64": (8, "U64"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float32": (4, "F32"),
    "float64": (8, "F64"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
}


# kvstore.blocks' STOP_* reasons <-> kvstore.v1.StopReason (GetHeader, PinResponse).
# NOTE: spelled out, not imported from kvstore.blocks, which imports this module.
STOP_REASONS: Final[dict[str, pb.StopReason]] = {
    "none": pb.STOP_REASON_NONE,
    "not_stored": pb.STOP_REASON_NOT_STORED,
    "layer_set_differs": pb.STOP_REASON_LAYER_SET_DIFFERS,
    "checksum_failed": pb.STOP_REASON_CHECKSUM_FAILED,
    "evicted": pb.STOP_REASON_EVICTED,
    "no_room": pb.STOP_REASON_NO_ROOM,
    "not_in_memory": pb.STOP_REASON_NOT_IN_MEMORY,
}
_STOP_NAMES: Final[dict[int, str]] = {value: name for name, value in STOP_REASONS.items()}


def stop_reason_name(value: int) -> str:
    """A StopReason from the wire as kvstore.blocks names it; "unknown" for UNSPECIFIED (a
    daemon that does not say) and for values this side does not know."""
    return _STOP_NAMES.get(value, "unknown")


def layer_block_bytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of one block of one layer (shape excludes the block dimension)."""
    size = DTYPES[dtype][0]
    for dim in shape:
        size *= dim
    return size


# ---- fast codec for LayerChunk-carrying messages --------------------------------
# PutRequest.chunk and GetResponse.chunk are both field 2, length-delimited.
_TAG_CHUNK: Final = 0x12
_TAG_LAYER: Final = 0x08  # LayerChunk.layer_index, varint
_TAG_FIRST: Final = 0x10  # LayerChunk.first_block, varint
_TAG_DATA: Final = 0x1A  # LayerChunk.data, length-delimited


def pack_checksums(values: Sequence[int]) -> bytes:
    """Checksums as CommitRequest/PinResponse carry them: little-endian uint64s, packed."""
    packed = values if isinstance(values, array) and values.typecode == "Q" else array("Q", values)
    if sys.byteorder != "little":
        packed = array("Q", packed)  # (byteswap works in place)
        packed.byteswap()
    return packed.tobytes()


def unpack_checksums(data: bytes) -> array[int]:
    """The uint64s of a packed checksums field (ValueError unless whole 8-byte words)."""
    if len(data) % 8:
        raise ValueError(f"packed checksums of {len(data)} bytes: not a whole number of uint64s")
    values = array("Q")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


class Chunk(NamedTuple):
    """A decoded LayerChunk whose data is a view into the received message (a tuple:
    cheap to make, and loads make one per block and layer)."""

    layer_index: int
    first_block: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class Malformed:
    """A message that did not decode; the servicer answers INVALID_ARGUMENT."""

    reason: str


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(layer_index: int, first_block: int, parts: Sequence[memoryview | bytes]) -> bytes:
    """Encode PutRequest{chunk} / GetResponse{chunk} whose data is `parts` joined.

    One copy of the payload: the parts go straight into the message bytes.
    """
    nbytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    inner_head = b"".join(
        (
            bytes((_TAG_LAYER,)),
            _varint(layer_index),
            bytes((_TAG_FIRST,)),
            _varint(first_block),
            bytes((_TAG_DATA,)),
            _varint(nbytes),
        )
    )
    return b"".join((bytes((_TAG_CHUNK,)), _varint(len(inner_head) + nbytes), inner_head, *parts))


def _decode_chunk(buf: memoryview) -> Chunk:
    # buf holds one message whose only field is the chunk (field 2)
    if buf[0] != _TAG_CHUNK:
        raise ValueError("not a chunk")
    length, pos = _read_varint(buf, 1)
    if pos + length != len(buf):
        raise ValueError("chunk length does not match the message")
    layer = first = 0
    data = memoryview(b"")
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        if tag == _TAG_LAYER:
            layer, pos = _read_varint(buf, pos)
        elif tag == _TAG_FIRST:
            first, pos = _read_varint(buf, pos)
        elif tag == _TAG_DATA:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated chunk data")
            data = buf[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unexpected field tag {tag} in LayerChunk")
    return Chunk(layer, first, data)


def decode_put_request(raw: bytes) -> pb.PutRequest | Chunk | Malformed:
    """gRPC request deserializer for Put: chunks by hand, the rest by protobuf.

    A chunk the fast decoder does not take (fields it does not know, a chunk split
    in two) goes to protobuf, so any valid encoding of the message is accepted."""
    fast_error = ""
    if raw[:1] == bytes((_TAG_CHUNK,)):
        try:
            return _decode_chunk(memoryview(raw))
        except ValueError as exc:  # not the plain layout this decoder reads: protobuf decides
            fast_error = f" ({exc})"
    try:
        return pb.PutRequest.FromString(raw)
    except Exception as exc:  # noqa: BLE001 - any decode failure becomes INVALID_ARGUMENT
        return Malformed(f"undecodable PutRequest: {exc}{fast_error}")


def encode_put_request(msg: pb.PutRequest | bytes) -> bytes:
    """gRPC request serializer for Put: pre-encoded chunks pass through."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def decode_get_response(raw: bytes) -> pb.GetResponse | Chunk:
    """gRPC response deserializer for Get/DropSelect."""
    if raw[:1] == bytes((_TAG_CHUNK,)):
        return _decode_chunk(memoryview(raw))
    return pb.GetResponse.FromString(raw)


def encode_get_response(msg: pb.GetResponse | bytes) -> bytes:
    """gRPC response serializer for Get/DropSelect: pre-encoded chunks pass through."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


# LookupResponse.tiers: where each block of a found prefix is read from (one byte a block).
TIER_MEMORY = 0
TIER_PERSISTENT = 1
TIER_FLEET = 2
TIER_NAMES = ("memory", "persistent", "fleet")

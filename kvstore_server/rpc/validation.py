"""Request validation at the edge: namespaces, hashes, layer specs, record and chunk sizes.

Each check raises InvalidRequest (INVALID_ARGUMENT) before the request reaches the
store; the limits are kvstore.wire's, shared with the client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from kvstore import wire
from kvstore.blocks import intern_layout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_server.errors import InvalidRequest
from kvstore_server.parts import PartError, check_subset
from kvstore_server.tiers import BlockMeta, LayerSpec


def check_namespace(namespace: bytes) -> bytes:
    if not namespace:
        raise InvalidRequest("namespace must not be empty")
    if len(namespace) > wire.MAX_NAMESPACE_BYTES:
        raise InvalidRequest(f"namespace is {len(namespace)} bytes; the limit is {wire.MAX_NAMESPACE_BYTES}")
    return namespace


def check_hash(block_hash: bytes, what: str = "block hash") -> bytes:
    if len(block_hash) != wire.HASH_BYTES:
        raise InvalidRequest(f"{what} must be {wire.HASH_BYTES} bytes, got {len(block_hash)}")
    return block_hash


def check_hashes(hashes: Sequence[bytes], limit: int, allow_empty: bool = False) -> list[bytes]:
    if not hashes and not allow_empty:
        raise InvalidRequest("block_hashes must not be empty")
    if len(hashes) > limit:
        raise InvalidRequest(f"{len(hashes)} block hashes; the limit is {limit} per call")
    out = [check_hash(h) for h in hashes]
    if len(set(out)) != len(out):
        raise InvalidRequest("block_hashes repeats a hash; a chain never does")
    return out


def check_block_tokens(token_ids: Sequence[int], blocks: int) -> list[int]:
    """A put's optional token ids: none, or the same whole number for each block."""
    if not token_ids:
        return []
    per_block, rest = divmod(len(token_ids), blocks)
    if rest or per_block > wire.MAX_TOKENS_PER_BLOCK:
        raise InvalidRequest(
            f"{len(token_ids)} token ids for {blocks} blocks: give the same number for each block, "
            f"at most {wire.MAX_TOKENS_PER_BLOCK}"
        )
    return list(token_ids)


# Layouts already checked, by their (name, dtype, shape) rows: a model sends the same one
# with every save, and checking 256 store layers (a KV head each) took 1.2 ms a request.
_CHECKED: dict[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[LayerSpec, ...]] = {}
_MAX_CHECKED = 64


def check_layers(specs: Sequence[pb.LayerSpec]) -> tuple[LayerSpec, ...]:
    if not specs:
        raise InvalidRequest("a put needs at least one layer")
    if len(specs) > wire.MAX_LAYERS:
        raise InvalidRequest(f"{len(specs)} layers; the limit is {wire.MAX_LAYERS}")
    key = tuple([(spec.name, spec.dtype, tuple(spec.shape)) for spec in specs])
    return _kept(_CHECKED, key, lambda: _checked_layers(specs))


def _kept(
    cache: dict[Any, tuple[LayerSpec, ...]], key: Any, check: Callable[[], tuple[LayerSpec, ...]]
) -> tuple[LayerSpec, ...]:
    """A layout checked already, found by `key`; else `check()`, kept (at most
    _MAX_CHECKED layouts: models come and go)."""
    found = cache.get(key)
    if found is None:
        found = check()
        if len(cache) >= _MAX_CHECKED:
            cache.clear()
        cache[key] = found
    return found


# Layouts already checked, by their serialized Layout (ReserveRequest.layout): found by
# the bytes' hash, without reading 256 LayerSpec messages (0.33 ms) to make a key.
_CHECKED_LAYOUTS: dict[bytes, tuple[LayerSpec, ...]] = {}


def check_layout(specs: Sequence[pb.LayerSpec], layout: bytes) -> tuple[LayerSpec, ...]:
    """A request's layers: as repeated LayerSpec, or as a serialized Layout (one of the two)."""
    if not layout:
        return check_layers(specs)
    if specs:
        raise InvalidRequest("give layers or layout, not both")
    return _kept(_CHECKED_LAYOUTS, layout, lambda: check_layers(_parsed_layout(layout).layers))


def _parsed_layout(layout: bytes) -> pb.Layout:
    try:
        return pb.Layout.FromString(layout)
    except DecodeError as exc:
        raise InvalidRequest(f"layout is not a serialized Layout message: {exc}") from exc


def _checked_layers(specs: Sequence[pb.LayerSpec]) -> tuple[LayerSpec, ...]:
    out = []
    names = set()
    for spec in specs:
        name = spec.name
        if not name or len(name.encode()) > wire.MAX_LAYER_NAME_BYTES:
            raise InvalidRequest(f"layer name must be 1..{wire.MAX_LAYER_NAME_BYTES} bytes: {name[:64]!r}")
        if name == "__metadata__" or name in names:
            raise InvalidRequest(f"layer name {name!r} is reserved or repeated")
        names.add(name)
        if spec.dtype not in wire.DTYPES:
            raise InvalidRequest(
                f"layer {name!r}: unsupported dtype {spec.dtype!r}; supported: {', '.join(wire.DTYPES)}"
            )
        shape = tuple(spec.shape)
        if not shape or len(shape) > wire.MAX_SHAPE_DIMS or any(d == 0 for d in shape):
            raise InvalidRequest(
                f"layer {name!r}: shape {list(shape)} must have 1..{wire.MAX_SHAPE_DIMS} non-zero dims"
            )
        nbytes = wire.layer_block_bytes(spec.dtype, shape)
        if nbytes > wire.MAX_CHUNK_BYTES:
            raise InvalidRequest(
                f"layer {name!r}: {nbytes} bytes per block; the limit is {wire.MAX_CHUNK_BYTES}"
            )
        out.append(LayerSpec(name, spec.dtype, shape, nbytes))
    return intern_layout(tuple(out))


def check_layer_subset(subset: Sequence[int], num_layers: int) -> tuple[int, ...] | None:
    """A partial put's layer indices (kvstore_server.parts); None: the whole block."""
    try:
        return check_subset(subset, num_layers)
    except PartError as exc:
        raise InvalidRequest(f"layer_subset: {exc}") from exc


# A record's size per layout and key lengths, measured once: a ReserveMany of 32 chains of
# 256 store layers measured it 32 times (~0.1 ms each). `_CREATED`: a timestamp's length.
_RECORD_SIZES: dict[tuple[int, int, int], tuple[tuple[LayerSpec, ...], int]] = {}
_CREATED = 1_700_000_000.1234567


def check_record_size(namespace: bytes, block_hash: bytes, layers: Sequence[LayerSpec]) -> None:
    """A block's metadata record (layer names and specs, stored beside its bytes) may be
    at most max(its payload, MAX_RECORD_FLOOR): capacity counts payload, so a header of
    a thousand long-named one-byte layers would otherwise store (and, committing, hold
    in memory) hundreds of times what it is charged."""
    layers = tuple(layers)
    payload = sum(layer.nbytes for layer in layers)
    key = (id(layers), len(namespace), len(block_hash))  # what the record's size depends on
    known = _RECORD_SIZES.get(key)
    if known is not None and known[0] is layers:  # (interned layouts: the same tuple each time)
        record = known[1]
    else:
        record = len(
            BlockMeta(
                namespace, block_hash, block_hash, layers, (2**64 - 1,) * len(layers), _CREATED
            ).to_json()
        )
        if len(_RECORD_SIZES) >= _MAX_CHECKED:
            _RECORD_SIZES.clear()
        _RECORD_SIZES[key] = (layers, record)
    if record > max(payload, wire.MAX_RECORD_FLOOR):
        raise InvalidRequest(
            f"the layers' names and specs take {record} bytes per block, more than the block's "
            f"{payload} bytes of data; the limit is max(data, {wire.MAX_RECORD_FLOOR})"
        )


def _chunk_size(requested: int) -> int:
    """Bytes per Get message: what the client asks, at most DEFAULT_CHUNK_BYTES (4 MiB).
    Each stream holds about three copies of one message (ours, gRPC's, the socket's),
    so this cap is what bounds a Get's memory; a larger block-layer still goes whole."""
    return min(requested or wire.DEFAULT_CHUNK_BYTES, wire.DEFAULT_CHUNK_BYTES)

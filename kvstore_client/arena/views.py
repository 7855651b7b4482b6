"""Views over extents: a layer's blocks as typed tensors, the layouts kept per model
(as sent in requests and as read from Pin answers), and the checksums of pieces of
the arena, hashed over threads when the pieces are large."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash
from google.protobuf.message import DecodeError

from kvstore import arena_format as fmt
from kvstore import wire
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.arena.mapping import Mapping

if TYPE_CHECKING:
    import torch

_checksum = xxhash.xxh3_64_intdigest
# xxhash releases the GIL only for inputs above 64 KiB (measured on an H200 host: 64 KiB
# pieces hash at ~6 GB/s however many threads; 128 KiB pieces at 20 GB/s on 4 threads,
# 27 on 8), and a task per piece costs more than hashing it: one task per thread, each
# over a contiguous share of the pieces.
_PARALLEL_PIECE = (64 << 10) + 1
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))


def _layer_sizes(layers: Sequence[Any]) -> list[int]:
    return [wire.layer_block_bytes(spec.dtype, tuple(spec.shape)) for spec in layers]


# A model's layout comes and goes with every save and load: its 256 store layers (a KV
# head each) took ~0.5 ms to build into a request and ~0.4 ms to read from a Pin answer.
# Both are kept by the layout's (name, dtype, shape) rows; the parsed one is a tuple, so
# every Pinned may share it.
_LAYOUTS_KEPT = 64
_WIRE_LAYERS: dict[tuple[tuple[str, str, tuple[int, ...]], ...], tuple[list[pb.LayerSpec], bytes]] = {}
_PINNED_LAYOUTS: dict[tuple[Any, ...], PinnedLayout] = {}


def _wire_layers(layers: Sequence[Any]) -> tuple[list[pb.LayerSpec], bytes]:
    """A layout as LayerSpec messages, and as a serialized Layout (what a daemon that
    offers layouts reads instead: ReserveRequest.layout)."""
    key = tuple([(s.name, s.dtype, tuple(s.shape)) for s in layers])
    found = _WIRE_LAYERS.get(key)
    if found is None:
        if len(_WIRE_LAYERS) >= _LAYOUTS_KEPT:
            _WIRE_LAYERS.clear()
        specs = [pb.LayerSpec(name=n, dtype=d, shape=shape) for n, d, shape in key]
        found = _WIRE_LAYERS[key] = (specs, pb.Layout(layers=specs).SerializeToString())
    return found


def layout_fields(layers: Sequence[Any], as_bytes: bool) -> dict[str, Any]:
    """A Reserve request's layout: `layout` (one bytes field) where the daemon reads it,
    else `layers`."""
    specs, layout = _wire_layers(layers)
    return {"layout": layout} if as_bytes else {"layers": specs}


PinnedLayout = tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...]]


def _pinned_layout(resp: pb.PinResponse, spec_type: Any) -> PinnedLayout:
    """A Pin answer's layers (as `spec_type`), their bytes per block and their starts in a
    one-block extent. A serialized Layout (PinResponse.layout) is found by its bytes; the
    answer of a daemon that sends LayerSpec messages, by their rows."""
    if resp.layout:
        key: tuple[Any, ...] = (spec_type, resp.layout)
        found = _PINNED_LAYOUTS.get(key)
        if found is None:
            try:
                specs: Sequence[pb.LayerSpec] = pb.Layout.FromString(resp.layout).layers
            except DecodeError as exc:
                raise errors.StoreInternalError(f"Pin answer: its layout does not parse: {exc}") from exc
    else:
        specs = resp.layers
        key = (spec_type, *[(s.name, s.dtype, tuple(s.shape)) for s in specs])
        found = _PINNED_LAYOUTS.get(key)
    if found is None:
        layers = tuple(spec_type(s.name, s.dtype, tuple(s.shape)) for s in specs)
        sizes = _layer_sizes(layers)
        if len(_PINNED_LAYOUTS) >= _LAYOUTS_KEPT:
            _PINNED_LAYOUTS.clear()
        found = _PINNED_LAYOUTS[key] = (layers, tuple(sizes), tuple(fmt.layer_starts(sizes)))
    return found


def _typed(mapping: Mapping, offset: int, count: int, spec: Any) -> torch.Tensor:
    """`count` blocks of one layer at `offset` as a [count, *shape] tensor of its dtype."""
    from kvstore_client.tensors import torch_dtype

    nbytes = wire.layer_block_bytes(spec.dtype, tuple(spec.shape)) * count
    raw = mapping.tensor()[offset : offset + nbytes]
    return raw.view(torch_dtype(spec.dtype)).view(count, *spec.shape)


def _typed_rows(rows: torch.Tensor, spec: Any) -> torch.Tensor:
    """uint8 rows [count, layer bytes] (strided) as a [count, *shape] tensor of the layer's dtype."""
    from kvstore_client.tensors import torch_dtype

    return rows.view(torch_dtype(spec.dtype)).view(rows.shape[0], *spec.shape)


def _hash_all(pieces: Sequence[memoryview]) -> list[int]:
    return [_checksum(piece) for piece in pieces]


def checksums(pieces: Sequence[memoryview]) -> list[int]:
    """xxh3-64 of each piece; split over threads when the pieces release the GIL."""
    if _HASH_THREADS < 2 or len(pieces) < 2 or len(pieces[0]) < _PARALLEL_PIECE:
        return _hash_all(pieces)
    share = -(-len(pieces) // _HASH_THREADS)
    parts = [pieces[i : i + share] for i in range(share, len(pieces), share)]
    futures = [_hasher().submit(_hash_all, part) for part in parts]
    out = _hash_all(pieces[:share])  # this thread takes the first share
    for future in futures:
        out.extend(future.result())
    return out


_HASHER: ThreadPoolExecutor | None = None
_HASHER_LOCK = threading.Lock()


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    with _HASHER_LOCK:
        if _HASHER is None:
            _HASHER = ThreadPoolExecutor(_HASH_THREADS - 1, thread_name_prefix="kvstore-xxh3")
        return _HASHER

"""The save side: `Reservation` (an extent reserved for a save: write, then commit)
and `ArenaPutStream` (PutStream's interface over a reservation)."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore import arena_format as fmt
from kvstore import wire
from kvstore.blocks import XXH3
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import errors
from kvstore_client.arena.mapping import Call, Mapping
from kvstore_client.arena.views import _layer_sizes, _typed, checksums
from kvstore_client.streams import LayerWrites

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def _put_result(resp: Any) -> Any:
    """A Commit's answer as a PutResult (None: nothing was reserved, nothing written)."""
    from kvstore_client.types import PutResult

    if resp is None:
        return PutResult(0, 0, 0, 0)
    return PutResult(resp.blocks_written, resp.blocks_skipped, resp.bytes_written, resp.blocks_evicted)


class Reservation:
    """An extent reserved for a save: write each layer's blocks, then `commit()`.

    `blocks` are the indexes (into the request's hashes) of the blocks to write:
    the ones the store did not hold yet, in extent order. `layer(i)` is the
    [len(blocks), *shape] view of layer i in the arena. Nothing is visible until
    commit; `abort()` gives the space back (so does the lease running out).
    """

    def __init__(
        self,
        call: Call,
        mapping: Mapping,
        resp: pb.ReserveResponse,
        layers: Sequence[Any],
        subset: Sequence[int] = (),
    ) -> None:
        self._call = call
        self.mapping = mapping
        self.reservation_id: int = resp.reservation_id
        self.blocks: list[int] = list(resp.blocks)
        self.offset: int = resp.offset
        self.lease_seconds: float = resp.lease_seconds
        self.layers = [layers[k] for k in subset] if subset else list(layers)
        self._index = {spec.name: i for i, spec in enumerate(self.layers)}
        self._sizes = _layer_sizes(self.layers)
        # where each layer's run of these blocks starts, relative to `offset`: layers back
        # to back, or, written in place (a partial save into its blocks' one extent: see
        # ReserveResponse.extent_blocks), where the subset's layers lie among all layers
        self.in_place = bool(resp.extent_blocks)
        if self.in_place:
            full = _layer_sizes(layers)
            starts = fmt.layer_offsets(full, resp.extent_blocks)
            self._starts = [starts[k] + resp.position * full[k] for k in subset]
        else:
            self._starts = fmt.layer_offsets(self._sizes, len(self.blocks))
        self.done = False

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def layer(self, layer: str | int) -> torch.Tensor:
        i = self._index[layer] if isinstance(layer, str) else layer
        return _typed(self.mapping, self.offset + self._starts[i], len(self.blocks), self.layers[i])

    def layer_start(self, layer: int) -> int:
        """Where `layer`'s blocks start, relative to `offset` (back to back with the
        layer before it, unless `in_place`: then where the layout puts it among the other
        ranks' layers; a rank's consecutive layers of one attention layer still lie back to
        back)."""
        return self._starts[layer]

    def layer_pieces(self, layer: int) -> list[memoryview]:
        """Each written block's bytes of one layer, in block order."""
        view, size = self.mapping.view, self._sizes[layer]
        at = self.offset + self._starts[layer]
        return [view[at + i * size : at + (i + 1) * size] for i in range(len(self.blocks))]

    def checksums(self, per_layer: dict[int, list[int]] | None = None) -> array[int]:
        """Commit's checksums, block-major; `per_layer[l]` may come precomputed (e.g. each
        layer hashed as soon as its copy landed), the other layers are hashed now."""
        width = len(self.layers)
        out = array("Q", bytes(8 * width * len(self.blocks)))
        for layer in range(width):  # one strided assignment a layer, not an int a block-layer
            sums = per_layer.get(layer) if per_layer else None
            out[layer::width] = array("Q", checksums(self.layer_pieces(layer)) if sums is None else sums)
        return out

    def commit(self, sums: Sequence[int] | bytes | None = None, *, kind: str = XXH3) -> Any:
        """Checksum what was written (unless `sums` come precomputed, of `kind`: "xxh3", or
        "wsum32" as a GPU computes it, see kvstore.blocks; block-major, as ints or already
        packed as little-endian uint64s) and commit."""
        req = self.commit_request(sums, kind=kind)
        if req is None:  # every block was stored already: nothing was reserved
            return _put_result(None)
        try:
            return _put_result(self._call("Commit", req))
        except errors.KVStoreError:
            self.done = False  # not committed: abort() gives the extent back
            raise

    def commit_request(self, sums: Sequence[int] | bytes | None = None, *, kind: str = XXH3) -> Any:
        """The CommitRequest of commit() (None when nothing was reserved); the reservation
        counts as committed from here on."""
        self.done = True
        if not self.blocks:
            return None
        if sums is None:
            sums = self.checksums()
        packed = sums if isinstance(sums, bytes) else wire.pack_checksums(sums)
        return pb.CommitRequest(reservation_id=self.reservation_id, checksums=packed, checksum_kind=kind)

    def abort(self) -> None:
        """Give the extent back; safe to call twice. A failure is logged (the lease frees it)."""
        if self.done or not self.blocks:
            self.done = True
            return
        self.done = True
        try:
            self._call("Abort", pb.AbortRequest(reservation_id=self.reservation_id))
        except errors.KVStoreError as exc:
            log.info("could not abort reservation %d (its lease will end it): %s", self.reservation_id, exc)


class ArenaPutStream:
    """PutStream's interface over a reservation: each write_layer copies the layer's
    blocks straight into the arena (the blocks the store lacks), commit checksums and
    commits. The tensors may be reused as soon as write_layer returns."""

    def __init__(self, reservation: Reservation, num_blocks: int, timeout: float) -> None:
        self.reservation = reservation
        self.layers = reservation.layers
        self.num_blocks = num_blocks
        self.timeout = timeout
        self._writes = LayerWrites(self.layers, num_blocks)
        self._ids: torch.Tensor | None = None
        self._done = False

    def write_layer(self, layer: str | int, tensor: torch.Tensor) -> None:
        import torch

        from kvstore_client.tensors import copy_into

        index, _spec = self._writes.take(layer, tensor)
        blocks = self.reservation.blocks
        if blocks:
            dest = self.reservation.layer(index)
            if len(blocks) == self.num_blocks:
                copy_into(dest, tensor)
            else:
                if self._ids is None:
                    self._ids = torch.tensor(blocks, dtype=torch.long, device=tensor.device)
                torch.index_select(tensor, 0, self._ids, out=dest)

    def commit(self) -> Any:
        from kvstore_client.types import PutResult

        missing = self._writes.missing()
        if missing:
            self.abort()
            raise ValueError(f"commit without layers {missing[:4]}")
        self._done = True
        if not self.reservation.blocks:
            return PutResult(0, self.num_blocks, 0, 0)
        return self.reservation.commit()

    def abort(self) -> None:
        if not self._done:
            self._done = True
            if self.reservation.blocks:
                self.reservation.abort()

    def __enter__(self) -> ArenaPutStream:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None or not self._done:
            self.abort()

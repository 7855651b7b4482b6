"""The worker's arena transport: KV moves between the paged cache and the daemon's
shared-memory arena directly; gRPC carries only Reserve/Commit and Pin/Release.

Saves (per step): one reservation per request, opened at the step's first saved
layer. Each layer's blocks of a request are one contiguous run in its extent,
so `save_layer` issues one indexed gather per request and layer straight into
the reservation (on CUDA: gather and device-to-host copy on a side stream that
waits for the compute stream; the compute stream never waits for it). The
commit runs on the sender thread once that request's copies have completed:
checksums (xxh3, threads) of the arena bytes, then Commit.

Loads: Pin, then per layer verify the layer's checksums and copy each pinned run
(contiguous, ≥ 64 KiB for real models) into the paged blocks (on CUDA:
host-to-device and scatter on side streams, the layer's event handed to the
layer gate so the compute stream waits GPU-side only). The pin is released when
the copies are done; a pin whose lease ran out meanwhile fails the load.

NOTE: bytes are verified in the arena before the copy. A process that maps the
arena could still change them between the check and the copy; the arena is
shared only with processes trusted with the KV (see kvstore_client.arena).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvstore_client import KVStoreClient, LayerSpec
from kvstore_client.arena import checksums
from kvstore_client.errors import KVStoreError, LocalDataCorrupt, StoreTimeout

if TYPE_CHECKING:
    from kvstore_client.arena import Reservation
    from kvstore_connector.metadata import LoadSpec, SaveSpec
    from kvstore_connector.transfer import BlockMover

log = logging.getLogger("vllm." + __name__)


@dataclass
class ArenaSave:
    spec: SaveSpec
    reservation: Reservation
    ids: torch.Tensor | None  # paged block ids of the blocks to write, in extent order
    started: float
    copies: list[tuple[int, Any]] = field(default_factory=list)  # (layer index, PendingCopy)

    def wait(self) -> None:
        for _index, copy in self.copies:
            copy.wait()
        self.copies = []


class ArenaTransport:
    def __init__(
        self,
        client: KVStoreClient,
        namespace: bytes,
        specs: list[LayerSpec],
        caches: dict[str, torch.Tensor],
        mover: BlockMover,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.specs = specs
        self.caches = caches
        self.mover = mover
        self._layer_index = {spec.name: i for i, spec in enumerate(specs)}

    # ---- saves
    def open(self, spec: SaveSpec, timeout: float) -> ArenaSave | None:
        """A reservation for one request's blocks; None: save it over gRPC instead."""
        res = self.client.reserve(
            self.namespace, spec.hashes, self.specs, parent_hash=spec.parent_hash, timeout=timeout
        )
        if res is None:
            return None
        ids = self.mover.index([spec.block_ids[i] for i in res.blocks]) if res.blocks else None
        return ArenaSave(spec, res, ids, time.perf_counter())

    def save_layer(self, save: ArenaSave, layer: str, kv: torch.Tensor) -> None:
        if save.ids is None:
            return
        index = self._layer_index[layer]
        save.copies.append((index, self.mover.gather_into(kv, save.ids, save.reservation.layer(index))))

    def commit(self, save: ArenaSave) -> Any:
        """Wait for the save's copies, then checksum and commit (the sender thread)."""
        if save.ids is None:  # every block was stored already: nothing reserved
            save.wait()
            return None
        # hash each layer as soon as its copy has landed, while later layers' copies run
        per_layer: dict[int, list[int]] = {}
        for index, copy in save.copies:
            copy.wait()
            per_layer[index] = checksums(save.reservation.layer_pieces(index))
        save.copies = []
        return save.reservation.commit(save.reservation.checksums(per_layer))

    # ---- loads
    def load(self, spec: LoadSpec, pending: list[str], done: Any, timeout: float) -> int:
        """Load the stored prefix of spec.hashes into its paged blocks; the blocks loaded.
        `done(layer_name, event)` is called as each layer's copies are issued."""
        pinned = self.client.pin(self.namespace, spec.hashes, timeout=timeout)
        if pinned is None:
            raise KVStoreError("the arena is not available")
        try:
            n = pinned.num_blocks
            if not n:
                return 0
            if [(s.name, s.dtype, tuple(s.shape)) for s in pinned.layers] != [
                (s.name, s.dtype, tuple(s.shape)) for s in self.specs
            ]:
                raise KVStoreError("stored layers do not match this engine's KV cache layout")
            ids = self.mover.index(spec.block_ids[:n])
            events = []
            for index, layer_spec in enumerate(pinned.layers):
                bad = pinned.verify([index])
                if bad is not None:
                    block_hash = spec.hashes[bad]
                    pinned.release([block_hash])
                    raise LocalDataCorrupt(f"block {block_hash.hex()} fails its checksum in the arena")
                kv = self.caches[layer_spec.name]
                event = None
                for first, view in pinned.pieces(index):
                    event = self.mover.scatter(kv, ids[first : first + view.shape[0]], view)
                events.append(event)
                pending.remove(layer_spec.name)
                done(layer_spec.name, event)
            for event in events:
                if event is not None:
                    event.synchronize()  # the loader thread, never the compute stream
            if not pinned.release():
                raise StoreTimeout("the pin's lease ran out during the load")
            return n
        finally:
            if not pinned.released:
                pinned.release()

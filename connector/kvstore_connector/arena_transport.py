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

from kvstore.blocks import WSUM32
from kvstore_client import KVStoreClient, LayerSpec
from kvstore_client.arena import Pinned, checksums
from kvstore_client.errors import KVStoreError, LocalDataCorrupt, StoreTimeout
from kvstore_connector.transfer import signed, unsigned, wsum32_blocks

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
    # CUDA: per layer, its blocks' wsum32 computed on the GPU and the event after it
    gpu_sums: list[tuple[int, torch.Tensor, Any]] = field(default_factory=list)

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
        copy = self.mover.gather_into(kv, save.ids, save.reservation.layer(index))
        save.copies.append((index, copy))
        if self.mover.cuda and copy.keep is not None:
            # the checksums on the GPU, behind the layer's copy on the same side stream:
            # xxh3 on the host would cost ~10x the copy (bench_gpu_datapath.py)
            with self.mover.on_copy_stream():
                sums = wsum32_blocks(copy.keep)
            if sums is not None:
                save.gpu_sums.append((index, sums, self.mover.record()))

    def commit(self, save: ArenaSave) -> Any:
        """Wait for the save's copies, then checksum and commit (the sender thread)."""
        if save.ids is None:  # every block was stored already: nothing reserved
            save.wait()
            return None
        if save.gpu_sums and len(save.gpu_sums) == len(self.specs):
            for _index, _sums, event in save.gpu_sums:
                event.synchronize()
            on_host = torch.stack([sums for _i, sums, _e in save.gpu_sums]).cpu().tolist()
            by_layer = {
                index: [unsigned(v) for v in row]
                for (index, _s, _e), row in zip(save.gpu_sums, on_host, strict=True)
            }
            save.wait()
            save.gpu_sums = []
            return save.reservation.commit(save.reservation.checksums(by_layer), kind=WSUM32)
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
            if self.mover.cuda and all(kind == WSUM32 for kind in pinned.kinds):
                self._load_verified_on_gpu(spec, pinned, ids, pending, done)
                return n
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

    def _load_verified_on_gpu(
        self, spec: LoadSpec, pinned: Pinned, ids: torch.Tensor, pending: list[str], done: Any
    ) -> None:
        """CUDA, blocks saved from a GPU (wsum32): every run goes host to device on the copy
        stream and is checksummed there, on the device, after it landed (so what is checked
        is what will be used); each layer is scattered into the paged cache only once its
        sums matched (the loader thread waits for that layer's check, never the compute
        stream). A mismatch fails the load before a byte of that layer is used."""
        width = len(pinned.layers)
        device = ids.device
        expected = torch.tensor([signed(v) for v in pinned.checksums], dtype=torch.int64).view(-1, width)
        expected = expected.to(device, non_blocking=True)
        staged: list[tuple[int, list[tuple[int, torch.Tensor]], torch.Tensor, Any]] = []
        for index in range(width):
            pieces, bad = [], torch.zeros((), dtype=torch.bool, device=device)
            for first, view in pinned.pieces(index):
                on_device = self.mover.stage(view)
                with self.mover.on_copy_stream():
                    got = wsum32_blocks(on_device)
                    if got is None:
                        raise KVStoreError("wsum32 blocks that are not whole 32-bit words")
                    bad |= (got != expected[first : first + view.shape[0], index]).any()
                pieces.append((first, on_device))
            staged.append((index, pieces, bad, self.mover.record()))
        events = []
        for index, pieces, bad, checked in staged:  # the later layers' copies run meanwhile
            checked.synchronize()
            if bool(bad.item()):
                block = pinned.verify([index])  # which one (on the host: the error path only)
                block_hash = spec.hashes[block if block is not None else 0]
                pinned.release([block_hash])
                raise LocalDataCorrupt(f"block {block_hash.hex()} fails its checksum on the GPU")
            name = pinned.layers[index].name
            event = None
            for first, on_device in pieces:
                event = self.mover.scatter_staged(
                    self.caches[name], ids[first : first + on_device.shape[0]], on_device, checked
                )
            events.append(event)
            pending.remove(name)
            done(name, event)
        for event in events:
            if event is not None:
                event.synchronize()  # the loader thread, never the compute stream
        if not pinned.release():
            raise StoreTimeout("the pin's lease ran out during the load")

"""The worker's arena transport: KV moves between the paged cache and the daemon's
shared-memory arena directly; gRPC carries only Reserve/Commit and Pin/Release.

What the arena cannot take goes to its `fallback` (the worker's GrpcTransport): a save
the arena has no room for (or no arena at all any more: the daemon restarted without
one), and loads that consume (DropSelect is gRPC only). Loads are not retried over gRPC:
a load that fails here is recomputed.

Saves (per step): one reservation per request, opened at the step's first saved
layer. Each layer's blocks of a request are one contiguous run in its extent,
so `save_layer` issues one indexed gather per request and layer straight into
the reservation (on CUDA: gather and device-to-host copy on a side stream that
waits for the compute stream; the compute stream never waits for it). On CUDA
the gather lands in a device staging buffer the copy reads (the request's KV
once more on the GPU until its commit), and each group of layers is summed
(wsum32) on a check stream as soon as its blocks are gathered. The commit runs
on the sender thread once that request's copies have completed (on CPU: xxh3 on
threads over the arena bytes first), then Commit.

Loads: Pin, then copy the pinned runs (contiguous, >= 64 KiB for real models)
into the paged blocks. On CUDA (blocks saved from a GPU): in groups of layers,
host to device, checked on the device, then scattered, each group's event handed
to the layer gates so the compute stream waits GPU-side only. On CPU: per layer
verified in the arena, then copied. The pin ends when the copies are done; a pin
that may have lapsed meanwhile fails the load.

NOTE: on the CPU path bytes are verified in the arena before the copy. A process
that maps the arena could still change them between the check and the copy; the
arena is shared only with processes trusted with the KV (see kvstore_client.arena).
The staged (CUDA) path checks what it copied.

NOTE: over 500 lines: one Transport implementation (kvstore_connector.transport), and
its saves and loads must agree on the rank's layout (stored, subset, heads), the
checksum kind and the layer groups: a staged load's `_writes` undoes `save_layer`.
Split into save and load modules, that agreement would span two files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from kvstore import arena_format as fmt
from kvstore.blocks import WSUM32, XXH3, subset_indices
from kvstore_client import Chain, KVStoreClient, LayerSpec
from kvstore_client.arena import Pinned, Reservation, Run, checksums
from kvstore_client.errors import KVStoreError, LocalDataCorrupt, StoreTimeout
from kvstore_client.tensors import torch_dtype
from kvstore_connector.host_memory import prepare
from kvstore_connector.outage import OUTAGES
from kvstore_connector.transfer import Write, wsum32_blocks
from kvstore_connector.transport import Committed, Done, Opened, Reserved, Save, Transport, open_each

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
    copies: list[tuple[range, Any]] = field(default_factory=list)  # (layer indices, PendingCopy)
    # device checksums: every layer's gathered blocks, layer-major as in the extent, on the
    # device (the gather writes here, the copy to the arena and the group sums read here)
    staging: torch.Tensor | None = None
    groups: list[range] = field(default_factory=list)  # of layers, each summed once all are saved
    group_of: list[int] = field(default_factory=list)  # per layer: its group
    unsaved: list[int] = field(default_factory=list)  # per group: its layers not saved yet
    sums: dict[int, torch.Tensor] = field(default_factory=dict)  # group -> [len(group), n] wsum32
    packed: list[int] = field(default_factory=list)  # per layer: its blocks' start in staging
    # every group summed: the sums on their way to the host, block-major, and the event
    # after which they are there (None on CPU: there already)
    host_sums: torch.Tensor | None = None
    host_sums_landed: Any = None

    def wait(self) -> None:
        for _index, copy in self.copies:
            copy.wait()
        self.copies = []


# A staged load checks and copies this much of a request's KV at a time (consecutive
# layers of one block size): each group is one host-to-device copy per run, one checksum
# pass and one host wait. Per layer that was ~10 launches and a wait: ~0.4 ms of a
# 2048-token load's 17 ms on an H200 (bench_gpu_datapath.py).
_GROUP_BYTES = 64 << 20
# A cold load copies a promotion's blocks in ranges of at least this much as they are read.
_RANGE_BYTES = 16 << 20


class ArenaTransport:
    """`device_checksums` (default: on CUDA): saves compute wsum32 on the mover's device,
    per group of layers once gathered, and loads of wsum32 blocks are staged on the
    device and verified there before they are scattered. Off (CPU engines): xxh3 on
    host threads, verified in the arena. (On CPU, on, it runs the CUDA path's code in
    order on one thread: the tests do.)"""

    def __init__(
        self,
        client: KVStoreClient,
        namespace: bytes,
        specs: list[LayerSpec],
        caches: dict[str, torch.Tensor],
        mover: BlockMover,
        device_checksums: bool | None = None,
        *,
        stored: Sequence[LayerSpec] | None = None,
        subset: Sequence[int] = (),
        heads: dict[str, tuple[torch.Tensor, int]] | None = None,
        fallback: Transport | None = None,
        consume: bool = False,
        reserve_timeout: float | None = None,
    ) -> None:
        """`specs`: the layers this rank moves, `caches` their paged views by name; `stored`
        (default: `specs`): a block's whole layout, of which `specs` are layers `subset`
        (empty: all; see kvstore_connector.layout). `heads`: by layer name, the paged view of
        its attention layer's heads ([num_blocks, heads, ...]) and its head's index there:
        staged loads then scatter a layer's heads with one indexed copy. `fallback`: where
        saves go that the arena cannot take (without one, they fail); `consume`: loads take
        their blocks (through the fallback, which is then required). `reserve_timeout`: the
        deadline of a Reserve (a control-plane call on the forward thread)."""
        if consume and fallback is None:
            raise ValueError("consuming loads need the gRPC fallback")
        self.client = client
        self.fallback = fallback
        self.consume = consume
        self.reserve_timeout = reserve_timeout
        self.namespace = namespace
        self.specs = specs
        self.caches = caches
        self.mover = mover
        self.device_checksums = mover.cuda if device_checksums is None else device_checksums
        self._layer_index = {spec.name: i for i, spec in enumerate(specs)}
        self.stored = list(specs if stored is None else stored)
        self.subset = tuple(subset)
        self._subset_indices = subset_indices(self.subset, len(self.stored))
        self._heads = heads or {}
        if [self.stored[k] for k in self._subset_indices] != list(specs):
            raise ValueError("specs must be layers `subset` of `stored`")
        # a pin's layers found to match `stored`: the client shares one tuple per layout
        # (256 store layers took 0.1 ms to compare on every load)
        self._matching_layers: tuple[Any, ...] | None = None

    def describe(self) -> str:
        return f"through the daemon's arena {self.client.arena_path}"

    # ---- saves
    def open(self, spec: SaveSpec) -> Save | None:
        """A reservation for one request's blocks, or the fallback's save when the arena
        cannot take it. An outage is raised, never retried over gRPC: that store is down."""
        try:
            res = self.client.reserve(
                self.namespace, spec.hashes, self.stored, parent_hash=spec.parent_hash,
                timeout=self.reserve_timeout, token_ids=spec.token_ids, subset=self.subset,
            )  # fmt: skip
        except OUTAGES:
            raise
        except KVStoreError as exc:
            return self._not_reserved(spec, exc)
        return self._reserved(spec, res)

    def reserve_all(self, specs: Sequence[SaveSpec]) -> Reserved:
        """The step's saves reserved in one round trip (ReserveMany), with no device work
        (any thread may run it): an answer per spec (a Reservation, a refusal, or the
        outage), or None: open them one by one (a single save, no arena, ReserveMany
        refused as a whole)."""
        if len(specs) < 2:
            return None
        chains = [Chain(spec.hashes, spec.parent_hash, spec.token_ids) for spec in specs]
        try:
            return self.client.reserve_many(
                self.namespace, chains, self.stored, timeout=self.reserve_timeout, subset=self.subset
            )
        except OUTAGES as exc:
            return [exc] * len(specs)
        except KVStoreError as exc:  # the request as a whole (each chain fits its own limits)
            log.debug("ReserveMany refused, reserving save by save: %s", exc)
            return None

    def open_reserved(self, specs: Sequence[SaveSpec], reserved: Reserved) -> Opened:
        """The saves of reserve_all's answers (the forward thread: their device tensors);
        one refused goes to the fallback on its own, an outage fails them all."""
        if reserved is None:
            return open_each(self, specs)
        out: list[Save | None | KVStoreError] = []
        for spec, answer in zip(specs, reserved, strict=True):
            try:
                if isinstance(answer, OUTAGES):
                    raise answer
                out.append(self._not_reserved(spec, answer) if isinstance(answer, KVStoreError)
                           else self._reserved(spec, answer))  # fmt: skip
            except KVStoreError as exc:
                out.append(exc)
        return out

    @staticmethod
    def unreserve(reserved: Reserved) -> None:
        """Give back what reserve_all reserved for saves that were never opened."""
        for answer in reserved or ():
            if isinstance(answer, Reservation):
                answer.abort()

    def _not_reserved(self, spec: SaveSpec, exc: KVStoreError) -> Save | None:
        """The fallback's save of `spec`, which the arena refused (e.g. it is full of pinned
        blocks: gRPC may fit); without a fallback, the refusal is raised."""
        if self.fallback is None:
            raise exc
        log.debug("arena save not possible, saving over gRPC: %s", exc)
        return self.fallback.open(spec)

    def _reserved(self, spec: SaveSpec, res: Reservation | None) -> Save | None:
        """The save of `spec` into its reservation (None: the daemon offers no arena now)."""
        if res is None:  # the daemon offers no arena (any more)
            if self.fallback is None:
                raise KVStoreError("the arena is not available")
            return self.fallback.open(spec)
        prepare(res.mapping, cuda=self.mover.cuda)  # a restarted daemon's new arena: once
        if not res.blocks:
            return ArenaSave(spec, res, None, time.perf_counter())
        ids = self.mover.index([spec.block_ids[i] for i in res.blocks])
        save = ArenaSave(spec, res, ids, time.perf_counter())
        if self.device_checksums:
            sizes = [layer.nbytes for layer in self.specs]
            save.staging = torch.empty(
                sum(sizes) * len(res.blocks), dtype=torch.uint8, device=self.mover.device
            )  # layers back to back (in the arena they may lie among other ranks' layers)
            save.packed = fmt.layer_offsets(sizes, len(res.blocks))
            save.groups = _layer_groups(sizes, len(res.blocks))
            save.group_of = [g for g, layers in enumerate(save.groups) for _ in layers]
            save.unsaved = [len(group) for group in save.groups]
        return save

    def save_layer(self, saves: Sequence[Save], names: Sequence[str], heads: torch.Tensor | None) -> None:
        """Per arena save: store layers `names` (consecutive ones: a rank's KV heads of one
        attention layer, see kvstore_connector.layout) from `heads`, the paged view of those
        heads ([num_blocks, heads, *shape]), in one indexed copy into their back-to-back
        runs; without `heads`, each layer from its own paged view. The other saves are the
        fallback's."""
        first = self._layer_index[names[0]]
        if [self._layer_index[name] for name in names] != list(range(first, first + len(names))):
            raise ValueError("save_layer takes consecutive layers")
        others = []
        for save in saves:
            if not isinstance(save, ArenaSave):
                others.append(save)
            elif heads is not None:
                self._save(save, first, len(names), heads.transpose(0, 1), 1)
            else:
                for index, name in enumerate(names, first):
                    self._save(save, index, 1, self.caches[name], 0)
        if others:
            if self.fallback is None:
                raise TypeError("saves the arena transport did not open")
            self.fallback.save_layer(others, names, heads)

    def _save(self, save: ArenaSave, first: int, count: int, kv: torch.Tensor, dim: int) -> None:
        """Copy layers first..first+count-1 of the save's blocks: `kv` indexes blocks at `dim`
        (1: [count, num_blocks, *shape], one layer per row)."""
        if save.ids is None:
            return
        res, spec = save.reservation, self.specs[first]
        at = res.layer_start(first)
        if (
            count > 1
            and res.layer_start(first + count - 1) != at + (count - 1) * spec.nbytes * res.num_blocks
        ):
            # written in place where other ranks' blocks lie between (Reservation.in_place)
            for j in range(count):
                self._save(save, first + j, 1, kv[j : j + 1], dim)
            return
        nbytes = spec.nbytes * res.num_blocks * count
        raw = res.mapping.tensor()[res.offset + at : res.offset + at + nbytes]
        shape = (res.num_blocks, *spec.shape) if dim == 0 else (count, res.num_blocks, *spec.shape)
        dest = raw.view(torch_dtype(spec.dtype)).view(shape)
        layers = range(first, first + count)
        if save.staging is None:
            save.copies.append((layers, self.mover.gather_into(kv, save.ids, dest, dim=dim)))
            return
        staged = save.packed[first]
        via = save.staging[staged : staged + nbytes].view(dest.dtype).view(dest.shape)
        save.copies.append((layers, self.mover.gather_into(kv, save.ids, dest, via=via, dim=dim)))
        for index in layers:
            group = save.group_of[index]
            save.unsaved[group] -= 1
            if not save.unsaved[group]:  # sum the group now, on the check stream, while copies run
                members, n = save.groups[group], res.num_blocks
                start = save.packed[members.start]
                size = self.specs[members.start].nbytes * n * len(members)
                with self.mover.on_check_stream(after_compute=True):
                    got = wsum32_blocks(save.staging[start : start + size].view(len(members) * n, -1))
                if got is not None:
                    save.sums[group] = got.view(len(members), n)
                    if len(save.sums) == len(save.groups):
                        self._sums_to_host(save)

    def _sums_to_host(self, save: ArenaSave) -> None:
        """Every group summed: the sums to the host now, behind the last sum on the check
        stream, so that the commit finds them there (a synchronous copy at the commit
        cost 0.34 ms of a 2048-token save on an H200 host)."""
        with self.mover.on_check_stream():
            parts = [save.sums[group] for group in range(len(save.groups))]
            # [n, layers]: block-major; from a GPU into pinned memory, valid once the event fired
            host = torch.cat(parts).t().contiguous().to("cpu", non_blocking=True)
        save.host_sums, save.host_sums_landed = host, self.mover.record(on_check=True)
        save.sums = {}  # (queued behind the copy on the check stream: freed after it)

    def commit(self, save: Save) -> Committed | None:
        """Wait for the save's copies, then checksum and commit (the sender thread); a
        failed one gives its extent back."""
        if not isinstance(save, ArenaSave):
            if self.fallback is None:
                raise TypeError("a save the arena transport did not open")
            return self.fallback.commit(save)
        sums = self._sums(save)
        if sums is None:
            return None
        try:
            result = save.reservation.commit(sums[0], kind=sums[1])
        except Exception:
            save.reservation.abort()
            raise
        return Committed(result.blocks_written, save.reservation.num_blocks)

    def commit_all(self, saves: Sequence[Save]) -> list[Committed | None | Exception]:
        """commit() of each of a step's saves, the arena's in one round trip (CommitMany)."""
        out: list[Committed | None | Exception] = [None] * len(saves)
        batch: list[tuple[int, ArenaSave, Any, str]] = []
        for i, save in enumerate(saves):
            try:
                if not isinstance(save, ArenaSave):
                    out[i] = self.commit(save)  # the fallback's
                    continue
                sums = self._sums(save)
            except (KVStoreError, ValueError, RuntimeError) as exc:
                out[i] = exc
                continue
            if sums is not None:
                batch.append((i, save, *sums))
        if not batch:
            return out
        answers: list[Any]
        try:
            answers = self.client.commit_many(
                [(save.reservation, sums, kind) for _, save, sums, kind in batch]
            )
        except KVStoreError as exc:  # the call as a whole (its reservations stay abortable)
            answers = [exc] * len(batch)
        for (i, save, _, _), answer in zip(batch, answers, strict=True):
            if isinstance(answer, Exception):
                save.reservation.abort()  # refused: its extent goes back now, not at its lease's end
                out[i] = answer
            else:
                out[i] = Committed(answer.blocks_written, save.reservation.num_blocks)
        return out

    def _sums(self, save: ArenaSave) -> tuple[Any, str] | None:
        """Wait for the save's copies; its checksums, block-major, and their kind (None:
        every block was stored already, nothing to commit). When they cannot be taken, the
        reservation is given back and the error raised."""
        try:
            return self._checksums(save)
        except Exception:
            save.reservation.abort()
            raise

    def _checksums(self, save: ArenaSave) -> tuple[Any, str] | None:
        if save.ids is None:  # every block was stored already: nothing reserved
            save.wait()
            return None
        if save.staging is not None and save.host_sums is not None:
            save.wait()  # every layer copied (the host waited for the copy stream)
            if save.host_sums_landed is not None:
                save.host_sums_landed.synchronize()
            sums = save.host_sums
            save.staging, save.host_sums, save.host_sums_landed = None, None, None
            return sums.numpy().tobytes(), WSUM32
        save.staging = None
        # hash each layer as soon as its copy has landed, while later layers' copies run
        per_layer: dict[int, list[int]] = {}
        for layers, copy in save.copies:
            copy.wait()
            for index in layers:
                per_layer[index] = checksums(save.reservation.layer_pieces(index))
        save.copies = []
        return save.reservation.checksums(per_layer), XXH3

    # ---- loads
    def leased(self, spec: LoadSpec) -> Pinned | None:
        """spec.lease's pin of this namespace, which covers exactly the spec's blocks, or
        None (this rank's share given back): a consuming load (DropSelect), no arena
        mapped here, another daemon run's lease, or a pin of other blocks."""
        lease = spec.lease
        if lease is None:
            return None
        pinned = (
            None if self.consume and self.fallback is not None else self.client.leased(lease, self.namespace)
        )
        if pinned is not None and pinned.num_blocks == len(spec.hashes):
            return pinned
        if pinned is not None:
            pinned.release()
        else:
            self.client.release_lease(lease, namespace=self.namespace, all_holders=False)
        return None

    def pin_all(self, specs: Sequence[LoadSpec], timeout: float) -> list[Any] | None:
        """Several loads' pins in one round trip (PinMany: their blocks promoted first where
        needed, not streamed); None for a single load (it streams: see load) or where the
        loads are not pinned (DropSelect over gRPC, no arena)."""
        if len(specs) < 2 or (self.consume and self.fallback is not None):
            return None
        try:
            pins = self.client.pin_many(self.namespace, [spec.hashes for spec in specs], timeout=timeout)
        except KVStoreError as exc:
            return [exc] * len(specs)
        return list(pins) if pins is not None else None

    def load(self, spec: LoadSpec, pending: list[str], done: Done, timeout: float, pinned: Any = None) -> int:
        """Load the stored prefix of spec.hashes into its paged blocks; the blocks loaded.
        `done(layer_name, event)` is called as each layer's copies are issued. `pinned`:
        pin_all's answer for this spec (a Pinned, or the error its pin raised)."""
        if self.consume and self.fallback is not None:  # DropSelect: gRPC only
            return self.fallback.load(spec, pending, done, timeout)
        if isinstance(pinned, Exception):
            raise pinned
        if pinned is None:
            # stream: the answer comes before blocks only the persistent tier held are read
            # in; each layer group waits for its layers (wait_layers), so the copies of the
            # first layers overlap the reads of the rest: a cold load costs about max(disk, H2D)
            pinned = self.client.pin(self.namespace, spec.hashes, timeout=timeout, stream=True)
        if pinned is None:
            raise KVStoreError("the arena is not available")
        prepare(pinned.mapping, cuda=self.mover.cuda)  # a restarted daemon's new arena: once
        try:
            n = pinned.num_blocks
            if not n:
                return 0
            if pinned.layers is not self._matching_layers:
                if [(s.name, s.dtype, tuple(s.shape)) for s in pinned.layers] != [
                    (s.name, s.dtype, tuple(s.shape)) for s in self.stored
                ]:
                    raise KVStoreError("stored layers do not match this engine's KV cache layout")
                self._matching_layers = pinned.layers
            ids = self.mover.to_device_for_load(torch.tensor(spec.block_ids[:n], dtype=torch.long))
            if self.device_checksums and all(kind == WSUM32 for kind in pinned.kinds):
                events = self._load_staged(spec, pinned, ids, pending, done)
            else:
                events = self._load_verified_in_arena(spec, pinned, ids, pending, done)
            for event in events:
                if event is not None:
                    event.synchronize()  # the loader thread, never the compute stream
            if not pinned.finish():
                raise StoreTimeout("the pin's lease ran out during the load")
            return n
        finally:
            if not pinned.released:
                pinned.release()

    def _load_verified_in_arena(
        self, spec: LoadSpec, pinned: Pinned, ids: torch.Tensor, pending: list[str], done: Done
    ) -> list[Any]:
        """Per layer: verify its checksums in the arena, then copy each pinned run into the
        paged blocks (see the NOTE above on what that trusts)."""
        events = []
        for index in self._subset_indices:  # this rank's layers only: the others' bytes are never read
            layer_spec = pinned.layers[index]
            pinned.wait_layers(index + 1)
            bad = pinned.verify([index])
            if bad is not None:
                self._corrupt(spec, pinned, bad, "in the arena")
            kv = self.caches[layer_spec.name]
            event = None
            for first, view in pinned.pieces(index):
                event = self.mover.scatter(kv, ids[first : first + view.shape[0]], view)
            events.append(event)
            pending.remove(layer_spec.name)
            done(layer_spec.name, event)
        return events

    def _load_staged(
        self, spec: LoadSpec, pinned: Pinned, ids: torch.Tensor, pending: list[str], done: Done
    ) -> list[Any]:
        """Blocks saved with device checksums (wsum32), copied host to device on the copy
        stream, checksummed on the check stream once landed (what is checked is what will
        be used), scattered into the paged cache only once their sums matched (the loader
        thread waits for the checks, never the compute stream); a mismatch fails the load
        before a byte of the layers it touches is used.

        Layer-major runs (blocks the arena held: saved, or fetched from the fleet) go in
        groups of layers (_GROUP_BYTES), one copy per run and group, so the first layers
        are scattered (and the forward pass starts on them) while later groups land.
        Block-major runs (a promotion's, read from the persistent tier as the load runs)
        go in ranges of whole blocks, one copy per range as soon as the daemon reports
        it read (wait_blocks): a cold load costs about max(read, copy) rather than their
        sum; their layers are complete, and scattered, once the last range landed."""
        width = len(pinned.layers)
        sizes = pinned.layer_bytes
        expected = torch.frombuffer(bytearray(pinned.packed_checksums), dtype=torch.int64)
        expected = self.mover.to_device_for_load(expected.view(-1, width))
        groups = _layer_groups(sizes, pinned.num_blocks, self._subset_indices)
        layer_major = [run for run in pinned.runs if not run.stride]
        # each group's verdict lands here (pinned: read by the host once its event fired,
        # no synchronising call on any stream); the last: the block-major ranges'
        failed = torch.zeros(len(groups) + 1, dtype=torch.bool, pin_memory=self.mover.cuda)
        staged: list[tuple[int, range, list[tuple[Run, range, torch.Tensor]], Any]] = []
        for g, group in enumerate(groups):
            chunks = [
                (run, layers, self.mover.stage(span))
                for run in layer_major
                for layers, span in pinned.spans(run, group)
            ]
            # checked on the check stream once landed: the copy stream goes on to the next group
            with self.mover.on_check_stream(after=self.mover.record()):
                verdicts = [  # rows: layer-major block-layers of this span
                    self._mismatch(
                        on_device.view(len(layers) * run.count, -1),
                        expected[run.first : run.first + run.count, layers.start : layers.stop].t(),
                    )
                    for run, layers, on_device in chunks
                ]
                if verdicts:
                    failed[g].copy_(torch.stack(verdicts).any(), non_blocking=True)
            staged.append((g, group, chunks, self.mover.record(on_check=True)))
        # the promotion's blocks, range by range as they are read
        landed = [(run, *self._stage_blocks(pinned, run, expected)) for run in pinned.runs if run.stride]
        blocks_checked = None
        if landed:
            with self.mover.on_check_stream():
                failed[-1].copy_(torch.stack([bad for _run, _rows, bad in landed]).any(), non_blocking=True)
            blocks_checked = self.mover.record(on_check=True)
        # each group's scatters, made while the last copies and checks run: a cold load's
        # last range lands after the daemon's last read, and this Python was on its tail
        scatters: list[tuple[int, range, list[Write], Any]] = []
        for g, group, chunks, checked in staged:
            writes: list[Write] = []
            for run, layers, on_device in chunks:
                rows = on_device.view(len(layers), run.count, -1)  # [layer, block, bytes]
                writes.extend(self._writes(pinned, layers, rows, ids[run.first : run.first + run.count]))
            for run, on_device, _bad in landed:
                start, stop = pinned.within_block(group)  # one size: _layer_groups
                rows = on_device[:, start:stop].view(run.count, len(group), -1).transpose(0, 1)
                writes.extend(self._writes(pinned, group, rows, ids[run.first : run.first + run.count]))
            scatters.append((g, group, writes, checked))
        if landed:
            if blocks_checked is not None:
                blocks_checked.synchronize()
            if bool(failed[-1]):
                block = pinned.verify()  # which one (on the host: the error path only)
                self._corrupt(spec, pinned, block if block is not None else 0, "on the device")
        events = []
        for g, group, writes, checked in scatters:  # the later groups' copies run meanwhile
            if checked is not None:
                checked.synchronize()
            if bool(failed[g]):
                block = pinned.verify(list(group))  # which one (on the host: the error path only)
                self._corrupt(spec, pinned, block if block is not None else 0, "on the device")
            event = self.mover.scatter_staged(writes, checked if blocks_checked is None else blocks_checked)
            for layer in group:
                name = pinned.layers[layer].name
                pending.remove(name)
                done(name, event)
            events.append(event)
        return events

    def _stage_blocks(
        self, pinned: Pinned, run: Run, expected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a block-major run to the device range by range as the daemon reports its
        blocks read (at least _RANGE_BYTES a copy, but for the last), each range checked
        (every layer, one pass per layer size) on the check stream once landed. Returns
        the run on the device ([run.count, run.stride] uint8) and whether any block-layer
        failed (a device bool, final once the check stream has run)."""
        with self.mover.on_copy_stream():
            on_device = torch.empty((run.count, run.stride), dtype=torch.uint8, device=self.mover.device)
            bad = torch.zeros((), dtype=torch.bool, device=self.mover.device)
        block_bytes = sum(pinned.layer_bytes)
        least = max(1, _RANGE_BYTES // run.stride)
        sized = [(layers, *pinned.within_block(layers)) for layers in _same_size(pinned.layer_bytes)]
        at = 0
        while at < run.count:
            pinned.wait_blocks(run.first + min(run.count, at + least))
            stop = min(run.count, pinned.ready_blocks - run.first)
            self.mover.stage_into(on_device[at:stop], pinned.blocks(run, at, stop))
            with self.mover.on_check_stream(after=self.mover.record()):
                rows = on_device[at:stop, :block_bytes]
                want = expected[run.first + at : run.first + stop]  # [block, layer]
                for layers, start, end in sized:
                    got = rows[:, start:end].reshape(len(layers) * (stop - at), -1)
                    bad |= self._mismatch(got, want[:, layers.start : layers.stop])
            at = stop
        return on_device, bad

    @staticmethod
    def _mismatch(rows: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """Whether any of `rows` (one block-layer each) fails its wsum32 in `want` (the same
        order once flattened): a device bool."""
        got = wsum32_blocks(rows)
        if got is None:
            raise KVStoreError("wsum32 blocks that are not whole 32-bit words")
        return (got != want.reshape(-1)).any()

    def _writes(self, pinned: Pinned, layers: range, rows: torch.Tensor, ids: torch.Tensor) -> list[Write]:
        """The scatters of `layers`' staged blocks, `rows` [layer, block, bytes] uint8 on the
        device (strided where they came block-major): one per layer, or one per attention
        layer for a rank's consecutive KV heads of it (the inverse of save_layer with their
        heads' view)."""
        writes: list[Write] = []
        count = rows.shape[1]
        k = 0
        while k < len(layers):
            spec = pinned.layers[layers[k]]
            target = self._heads.get(spec.name)
            heads = 1
            if target is not None:  # the following layers that are this layer's next heads
                while k + heads < len(layers):
                    following = self._heads.get(pinned.layers[layers[k + heads]].name)
                    if (
                        following is None
                        or following[0] is not target[0]
                        or following[1] != target[1] + heads
                    ):
                        break
                    heads += 1
            view = rows[k : k + heads].view(torch_dtype(spec.dtype)).view(heads, count, *spec.shape)
            if target is None:
                writes.append((self.caches[spec.name], ids, view[0], 0))
            else:
                kv_heads, first = target
                kv = kv_heads.transpose(0, 1)[first : first + heads]  # [heads, num_blocks, ...]
                writes.append((kv, ids, view, 1))
            k += heads
        return writes

    def _corrupt(self, spec: LoadSpec, pinned: Pinned, block: int, where: str) -> NoReturn:
        block_hash = spec.hashes[block]
        pinned.release([block_hash])
        raise LocalDataCorrupt(f"block {block_hash.hex()} fails its checksum {where}")


def _same_size(sizes: Sequence[int]) -> list[range]:
    """The runs of consecutive layers of one size."""
    runs: list[range] = []
    for layer, size in enumerate(sizes):
        if runs and sizes[runs[-1].start] == size:
            runs[-1] = range(runs[-1].start, layer + 1)
        else:
            runs.append(range(layer, layer + 1))
    return runs


def _layer_groups(sizes: Sequence[int], num_blocks: int, subset: Sequence[int] | None = None) -> list[range]:
    """Runs of consecutive layers (of layer subset `subset`, default all) of one block size,
    about _GROUP_BYTES of the request each."""
    todo = subset_indices(subset or (), len(sizes))
    groups: list[range] = []
    for layer in todo:
        last = groups[-1] if groups else None
        if (
            last is not None
            and last.stop == layer
            and sizes[layer] == sizes[last.start]
            and len(last) * sizes[layer] * num_blocks < _GROUP_BYTES
        ):
            groups[-1] = range(last.start, layer + 1)
        else:
            groups.append(range(layer, layer + 1))
    return groups

"""How the worker moves KV: one interface, two implementations.

The worker (kvstore_connector.worker) keeps the step: layer gates, load errors, the save
backlog's accounting, commits on its sender thread, stats and the store's health. Which
path the bytes take is the transport's, chosen once per process in register_kv_caches:

- ArenaTransport (kvstore_connector.arena_transport): the daemon's shared-memory arena on
  the same host; a save the arena cannot take (no room, the arena gone) and consuming
  loads (DropSelect is gRPC only) go to the GrpcTransport it holds as its fallback;
- GrpcTransport (kvstore_connector.grpc_transport): the daemon's byte streams, or its
  files for loads on the same host.

A step's saves: `open` each request's save at the step's first saved layer, `save_layer`
once per attention layer for all of them, then `commit` each on the sender thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore_client.errors import KVStoreError

if TYPE_CHECKING:
    import torch

    from kvstore_connector.metadata import LoadSpec, SaveSpec

Done = Callable[..., None]
"""done(layer_name, cuda_event=None): a load has written that layer (the layer gates)."""


class Save(Protocol):
    """One request's save in flight, as `Transport.open` made it."""

    spec: SaveSpec
    started: float  # perf_counter() at open: the save's time in the stats


Reserved = list[Any] | None
"""What Transport.reserve_all returns: the transport's own answers per save, or None."""
Opened = list[Save | None | KVStoreError]
"""What Transport.open_reserved returns: per save, a Save, None (dropped) or the refusal."""


@dataclass(frozen=True)
class Committed:
    """What a committed save did: the blocks it made visible (with tensor parallelism, the
    last rank's part of a block does) and the blocks this rank sent (its KV heads of them)."""

    blocks_written: int
    blocks_sent: int


class Transport(Protocol):
    def open(self, spec: SaveSpec) -> Save | None:
        """Open one request's save (the forward thread, at the step's first saved layer).
        None: the save was dropped (an async save over a backlog that is full). Raises
        KVStoreError when the store refused or could not be reached."""
        ...

    def reserve_all(self, specs: Sequence[SaveSpec]) -> Reserved:
        """A step's saves reserved (in one round trip where the transport can), with no
        device work: any thread may run it ahead of the step (None: nothing done ahead)."""
        ...

    def open_reserved(self, specs: Sequence[SaveSpec], reserved: Reserved) -> Opened:
        """open() of each of a step's saves, in order, from what reserve_all(specs)
        returned (the forward thread: their device tensors): each a Save, None (dropped),
        or the KVStoreError that open() would raise."""
        ...

    def unreserve(self, reserved: Reserved) -> None:
        """Give back what reserve_all reserved for saves that were never opened."""
        ...

    def save_layer(self, saves: Sequence[Save], names: Sequence[str], heads: torch.Tensor | None) -> None:
        """One attention layer of every save of the step (all opened by this transport): its
        store layers `names` (this rank's KV heads of it, consecutive; see
        kvstore_connector.layout); `heads`: their paged view [num_blocks, heads, ...] for one
        indexed copy of all of them, or None (each from its own paged view)."""
        ...

    def commit(self, save: Save) -> Committed | None:
        """Wait for the save's copies, then commit it (the sender thread). None: nothing was
        sent (every block was stored already). On failure the save is aborted (its host
        memory released) and the error raised."""
        ...

    def commit_all(self, saves: Sequence[Save]) -> list[Committed | None | Exception]:
        """commit() of each of a step's saves (in one round trip where the transport can), in
        order: each what commit() returns, or the KVStoreError (ValueError, RuntimeError) it
        would raise."""
        ...

    def load(self, spec: LoadSpec, pending: list[str], done: Done, timeout: float, pinned: Any = None) -> int:
        """Load the stored prefix of spec.hashes into its paged blocks; the blocks loaded.
        Each layer's name leaves `pending` and is reported to `done` as it is written.
        `pinned`: what pin_all answered for this spec (the load then starts on it)."""
        ...

    def leased(self, spec: LoadSpec) -> Any | None:
        """The pin of spec.lease (the scheduler side's lookup took it) for load(pinned=...),
        or None: the transport cannot load from it (no arena here, another daemon run,
        other blocks), and this rank's share of it is given back (the load pins its own)."""
        ...

    def pin_all(self, specs: Sequence[LoadSpec], timeout: float) -> list[Any] | None:
        """The step's loads pinned in one round trip where the transport can (each answer
        for load(pinned=...): a pin, or the KVStoreError its pin alone would raise); None:
        each load pins its own."""
        ...

    def describe(self) -> str:
        """How KV moves, for the worker's log line."""
        ...


def open_each(transport: Transport, specs: Sequence[SaveSpec]) -> Opened:
    """open_reserved, one open() after another."""
    out: list[Save | None | KVStoreError] = []
    for spec in specs:
        try:
            out.append(transport.open(spec))
        except KVStoreError as exc:
            out.append(exc)
    return out


def commit_each(transport: Transport, saves: Sequence[Save]) -> list[Committed | None | Exception]:
    """commit_all, one commit() after another."""
    out: list[Committed | None | Exception] = []
    for save in saves:
        try:
            out.append(transport.commit(save))
        except (KVStoreError, ValueError, RuntimeError) as exc:
            out.append(exc)
    return out

"""The same-host data plane: saves and loads through the daemon's memory arena.

    mapping.py  Mapping: the daemon's arena file mapped once per process, shared by the
                process's clients (MAPPINGS: a kvstore_client._shared.Shared, which
                counts them); ArenaUnavailable, Call
    views.py    typed views over extents, the layouts kept per model, checksums (xxh3,
                over threads for large pieces)
    save.py     Reservation, ArenaPutStream: the save side (write, then commit)
    load.py     Run, Pinned, ArenaSource: the load side (read, verify, release)
    access.py   Arena: negotiates with the daemon, re-negotiates after a restart, hands
                out reservations and pins (one or many per round trip)

The daemon owns an arena file in shared memory (kvstore/arena_format.py). A client
on its host maps the file once per process and moves KV bytes itself; gRPC carries
only the control messages:

    save:  Reserve -> write the blocks into the reserved extent -> Commit (checksums)
    load:  Pin -> read the pinned extents (verify checksums) -> Release

    res = kv.reserve(ns, hashes, layers)        # None: the daemon offers no arena here
    res.layer("layer.0").copy_(t0[res.blocks])  # [len(res.blocks), *shape] views
    res.commit()                                # xxh3 per block-layer, then visible
    pin = kv.pin(ns, hashes)                    # pin.pieces(layer) -> [(first, view)]
    ...copy out, pin.verify(), pin.finish()         # or release(): waits for the answer

Who may map the arena: a process that can open the file the daemon names (same
host and the same /dev/shm: in containers, `ipc: service:kvstore` or a shared shm
volume) with read-write access (file mode 0600: the daemon's user; 0660 with
`memory_group`), and finds the daemon's run id in its header. Anything else uses
the gRPC byte stream (Put/Get), as do all calls while the arena cannot be used.

Trust: every process that maps the arena can write all of it. The checksums catch
stray writes and torn reservations, not a malicious peer: give the arena only to
processes you would give the KV itself (that is why `--token-file` turns it off
for clients unless `memory_clients` says otherwise).

The client only maps the arena: pre-faulting its pages and registering them with
CUDA are the caller's (the connector does both: kvstore_connector.host_memory), with
`Mapping.on_close` to undo them when the mapping's last client lets go.
"""

from __future__ import annotations

from kvstore_client.arena.access import Arena
from kvstore_client.arena.load import ArenaSource, Pinned, Run
from kvstore_client.arena.mapping import ArenaUnavailable, Call, Mapping
from kvstore_client.arena.save import ArenaPutStream, Reservation
from kvstore_client.arena.views import checksums

__all__ = [
    "Arena",
    "ArenaPutStream",
    "ArenaSource",
    "ArenaUnavailable",
    "Call",
    "Mapping",
    "Pinned",
    "Reservation",
    "Run",
    "checksums",
]

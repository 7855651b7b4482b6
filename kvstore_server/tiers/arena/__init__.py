"""The memory tier: a shared-memory arena the daemon owns and same-host clients map.

    file.py       ArenaFile: the file (created, sized and pre-faulted by the daemon), its
                  header (kvstore.arena_format) and the daemon's mapping; start-up sweeps
    allocator.py  Allocator: first-fit free list of ALIGN-sized pages, coalescing on free
    index.py      Placed, ArenaIndex: committed blocks -> where they lie, in a small LMDB
                  environment beside the file (what a restart recovers)
    leases.py     Extent, Reservation, Pin, ExtentRun, PinnedRuns: the bookkeeping records
    tier.py       MemoryTier: residency, extents, the write-behind queue, reservations
                  and pins with their leases (tiers.base.Tier)

The arena is a cache in front of the persistent tier: a committed block stays
here until the persistent tier has it (write-behind), then may be evicted; a
block that only the persistent tier holds is promoted into a fresh extent when
it is loaded. Clients write reserved extents and read pinned ones directly; the
daemon never trusts those bytes: every block-layer carries its checksum, verified
by whoever uses the bytes (a client on its device, the daemon before a Get).
"""

from __future__ import annotations

from kvstore_server.tiers.arena.allocator import Allocator
from kvstore_server.tiers.arena.file import ArenaError, ArenaFile, discard_memory_tier, sweep_memory_dir
from kvstore_server.tiers.arena.index import ArenaIndex, Placed
from kvstore_server.tiers.arena.leases import Extent, ExtentRun, Pin, PinnedRuns, Reservation
from kvstore_server.tiers.arena.tier import ArenaCounters, MemoryTier, NoRoom, open_memory_tier

__all__ = [
    "Allocator",
    "ArenaCounters",
    "ArenaError",
    "ArenaFile",
    "ArenaIndex",
    "Extent",
    "ExtentRun",
    "MemoryTier",
    "NoRoom",
    "Pin",
    "PinnedRuns",
    "Placed",
    "Reservation",
    "discard_memory_tier",
    "open_memory_tier",
    "sweep_memory_dir",
]

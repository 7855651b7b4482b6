"""Where a block lives, named as vLLM's KV events name it (`BlockStored.medium`, `BlockRemoved.medium`).

vLLM names three media (vllm/distributed/kv_events.py: MEDIUM_GPU, MEDIUM_CPU,
MEDIUM_STORAGE); its offloading tiers publish "CPU" for host memory
(vllm/v1/kv_offload/cpu) and "STORAGE" for its file-system and object-store tiers
(vllm/v1/kv_offload/tiering/fs and obj). Our tiers map onto them, one medium each:

    tier         where                                   medium     like vLLM's
    memory       the daemon's arena (shared host memory) "CPU"      CPU offloading tier
    persistent   LMDB or the disk backend's files         "STORAGE"  file-system tier
    fleet        Redis (Cluster) shared by every host     "STORAGE"  object-store tier

Who publishes what under them:

- The daemon (kvstore_server.kv_events): a `BlockStored` under the medium of the
  tier its commit put the block in: a save through the arena (and blocks made whole
  from tensor-parallel parts that fit in it) "CPU"; a gRPC Put and blocks fetched
  from the fleet, which land in the persistent tier, "STORAGE". Moves between its
  tiers are not published (write-behind to the persistent tier, promotion into the
  arena, the arena evicting a block the persistent tier keeps): each block is
  reported once, where it was first stored. A `BlockRemoved` (the block left the
  store, every tier of it) comes once per medium of the daemon's tiers
  (`removal_media`), since the block may have been reported under either; a router
  drops what it held under each and ignores the others.
- Nothing is published for the fleet itself: every host's daemon writes it and
  Redis evicts on its own, unseen, so its contents are not one daemon's to report.
  A block a daemon fetched from it is reported once stored in its persistent tier.
- The connector (kvstore_connector.events), in the engine's own events: the blocks
  the store holds for that engine, under `front_medium`: "CPU" when the daemon has
  a memory tier (its loads are served from the arena, which a Pin fills from the
  persistent tier), "STORAGE" when it has only the persistent tier. The daemon's
  Watch stream, which it follows, does not say which tier a block is in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

# vLLM's names (vllm.distributed.kv_events), spelled out: neither the daemon nor this
# module imports vLLM.
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"

MEMORY: Final = "memory"
PERSISTENT: Final = "persistent"
FLEET: Final = "fleet"

MEDIUM: Final[dict[str, str]] = {
    MEMORY: MEDIUM_CPU,
    PERSISTENT: MEDIUM_STORAGE,
    FLEET: MEDIUM_STORAGE,
}
"""The medium of each of our tiers."""


def removal_media(tiers: Iterable[str]) -> list[str]:
    """The media a block leaving a store of these tiers is reported removed under, each once."""
    return list(dict.fromkeys(MEDIUM[tier] for tier in tiers))


def front_medium(has_memory_tier: bool) -> str:
    """The medium of the tier a daemon serves loads from."""
    return MEDIUM[MEMORY] if has_memory_tier else MEDIUM[PERSISTENT]

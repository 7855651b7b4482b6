"""Hits that never lose to recompute: how much of a stored prefix is worth loading.

The daemon's Lookup says where each block of the prefix lives (kvstore.wire.TIER_*) and
how fast its tiers below memory read (KVStoreClient.where). A block loads in about
`block_bytes / rate` of its tier and recomputes in `block_tokens / recompute_tokens_per_s`;
the connector loads the prefix whose load saves the most time over recomputing it (the
blocks after it are recomputed: a prefix, since a hit must be one), and counts the rest
as declined. A rate the daemon has not measured yet counts as fast: the first loads from
a tier are what measure it.
"""

from __future__ import annotations

from kvstore import wire

HOT_LOAD_RATE = 20e9
"""Bytes/s of a load from the memory tier (host to device: 25-35 GB/s measured on an H200)."""

DEFAULT_RECOMPUTE_TOKENS_PER_S = {"cuda": 30_000.0}
"""recompute_tokens_per_s when not set, by vLLM's device type: an 8B model on an H200
prefills 2048 tokens in 61 ms (33k tokens/s); larger models recompute a token slower and
store more bytes of it, so loading pays off at least as early. Other devices: 0, every
hit loads (a CPU engine recomputes a block far slower than any tier reads it)."""


def worth_loading(
    tiers: bytes,
    block_tokens: int,
    block_bytes: int,
    persistent_rate: float,
    fleet_rate: float,
    recompute_tokens_per_s: float,
) -> int:
    """How many leading blocks of a prefix stored in `tiers` (a TIER_* byte per block) to
    load: the prefix that saves the most time over recomputing it (0: recompute all)."""
    if recompute_tokens_per_s <= 0 or block_bytes <= 0:
        return len(tiers)
    recompute = block_tokens / recompute_tokens_per_s
    gain = {
        wire.TIER_MEMORY: recompute - block_bytes / HOT_LOAD_RATE,
        wire.TIER_PERSISTENT: recompute - (block_bytes / persistent_rate if persistent_rate > 0 else 0.0),
        wire.TIER_FLEET: recompute - (block_bytes / fleet_rate if fleet_rate > 0 else 0.0),
    }
    best, best_gain, total = 0, 0.0, 0.0
    for i, tier in enumerate(tiers):
        total += gain.get(tier, 0.0)
        if total > best_gain:
            best, best_gain = i + 1, total
    return best

"""Connector stats for vLLM's connector-stats hook (logged as 'KV Transfer metrics')."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups",
    "lookup_errors",
    "hit_tokens",
    "blocks_declined",
    "blocks_prefetched",
    "loads",
    "leased_loads",
    "blocks_loaded",
    "bytes_loaded",
    "load_seconds",
    "load_errors",
    "saves",
    "blocks_saved",
    "bytes_saved",
    "save_seconds",
    "save_errors",
    "saves_dropped",
)


def _per_rank(key: str) -> str:
    """bytes_loaded_tp1 -> "Bytes loaded (tp1)"."""
    what, rank = key.rsplit("_", 1)
    return f"{what.replace('_', ' ').capitalize()} ({rank})"


def _zero() -> dict[str, Any]:
    return dict.fromkeys(COUNTERS, 0)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters since the last report; sums across workers and intervals."""

    data: dict[str, Any] = field(default_factory=_zero)

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = _zero()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {key: self.data.get(key, 0) for key in COUNTERS}
        load_s, save_s = d["load_seconds"], d["save_seconds"]
        return {
            "Lookups": d["lookups"],
            "Lookup errors": d["lookup_errors"],
            # the words of the engine's hit log lines (kvstore_connector.hitlog)
            "Tokens loaded from kvstore": d["hit_tokens"],
            # stored blocks left to recompute: loading them was estimated slower
            "Blocks declined (slower than recompute)": d["blocks_declined"],
            # read from the persistent tier into memory at the lookup, a step before the load
            "Blocks prefetched": d["blocks_prefetched"],
            "Blocks loaded": d["blocks_loaded"],
            # loads that started on the pin the scheduler's lookup leased (no Pin round trip)
            "Loads from a lookup's lease": d["leased_loads"],
            "Load GB/s": round(d["bytes_loaded"] / load_s / 1e9, 3) if load_s else 0.0,
            "Load errors (blocks)": d["load_errors"],
            "Blocks saved": d["blocks_saved"],
            "Save GB/s": round(d["bytes_saved"] / save_s / 1e9, 3) if save_s else 0.0,
            "Save errors": d["save_errors"],
            "Saves dropped (backlog full)": d["saves_dropped"],
            # what each tensor-parallel rank moved: its own KV heads
            **{_per_rank(key): value for key, value in sorted(self.data.items()) if "_tp" in key},
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in COUNTERS)

    def take(self) -> KVStoreConnectorStats | None:
        """This interval's stats (None when nothing happened), and start a new interval."""
        if self.is_empty():
            return None
        out = KVStoreConnectorStats(data=dict(self.data))
        self.reset()
        return out

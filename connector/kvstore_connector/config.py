"""The connector's settings (from kv_connector_extra_config) and its namespaces.

    "kv_connector_extra_config": {
        "kvstore_address": "127.0.0.1:50051",   # the daemon
        "namespace": null,           # model identity override (default: the model path/name)
        "consume": false,            # kv_consumer: take blocks with DropSelect (hand-off, frees them)
        "save_mode": null,           # "sync" | "async"; default sync for kv_producer, async for kv_both
        "save_decode": null,         # also save full blocks of generated tokens; default: on for kv_both
        "lookup_timeout_s": 0.5,     # scheduler's Lookup deadline; a slower store counts as a miss
        "load_timeout_s": 10,        # longest a layer may wait for its load before it is recomputed
        "save_timeout_s": 10,        # how long the store may stall on a save (never counts compute)
        "save_backlog_mib": 2048,    # async saves' host copies not yet in the store; beyond: dropped
        "retry_interval_s": 2.0,     # after a failure, how long lookups are skipped (store deemed down)
        "tune_malloc": true,         # keep large buffers in glibc's heap (see kvstore.memory)
        "arena": true,               # on the daemon's host, move KV through its shared-memory arena
        "local_reads": true,         # without the arena: load from the daemon's files (kvstore_client.local)
        "local_data_dir": null,      # where this process sees the daemon's data dir, if elsewhere
        "token_env": "KVSTORE_TOKEN",  # environment variable holding the bearer token, if any
        "tls_ca": null,              # PEM CA bundle: connect with TLS
        "tls_cert": null, "tls_key": null,  # client certificate for mutual TLS
        "compression": "none",       # "fp8" | "int8": KV quantized on the device before it leaves
        "recompute_tokens_per_s": null  # this engine's prefill rate: hits slower to load are recomputed
    }

A token is read from the environment, not from this config: vLLM prints the
kv-transfer config in its logs.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvstore.namespaces import format_namespace, format_root

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_KEYS = {
    "kvstore_address": "address",
    "namespace": "namespace",
    "consume": "consume",
    "save_mode": "save_mode",
    "save_decode": "save_decode",
    "lookup_timeout_s": "lookup_timeout",
    "load_timeout_s": "load_timeout",
    "save_timeout_s": "save_timeout",
    "save_backlog_mib": "save_backlog_mib",
    "retry_interval_s": "retry_interval",
    "tune_malloc": "tune_malloc",
    "arena": "arena",
    "local_reads": "local_reads",
    "local_data_dir": "local_data_dir",
    "token_env": "token_env",
    "tls_ca": "tls_ca",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "compression": "compression",
    "recompute_tokens_per_s": "recompute_tokens_per_s",
}
_KEY_OF = {field: key for key, field in _KEYS.items()}  # what users write, for messages
_MAX_MODEL_ID = 120
# settings that must be positive numbers (besides the *_timeout ones, in seconds), and their unit
_POSITIVE = {"retry_interval": "seconds", "save_backlog_mib": "MiB"}


class ExtraConfigError(ValueError):
    """kv_connector_extra_config is not valid: every problem found, in one message that names
    the keys as users write them. Raised before the connector touches anything; the engine
    does not start."""

    def __init__(self, problems: Sequence[str], *, unknown: bool = False) -> None:
        self.problems = list(problems)
        what = self.problems[0] if len(self.problems) == 1 else "; ".join(self.problems)
        known = f" (known keys: {', '.join(sorted(_KEYS))})" if unknown else ""
        super().__init__(f"kv_connector_extra_config: {what}{known}")


def _unknown_key(key: object) -> str:
    close = difflib.get_close_matches(str(key), _KEYS, n=1)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def role_summary(kv_role: str | None, config: ConnectorConfig) -> str:
    """What the connector does in this role, for its start-up line: "loads, saves async"."""
    loads = kv_role in ("kv_consumer", "kv_both")
    saves = kv_role in ("kv_producer", "kv_both")
    parts = []
    if loads:
        parts.append("loads (consume: DropSelect)" if config.consume else "loads")
    else:
        parts.append("loads nothing")
    if saves:
        parts.append(f"saves {'sync' if config.saves_sync(kv_role) else 'async'}")
    else:
        ignored = (
            " (save_mode and save_decode do not apply)" if config.save_mode or config.save_decode else ""
        )
        parts.append(f"saves nothing{ignored}")
    return ", ".join(parts)


@dataclass(frozen=True)
class ConnectorConfig:
    address: str = "127.0.0.1:50051"
    """HOST:PORT of the kvstore daemon."""
    namespace: str | None = None
    """Model identity in the store's namespace; default: the served model's path or name.
    Set it when engines load the same weights from different paths."""
    consume: bool = False
    """Consumers take blocks with DropSelect (consume-once hand-off) instead of Get."""
    save_mode: str | None = None
    """'sync': a step returns only after its saves are committed (a prefill's output then
    guarantees its KV is in the store); 'async': saves complete in the background."""
    save_decode: bool | None = None
    """Also save the full blocks of generated tokens, keyed as if they were prompt tokens,
    so a chat's next turn (prompt + answer + new message) hits the answer too. Default:
    on for kv_both, off for kv_producer (a prefill makes one token)."""
    lookup_timeout: float = 0.5
    load_timeout: float = 10.0
    save_timeout: float = 10.0
    """How long the store may go without taking a save's data, or answering its commit
    once the last layer is handed over. Never counts the engine's own time: a forward
    pass of any length stores its blocks (see kvstore_client.PutStream)."""
    retry_interval: float = 2.0
    save_backlog_mib: float = 2048
    """Async saves: host memory their gathered KV may hold while it waits to reach the
    store (a slow store). A save that would go beyond it is dropped (counted, logged
    once per episode); one save is always taken when none is pending. Sync saves are
    bounded by the step that waits for them."""
    tune_malloc: bool = True
    """Keep multi-MiB transfer buffers in glibc's heap instead of fresh mappings: page
    faults were most of a load's CPU time. Up to 1 GiB of freed memory stays resident."""
    arena: bool = True
    """Saves and loads move KV through the daemon's shared-memory arena when this process
    can map it (same host and /dev/shm); else over gRPC. Consume (DropSelect) uses gRPC."""
    local_reads: bool = True
    """Loads read blocks straight from the daemon's files when this process can open them
    and the daemon offers it (same host); else, and for consume, they stream over gRPC."""
    local_data_dir: str | None = None
    """Where this process sees the daemon's data directory, when mounted at another path."""

    token_env: str = "KVSTORE_TOKEN"
    """Environment variable holding the bearer token (unset or empty: no token)."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    compression: str = "none"
    """'fp8' (e4m3) or 'int8': each block of each KV head is quantized on the device before it
    leaves (one float32 scale per block-layer and head) and dequantized on the device after
    it arrives, so bytes moved and stored are about half of bf16's. Lossy; part of the
    namespace, so compressed and raw KV never mix. KV that is fp8 in the engine already
    (kv_cache_dtype=fp8) is stored as it is."""
    recompute_tokens_per_s: float | None = None
    """This engine's prefill rate in tokens/s: a stored block counts as a hit only where
    loading it (at its tier's rate, as the daemon measures it) is estimated faster than
    recomputing it (kvstore_connector.costs). Default: 30000 on GPUs, 0 (off: every hit
    loads) elsewhere; 0 turns it off."""

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ExtraConfigError(problems)

    def _problems(self) -> list[str]:
        """Every invalid setting, named by its kv_connector_extra_config key."""
        from kvstore_connector.compression import CODECS

        out = []
        if self.compression not in CODECS:
            out.append(f"compression must be one of {', '.join(CODECS)}, not {self.compression!r}")
        if self.save_mode not in (None, "sync", "async"):
            out.append(f"save_mode must be 'sync' or 'async', not {self.save_mode!r}")
        for f in fields(self):
            unit = "seconds" if f.name.endswith("timeout") else _POSITIVE.get(f.name)
            value = getattr(self, f.name)
            if unit is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                out.append(f"{_KEY_OF[f.name]} must be a positive number of {unit}, not {value!r}")
        for name in ("consume", "tune_malloc", "local_reads", "arena"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.save_decode is not None and not isinstance(self.save_decode, bool):
            out.append(f"save_decode must be true, false or null, not {self.save_decode!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            out.append("tls_cert and tls_key go together")
        rate = self.recompute_tokens_per_s
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0):
            out.append(f"recompute_tokens_per_s must be a number of tokens/s (0: off), not {rate!r}")
        if self.local_data_dir is not None and not isinstance(self.local_data_dir, str):
            out.append(f"local_data_dir must be a path string, not {self.local_data_dir!r}")
        if not isinstance(self.address, str) or ":" not in self.address:
            out.append(f"kvstore_address must be HOST:PORT, not {self.address!r}")
        return out

    def saves_sync(self, kv_role: str | None) -> bool:
        """Whether a step waits for its saves: save_mode, by default sync for kv_producer (its
        output then means its KV is in the store) and async for kv_both."""
        return (self.save_mode or ("sync" if kv_role == "kv_producer" else "async")) == "sync"

    def client_options(self) -> dict[str, Any]:
        """KVStoreClient keyword arguments for the security and local-read settings."""
        return {
            "arena": self.arena,
            "local_reads": self.local_reads and not self.consume,
            "local_data_dir": self.local_data_dir,
            "token": os.environ.get(self.token_env) or None,
            "tls_ca": self.tls_ca,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
        }

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorConfig:
        """The settings of vLLM's kv_connector_extra_config. Raises ExtraConfigError (a
        ValueError) naming every problem at once: unknown keys (with the closest known
        one) and invalid values."""
        problems = [_unknown_key(key) for key in sorted(set(extra) - set(_KEYS), key=str)]
        try:
            config = cls(**{_KEYS[k]: v for k, v in extra.items() if k in _KEYS})
        except ExtraConfigError as exc:
            problems.extend(exc.problems)
        if problems:
            raise ExtraConfigError(problems, unknown=any(p.startswith("unknown key") for p in problems))
        return config


def is_fp8_name(kv_dtype: str) -> bool:
    """Whether vLLM's KV cache dtype name is an fp8 one ("fp8", "fp8_e4m3", "float8_e5m2", ...)."""
    return kv_dtype.startswith("fp8") or kv_dtype.startswith("float8")


@dataclass(frozen=True)
class NamespaceInfo:
    """What must match for KV to be reusable. Not the tensor parallelism: every rank stores
    and loads its own KV heads of one layout (kvstore_connector.layout), so engines of any
    tp share blocks. Pipeline stages hold different layers and keep namespaces apart."""

    model: str
    kv_dtype: str
    block_size: int
    num_kv_heads: int
    head_size: int
    mla: bool
    device: str
    tp_size: int
    pp_size: int
    compression: str = "none"
    """The codec blocks are stored with (kvstore_connector.compression); "none": raw."""
    num_layers: int = 0
    """Attention layers of the model (not part of the namespace; 0: unknown)."""

    def block_bytes(self) -> int:
        """About the bytes a block of one pipeline stage stores (0 when the layer count is
        unknown): what a load of it moves, for the cost of a hit (kvstore_connector.costs)."""
        if not self.num_layers:
            return 0
        element = (
            1
            if self.compression != "none" or is_fp8_name(self.kv_dtype)
            else (4 if self.kv_dtype in ("float32", "fp32") else 2)
        )
        per_layer = (1 if self.mla else 2) * self.num_kv_heads * self.head_size * self.block_size * element
        return per_layer * -(-self.num_layers // self.pp_size)

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, model_override: str | None, compression: str = "none"
    ) -> NamespaceInfo:
        from vllm.platforms import current_platform

        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        kv_dtype = str(cache_config.cache_dtype)
        if kv_dtype == "auto":
            kv_dtype = str(model_config.dtype).removeprefix("torch.")
        return cls(
            model=model_override or model_config.model,
            kv_dtype=kv_dtype,
            block_size=cache_config.block_size,
            num_kv_heads=model_config.get_total_num_kv_heads(),
            head_size=model_config.get_head_size(),
            mla=bool(getattr(model_config, "use_mla", False)),
            device=current_platform.device_type,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            compression="none" if is_fp8_name(kv_dtype) else compression,  # never quantized twice
            num_layers=int(
                getattr(getattr(model_config, "hf_text_config", None), "num_hidden_layers", 0) or 0
            ),
        )

    @property
    def hash_root(self) -> str:
        """The chain root of block hashes: shared by every rank of every engine of this model."""
        return self._base()

    def _base(self) -> str:
        model = self.model
        if len(model) > _MAX_MODEL_ID:
            model = "sha256:" + hashlib.sha256(model.encode()).hexdigest()[:32]
        return format_root(
            model, self.kv_dtype, self.block_size, self.num_kv_heads, self.head_size, self.mla, self.device
        )

    def namespace(self, pp_rank: int) -> bytes:
        """Where pipeline stage `pp_rank`'s layers live (every tensor-parallel rank's heads),
        stored with this compression."""
        return format_namespace(self._base(), self.compression, pp_rank, self.pp_size).encode()

    def all_namespaces(self) -> list[bytes]:
        return [self.namespace(p) for p in range(self.pp_size)]

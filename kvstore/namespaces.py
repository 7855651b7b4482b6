"""The vLLM connector's namespaces: format_root and format_namespace write one (the
connector), parse_namespace reads one back (kvstore_client.hashing for `kvstore-cli
explain`, kvstore-proxy). The format:

    kvc2|MODEL|KV_DTYPE|bsN|kvhN|hdN|mla-or-mha|DEVICE[|fp8 or |int8]|ppRofN

The part up to DEVICE is the root: the chain root of the block hashes, one for every
pipeline stage and codec (the same prompt gives the same hashes). MODEL may hold '|'.
The tensor parallelism is not part of it: every KV head is a store layer of its own.

kvc1 namespaces, from before that (one rank's heads per store layer, no codec), are
still parsed, so that their blocks can be explained:

    kvc1|MODEL|KV_DTYPE|bsN|kvhN|hdN|mla-or-mha|DEVICE|tpRofN|ppRofN

Imports nothing of the daemon, the client or vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FORMAT = "kvc2|MODEL|KV_DTYPE|bsN|kvhN|hdN|mla-or-mha|DEVICE[|fp8 or |int8]|ppRofN"
_CODECS = ("fp8", "int8")
_ROOT = r"\|.+\|[^|]+\|bs(?P<block_size>\d+)\|kvh\d+\|hd\d+\|(?:mla|mha)\|[^|]+"
_STAGE = r"\|pp(?P<pp_rank>\d+)of(?P<pp_size>\d+)"
_KVC2_RE = re.compile(rf"(?P<root>kvc2{_ROOT})(?:\|(?P<compression>{'|'.join(_CODECS)}))?{_STAGE}", re.DOTALL)
_KVC1_RE = re.compile(rf"(?P<root>kvc1{_ROOT})\|tp\d+of\d+{_STAGE}", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ConnectorNamespace:
    """The parts of a connector namespace that its readers use (parse_namespace)."""

    root: str
    """The chain root of its block hashes: the namespace up to DEVICE."""
    block_size: int
    compression: str
    """"none", "fp8" or "int8"."""
    pp_rank: int
    pp_size: int


def format_root(
    model: str, kv_dtype: str, block_size: int, num_kv_heads: int, head_size: int, mla: bool, device: str
) -> str:
    """The root of a kvc2 namespace: what must match for KV to be reusable."""
    return (
        f"kvc2|{model}|{kv_dtype}|bs{block_size}|kvh{num_kv_heads}"
        f"|hd{head_size}|{'mla' if mla else 'mha'}|{device}"
    )


def format_namespace(root: str, compression: str, pp_rank: int, pp_size: int) -> str:
    """Where pipeline stage `pp_rank` of `pp_size` keeps blocks stored with `compression`
    ("none" or a codec's name) under `root` (format_root)."""
    if compression != "none" and compression not in _CODECS:
        raise ValueError(f"compression must be none or one of {', '.join(_CODECS)}, not {compression!r}")
    codec = "" if compression == "none" else f"|{compression}"
    return f"{root}{codec}|pp{pp_rank}of{pp_size}"


def parse_namespace(namespace: str) -> ConnectorNamespace:
    """The parts of a connector namespace (kvc2, or kvc1 with its |tpRofN); ValueError for
    any other string, a root without its |ppRofN included."""
    match = _KVC2_RE.fullmatch(namespace) or _KVC1_RE.fullmatch(namespace)
    if match is None:
        raise ValueError(f"{namespace!r} is not a connector namespace: expected {_FORMAT}")
    return ConnectorNamespace(
        root=match["root"],
        block_size=int(match["block_size"]),
        compression=match.groupdict().get("compression") or "none",
        pp_rank=int(match["pp_rank"]),
        pp_size=int(match["pp_size"]),
    )

"""Shared by prefill.py and decode.py: the prompts and the connector config."""

from __future__ import annotations

import os
import random

ADDRESS = os.environ.get("KVSTORE_ADDRESS", "127.0.0.1:50051")


def prompts(vocab: int = 512) -> list[list[int]]:
    """Token-id prompts (a model without a tokenizer works too); the same in both scripts."""
    rng = random.Random(2024)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (300, 520, 1000)]


def kv_transfer_config(role: str) -> dict:
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvstore_address": ADDRESS},
    }


def llm_args(model: str) -> dict:
    # an explicit KV cache size: on CPU, gpu_memory_utilization is a share of the NUMA
    # node's memory less the process's own, too little on a small node
    args = {"model": model, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 2048}
    if os.environ.get("SKIP_TOKENIZER", "1") == "1":
        args["skip_tokenizer_init"] = True
    return args

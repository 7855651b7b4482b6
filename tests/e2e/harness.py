"""Helpers for end-to-end tests on real vLLM (CPU): tiny random models and engine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("engine_runner.py")


def build_model(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int = 512,
) -> Path:
    """A Llama with random weights (nothing downloaded), saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def kv_config(address: str, role: str, **extra: object) -> dict:
    return {
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvstore_address": address, **extra},
    }


def run_engines(tmp: Path, model: Path, engines: list[dict], *, env: dict[str, str] | None = None,
                timeout: float = 600) -> dict[str, dict]:  # fmt: skip
    """Run engines (sequentially) in one fresh Python process; results by engine name."""
    job = tmp / f"job-{os.getpid()}-{len(list(tmp.glob('job-*')))}.json"
    job.write_text(json.dumps({"model": str(model), "engines": engines}))
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            doc = json.loads(line[len("RESULT ") :])
            results[doc["name"]] = doc
    if proc.returncode != 0 or len(results) != len(engines):
        raise RuntimeError(f"engine run failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    # vLLM logs to stdout by default; keep everything for assertions on log lines
    results["_log"] = {"text": proc.stdout + proc.stderr}
    return results

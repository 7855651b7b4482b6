"""Helpers for end-to-end tests on real vLLM (CPU): tiny random models and engine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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
                timeout: float | None = 600, progress: bool = False,
                before: dict[str, Callable[[], object]] | None = None) -> dict[str, dict]:  # fmt: skip
    """Run engines (sequentially) in one fresh Python process; results by engine name.

    `progress`: print a line (to stderr) as each engine finishes, with its time.
    `before`: by engine name, what to do once that engine is up and before it generates
    (the engine's spec gets "wait": the runner waits for the go on its stdin); by
    "name#n", before that engine's round n (of "rounds")."""
    before = before or {}
    engines = [{**e, "wait": True} if e["name"] in before else e for e in engines]
    engines = [{**e, "wait_rounds": True} if any(k.startswith(e["name"] + "#") for k in before) else e
               for e in engines]  # fmt: skip
    job = tmp / f"job-{os.getpid()}-{len(list(tmp.glob('job-*')))}.json"
    job.write_text(json.dumps({"model": str(model), "engines": engines}))
    results: dict[str, dict] = {}
    lines: list[str] = []
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen(
            [sys.executable, str(RUNNER), str(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, **(env or {})},
        ) as proc:
            _read_results(proc, engines, timeout, progress, started, results, lines, before)
        errors.seek(0)
        stderr = errors.read()
    if proc.returncode != 0 or len(results) != len(engines):
        why = (
            f"killed after {timeout:.0f}s"
            if proc.returncode == -9 and timeout is not None
            else f"rc={proc.returncode}"
        )
        raise RuntimeError(f"engine run failed ({why}):\n{stderr[-6000:]}")
    # vLLM logs to stdout by default; keep everything for assertions on log lines
    results["_log"] = {"text": "".join(lines) + stderr}
    return results


def _read_results(proc: subprocess.Popen[str], engines: list[dict], timeout: float | None, progress: bool,
                  started: float, results: dict[str, dict], lines: list[str],
                  before: dict[str, Callable[[], object]]) -> None:  # fmt: skip
    # NOTE: a timer, not the reading loop, enforces the deadline: a silent engine
    # blocks the loop in readline.
    timer = threading.Timer(timeout, proc.kill) if timeout is not None else None
    if timer is not None:
        timer.start()
    try:
        assert proc.stdout is not None
        since = 0
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("WAITING "):
                before[line.split()[1]]()
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif line.startswith("RESULT "):
                doc = json.loads(line[len("RESULT ") :])
                doc["log"] = "".join(lines[since:])  # what this engine printed (vLLM logs to stdout)
                since = len(lines)
                results[doc["name"]] = doc
                if progress:
                    print(
                        f"  engine {doc['name']} done ({len(results)}/{len(engines)}, "
                        f"{time.monotonic() - started:.0f}s)",
                        file=sys.stderr,
                        flush=True,
                    )
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""The connector on real vLLM (CPU): prefill and decode instances share KV through a real daemon.

Each engine run is its own Python process (tests/e2e/engine_runner.py); the
daemon is its own process too. Tokens are compared with a no-connector
baseline; store-side Stats prove the KV was served.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from daemon import Daemon, eventually
from harness import kv_config, run_engines

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes

pytestmark = pytest.mark.e2e

BLOCK = 32


def full_blocks(prompts: list[list[int]]) -> int:
    """Blocks a decode can load: whole blocks that leave at least one token to compute."""
    return sum((len(p) - 1) // BLOCK for p in prompts)


@pytest.fixture
def store(tmp_path: Path):
    d = Daemon(tmp_path / "data", capacity="1GiB").start()
    yield d
    d.stop()


def stats(address: str) -> dict:
    with KVStoreClient(address) as kv:
        return kv.stats()


def test_disaggregated_prefill_then_decode(tmp_path, model, prompts, baseline, cluster):
    # two daemons standing for two hosts, sharing nothing but a Redis Cluster (the fleet)
    fleet = ["--fleet", cluster.url, "--fleet-prefix", f"e2e-{tmp_path.name}/"]
    store = Daemon(tmp_path / "data", capacity="1GiB", extra_args=fleet).start()
    host_b = Daemon(tmp_path / "host-b", capacity="1GiB", extra_args=fleet).start()
    try:
        _prefill_then_decodes(tmp_path, model, prompts, baseline, store, host_b)
    finally:
        store.stop()
        host_b.stop()


def _prefill_then_decodes(tmp_path, model, prompts, baseline, store: Daemon, host_b: Daemon) -> None:
    # prefill: chunked (64-token steps), so blocks are saved across several steps
    run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1,
        "llm": {"max_num_batched_tokens": 64},
    }])  # fmt: skip
    saved = stats(store.address)
    assert saved["blocks"] == sum(len(p) // BLOCK for p in prompts)
    assert saved["commits"] > 0 and saved["puts"] == saved["commits"]  # saved through the arena
    # the decode reading the daemon's files needs them written behind; the one on the
    # other host, copied to the fleet
    eventually(lambda: stats(store.address)["write_behind_blocks"] == 0)
    eventually(lambda: stats(store.address)["fleet_blocks_written"] == saved["blocks"])

    # four decode instances: through the arena (the default), reading the daemon's files
    # on the same host (no arena), over gRPC, and on another host, through the fleet
    out = run_engines(tmp_path, model, [
        {"name": "decode", "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
         "log_stats": True},
        {"name": "decode-files", "kv": kv_config(store.address, "kv_consumer", arena=False),
         "prompts": prompts, "max_tokens": 8},
        {"name": "decode-grpc", "kv": kv_config(store.address, "kv_consumer", arena=False, local_reads=False),
         "prompts": prompts, "max_tokens": 8},
        {"name": "decode-fleet", "kv": kv_config(host_b.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8},
    ])  # fmt: skip
    assert out["decode"]["tokens"] == baseline
    assert out["decode-files"]["tokens"] == baseline
    assert out["decode-grpc"]["tokens"] == baseline
    assert out["decode-fleet"]["tokens"] == baseline
    on_b = stats(host_b.address)
    assert on_b["fleet_promoted_blocks"] == full_blocks(prompts)  # every loadable block came from the fleet
    assert on_b["fleet_blocks_written"] == 0  # and is not copied back
    # the connector's own stats reached vLLM's connector-stats logging
    metrics = re.search(r"KV Transfer metrics: (.*)", out["_log"]["text"])
    assert metrics is not None, "no KV Transfer metrics line in vLLM's log"
    assert f"Blocks loaded={full_blocks(prompts)}" in metrics.group(1)
    log = out["_log"]["text"]
    assert re.search(r"kvstore connector: KV moves through the daemon's arena \S+", log)
    assert re.search(r"kvstore connector: loads read the daemon's files in \S+ \(same host\)", log)
    after = stats(store.address)
    # every decode's lookups reached the daemon (the file reader's in the background)
    assert after["hit_blocks"] - saved["hit_blocks"] == 3 * full_blocks(prompts)
    # the arena decode pinned its blocks, the gRPC one streamed them: both served from the
    # memory tier (verified); the file reader took nothing from the daemon
    assert after["memory_hit_blocks"] - saved["memory_hit_blocks"] == 2 * full_blocks(prompts)
    assert after["persistent_hit_blocks"] == saved["persistent_hit_blocks"]
    assert after["pins"] > saved["pins"]
    block_bytes = saved["bytes_used"] // saved["blocks"]
    assert after["bytes_read"] - saved["bytes_read"] == 2 * full_blocks(prompts) * block_bytes


def test_decode_really_uses_the_stored_kv(tmp_path, model, other_model, prompts, baseline, store):
    # KV computed by other weights, stored under the namespace the decode will read
    shared = {"namespace": "shared-model-id"}
    out = run_engines(tmp_path, model, [
        {"name": "prefill", "model": str(other_model), "kv": kv_config(store.address, "kv_producer", **shared),
         "prompts": prompts, "max_tokens": 1},
        {"name": "decode", "kv": kv_config(store.address, "kv_consumer", **shared), "prompts": prompts,
         "max_tokens": 8},
    ])  # fmt: skip
    differing = [
        i for i, (got, want) in enumerate(zip(out["decode"]["tokens"], baseline, strict=False)) if got != want
    ]
    assert differing, "decode gave baseline tokens from foreign KV: it recomputed instead of loading"


def test_prefix_reuse_hits_only_shared_blocks(tmp_path, model, prompts, store):
    first = prompts[3]  # 300 tokens: 9 full blocks
    shared_tokens = 5 * BLOCK + 7  # 5 whole shared blocks, then the prompts diverge
    second = first[:shared_tokens] + [(t + 1) % 512 for t in first[shared_tokens:]]
    both = kv_config(store.address, "kv_both")
    before = stats(store.address)
    # one engine process: each engine finishes (its saves committed) before the next starts
    out = run_engines(tmp_path, model, [
        {"name": "turn1", "kv": both, "prompts": [first], "max_tokens": 4},
        {"name": "turn2", "kv": both, "prompts": [second], "max_tokens": 8},
        {"name": "plain", "kv": None, "prompts": [second], "max_tokens": 8},
    ])  # fmt: skip
    after = stats(store.address)
    assert out["turn2"]["tokens"] == out["plain"]["tokens"]
    assert after["hit_blocks"] - before["hit_blocks"] == 5  # turn1 hit nothing: the store was empty
    # turn1 stored its full blocks; kv_both stored what the store lacked of `second`: its 4 new ones
    assert after["blocks"] - before["blocks"] == len(first) // BLOCK + len(second) // BLOCK - 5


def test_store_down_between_prefill_and_decode(tmp_path, model, prompts, baseline, store):
    run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1,
    }])  # fmt: skip
    address = store.address
    store.kill()
    out = run_engines(tmp_path, model, [{
        "name": "decode", "kv": kv_config(address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
    }])  # fmt: skip
    assert out["decode"]["tokens"] == baseline
    warnings = re.findall(r"WARNING.*kvstore at \S+ failed", out["_log"]["text"])
    assert len(warnings) == 1, warnings


def test_stalled_store_is_a_miss_not_a_hang(tmp_path, model, prompts, baseline, store):
    run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1,
    }])  # fmt: skip
    assert store.proc is not None
    store.pause()  # alive, connected, answering nothing
    try:
        out = run_engines(tmp_path, model, [{
            "name": "decode", "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
        }], timeout=300)  # fmt: skip
    finally:
        store.resume()
    assert out["decode"]["tokens"] == baseline


def test_consume_mode_frees_the_handoff(tmp_path, model, prompts, baseline, store):
    # one engine process: the prefill engine's saves are committed before the decode starts
    out = run_engines(tmp_path, model, [
        {"name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1},
        {"name": "decode", "kv": kv_config(store.address, "kv_consumer", consume=True), "prompts": prompts,
         "max_tokens": 8},
    ])  # fmt: skip
    assert out["decode"]["tokens"] == baseline
    after = stats(store.address)
    assert after["commits"] > 0 and after["hit_blocks"] == full_blocks(prompts)  # saved, then all loaded
    # every block the decode loaded is gone; only each prompt's unusable tail blocks stay
    assert after["blocks"] == sum(len(p) // BLOCK for p in prompts) - full_blocks(prompts)


def test_corrupt_block_is_recomputed(tmp_path, model, prompts, baseline, store):
    run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1,
    }])  # fmt: skip
    # a stray write into the arena: one byte of the first block of three prompts
    with KVStoreClient(store.address) as kv:
        before = kv.stats()
        (namespace,) = {b.namespace for b in kv.iter_blocks()}
        root = namespace.decode().rsplit("|tp", 1)[0]
        for prompt in prompts[:3]:
            pinned = kv.pin(namespace, block_hashes(root, prompt, BLOCK)[:1])
            assert pinned is not None and pinned.num_blocks == 1
            pinned.block_view(0, 0)[7] ^= 0xFF
            pinned.release()
    out = run_engines(tmp_path, model, [{
        "name": "decode", "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
    }])  # fmt: skip
    assert out["decode"]["tokens"] == baseline  # the bad prompts were recomputed
    after = stats(store.address)
    assert after["checksum_failures"] - before["checksum_failures"] == 3  # reported, verified, dropped
    assert after["blocks"] < before["blocks"]


def test_tensor_parallel_two_ranks(tmp_path, model, prompts, store):
    tp = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    first = run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 8,
        "llm": tp,
    }], env=env)  # fmt: skip
    with KVStoreClient(store.address) as kv:
        listed = list(kv.iter_blocks())
    namespaces = {b.namespace for b in listed}
    assert len(namespaces) == 2 and all(b"tp0of2" in ns or b"tp1of2" in ns for ns in namespaces)
    out = run_engines(tmp_path, model, [{
        "name": "decode", "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
        "llm": tp,
    }], env=env)  # fmt: skip
    assert out["decode"]["tokens"] == first["prefill"]["tokens"]
    after = stats(store.address)
    assert after["hit_blocks"] == 2 * full_blocks(prompts)
    # both ranks' worker processes mapped the one arena: they saved and loaded through it
    assert after["commits"] >= 2 and after["memory_hit_blocks"] == 2 * full_blocks(prompts)


def test_hashes_match_what_the_connector_stored(tmp_path, model, prompts, store):
    """The CLI's and client's hashing names the connector's blocks (same module, same keys)."""
    run_engines(tmp_path, model, [{
        "name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts[:1], "max_tokens": 1,
    }])  # fmt: skip
    with KVStoreClient(store.address) as kv:
        (block,) = {b.namespace for b in kv.iter_blocks()}
        root = block.decode().rsplit("|tp", 1)[0]
        hashes = block_hashes(root, prompts[0], BLOCK)
        assert kv.lookup(block, hashes) == len(prompts[0]) // BLOCK

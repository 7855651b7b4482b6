"""The connector on real vLLM (CPU): prefill and decode instances share KV through a real daemon.

Each engine run is its own Python process (tests/e2e/engine_runner.py); the
daemon is its own process too. Tokens are compared with a no-connector
baseline; store-side Stats prove the KV was served.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from harness import kv_config, run_engines
from support.daemon import Daemon, eventually
from support.ports import free_port
from support.redis_cluster import Cluster, Node

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
    # its scheduler side's lookups leased the blocks: the workers loaded with no Pin of their own
    assert f"Loads from a lookup's lease={len(prompts)}" in metrics.group(1)
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


def test_foreign_kv_changes_tokens_and_a_master_killed_mid_run_is_recomputes(
    tmp_path, model, other_model, prompts, baseline
):
    # a fleet with replicas (3 masters + 3), and three daemons standing for three hosts
    cluster = Cluster(tmp_path / "ha", masters=3, replicas=1).start()
    fleet = ["--fleet", cluster.url]
    hosts = {name: Daemon(tmp_path / name, capacity="1GiB", extra_args=fleet).start() for name in "abc"}
    try:
        _foreign_kv_then_failover(tmp_path, model, other_model, prompts, baseline, cluster, hosts)
    finally:
        for d in hosts.values():
            d.stop()
        cluster.stop()


def _foreign_kv_then_failover(tmp_path, model, other_model, prompts, baseline, cluster: Cluster,
                              hosts: dict[str, Daemon]) -> None:  # fmt: skip
    a, b, c = (hosts[n] for n in "abc")
    shared = {"namespace": "shared-model-id"}
    stored = 2 * sum(len(p) // BLOCK for p in prompts)
    masters: list[Node] = []
    marks: dict[str, dict] = {}

    def in_the_fleet() -> None:
        eventually(lambda: stats(a.address)["fleet_blocks_written"] == stored)
        masters.extend(n for n in cluster.nodes if n.client().info("replication")["role"] == "master")
        eventually(lambda: all(_replicated(m) for m in masters))  # every write is on a replica too

    def kill_a_master() -> None:
        # one holding blocks of this model's own namespace (keys carry it in hex)
        foreign = b"shared-model-id".hex().encode()
        max(masters, key=lambda m: sum(foreign not in k for k in m.client().scan_iter(count=1000))).stop()

    def after_failover() -> None:
        eventually(cluster.healthy, deadline_s=30.0)  # a replica took over the dead master's slots
        marks["c"] = stats(c.address)

    out = run_engines(tmp_path, model, [
        # on host a: this model's KV, and KV computed by other weights, stored under a
        # namespace that a decode of this model will read
        {"name": "prefill", "kv": kv_config(a.address, "kv_producer"), "prompts": prompts, "max_tokens": 1},
        {"name": "prefill-foreign", "model": str(other_model), "kv": kv_config(a.address, "kv_producer", **shared),
         "prompts": prompts, "max_tokens": 1},
        # the foreign KV, loaded on the same host and through the fleet: the tokens change
        {"name": "foreign-local", "kv": kv_config(a.address, "kv_consumer", **shared), "prompts": prompts,
         "max_tokens": 8},
        {"name": "foreign-fleet", "kv": kv_config(b.address, "kv_consumer", **shared), "prompts": prompts,
         "max_tokens": 8},
        # host c's decodes: while a master is dead, then once its replica has taken over
        {"name": "outage", "kv": kv_config(c.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8},
        {"name": "after", "kv": kv_config(c.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8},
    ], before={"foreign-local": in_the_fleet, "outage": kill_a_master, "after": after_failover})  # fmt: skip
    for name in ("foreign-local", "foreign-fleet"):
        assert out[name]["tokens"] != baseline, f"{name}: baseline tokens from foreign KV: it recomputed"
    assert stats(b.address)["fleet_promoted_blocks"] == full_blocks(prompts)
    # the dead master's blocks were misses, recomputed: no crash, no hang, baseline tokens
    assert out["outage"]["tokens"] == baseline
    on_c = stats(c.address)
    assert marks["c"]["fleet_errors"] > 0 and marks["c"]["hit_blocks"] < full_blocks(prompts)
    # after the failover every block is served again, from the promoted replica too
    assert out["after"]["tokens"] == baseline
    assert on_c["hit_blocks"] - marks["c"]["hit_blocks"] == full_blocks(prompts)
    assert on_c["fleet_promoted_blocks"] == full_blocks(prompts)  # each fetched once, over both runs
    assert on_c["fleet_up"]
    log = c.log_path.read_text()
    assert log.count("does not answer") == 1 and "is back after" in log


def _replicated(master: Node) -> bool:
    info = master.client().info("replication")
    replicas = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return bool(replicas) and all(r["offset"] == info["master_repl_offset"] for r in replicas)


def test_prefix_reuse_hits_only_shared_blocks_and_a_next_turn_hits_the_answer(
    tmp_path, model, prompts, store
):
    first = prompts[3]  # 300 tokens: 9 full blocks
    shared_tokens = 5 * BLOCK + 7  # 5 whole shared blocks, then the prompts diverge
    second = first[:shared_tokens] + [(t + 1) % 512 for t in first[shared_tokens:]]
    both = kv_config(store.address, "kv_both")
    chat = prompts[0]  # 100 tokens: 3 full blocks; with 100 generated, 6 are computed
    new_message = [[(7 * i) % 512 for i in range(40)]]
    marks: dict[str, dict] = {"before": stats(store.address)}
    # one engine process: each engine finishes (its saves committed) before the next starts
    out = run_engines(tmp_path, model, [
        {"name": "turn1", "kv": both, "prompts": [first], "max_tokens": 4},
        {"name": "turn2", "kv": both, "prompts": [second], "max_tokens": 8},
        {"name": "plain", "kv": None, "prompts": [second], "max_tokens": 8},
        # a chat: turn 2 is turn 1's prompt, its answer, and a new message
        {"name": "chat1", "kv": both, "prompts": [chat], "max_tokens": 100},
        {"name": "chat2", "kv": both, "continue": {"from": "chat1", "then": new_message}, "max_tokens": 8},
        {"name": "chat2-plain", "kv": None, "continue": {"from": "chat1", "then": new_message}, "max_tokens": 8},
    ], before={"chat1": lambda: marks.update(reuse=stats(store.address)),
               "chat2": lambda: marks.update(chat1=stats(store.address))})  # fmt: skip
    before, after = marks["before"], marks["reuse"]
    assert out["turn2"]["tokens"] == out["plain"]["tokens"]
    assert after["hit_blocks"] - before["hit_blocks"] == 5  # turn1 hit nothing: the store was empty
    # turn1 stored its full blocks; kv_both stored what the store lacked of `second`: its 4 new ones
    assert after["blocks"] - before["blocks"] == len(first) // BLOCK + len(second) // BLOCK - 5
    # chat1 saved its prompt's full blocks and the answer's (kv_both saves what it generates)
    computed = len(chat) + 100 - 1  # the last token's KV is never computed
    assert marks["chat1"]["blocks"] - after["blocks"] == computed // BLOCK
    # turn 2 hit every full block of turn 1's prompt and answer, and gives the baseline tokens
    assert stats(store.address)["hit_blocks"] - marks["chat1"]["hit_blocks"] == computed // BLOCK
    assert out["chat2"]["tokens"] == out["chat2-plain"]["tokens"]


def test_consume_mode_frees_the_handoff(tmp_path, model, prompts, baseline, store):
    # one engine process: the prefill engine's saves are committed before the decode starts
    out = run_engines(tmp_path, model, [
        {"name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1},
        {"name": "decode", "kv": kv_config(store.address, "kv_consumer", consume=True), "prompts": prompts,
         "max_tokens": 8},
    ])  # fmt: skip
    assert out["decode"]["tokens"] == baseline
    # the engine's own log says what the store gave each request (offline LLM: no stats logging)
    hits = re.findall(
        r"INFO .* kvstore: request \S+: (\d+) of (\d+) prompt tokens loaded from kvstore \((\d+) blocks\)",
        out["decode"]["log"],
    )
    assert sorted(tuple(map(int, hit)) for hit in hits) == sorted(
        ((len(p) - 1) // BLOCK * BLOCK, len(p), (len(p) - 1) // BLOCK) for p in prompts
    )
    assert "loaded from kvstore" not in out["prefill"]["log"]  # a producer loads nothing
    assert "role kv_consumer: loads (consume: DropSelect), saves nothing" in out["decode"]["log"]
    after = stats(store.address)
    assert after["commits"] > 0 and after["hit_blocks"] == full_blocks(prompts)  # saved, then all loaded
    # every block the decode loaded is gone; only each prompt's unusable tail blocks stay
    assert after["blocks"] == sum(len(p) // BLOCK for p in prompts) - full_blocks(prompts)


def test_a_corrupt_block_a_stalled_store_and_a_dead_one_are_recomputes(
    tmp_path, model, prompts, baseline, store
):
    """One engine process: a prefill, then three decodes, each after a fault: a stray
    write into the arena, the daemon stopped (alive, answering nothing), the daemon killed."""
    marks: dict[str, dict] = {}

    def corrupt() -> None:
        # one byte of the first block of three prompts; the client's hashing names the
        # connector's blocks (the same module, the same keys)
        with KVStoreClient(store.address) as kv:
            marks["before"] = kv.stats()
            (namespace,) = {b.namespace for b in kv.iter_blocks()}
            root = namespace.decode().rsplit("|pp", 1)[0]
            assert kv.lookup(namespace, block_hashes(root, prompts[3], BLOCK)) == len(prompts[3]) // BLOCK
            for prompt in prompts[:3]:
                pinned = kv.pin(namespace, block_hashes(root, prompt, BLOCK)[:1])
                assert pinned is not None and pinned.num_blocks == 1
                pinned.block_view(0, 0)[7] ^= 0xFF
                pinned.release()

    def stall() -> None:
        marks["after-corrupt"] = stats(store.address)
        store.pause()  # alive, connected, answering nothing

    out = run_engines(tmp_path, model, [
        {"name": "prefill", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 1},
        *({"name": name, "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8}
          for name in ("corrupt", "stalled", "dead")),
    ], before={"corrupt": corrupt, "stalled": stall, "dead": store.kill})  # fmt: skip
    # the bad prompts were recomputed; the bad blocks reported, verified, dropped
    assert out["corrupt"]["tokens"] == baseline
    before, after = marks["before"], marks["after-corrupt"]
    assert after["checksum_failures"] - before["checksum_failures"] == 3
    assert after["blocks"] < before["blocks"]
    # a stalled store is a miss within the lookup deadline, not a hang
    assert out["stalled"]["tokens"] == baseline
    # a dead one: misses, and one warning for the outage
    assert out["dead"]["tokens"] == baseline
    warnings = re.findall(r"WARNING.*kvstore at \S+ failed", out["dead"]["log"])
    assert len(warnings) == 1, warnings


def test_prefill_and_decode_with_different_tensor_parallelism(tmp_path, model, prompts, store):
    """One engine process, in float32 (in bf16 a random model's TP=1 and TP=2 engines
    disagree on greedy tokens by themselves): a TP=1 prefill; a TP=2 engine (one: each
    costs three processes' start-up) that decodes from it, then, the store emptied,
    computes and saves its own KV, then loads it; a TP=1 decode of what TP=2 saved."""
    fp32 = {"dtype": "float32", "enable_prefix_caching": False}
    tp2 = {**fp32, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    marks: dict[str, dict] = {}

    def empty_the_store() -> None:
        marks["tp1-to-tp2"] = stats(store.address)
        with KVStoreClient(store.address) as kv:
            kv.evict(all=True)
        marks["emptied"] = stats(store.address)

    def after_tp2_saves() -> None:
        marks["tp2-saved"] = stats(store.address)

    out = run_engines(tmp_path, model, [
        {"name": "tp1", "kv": kv_config(store.address, "kv_producer"), "prompts": prompts, "max_tokens": 8,
         "llm": fp32},
        {"name": "tp2", "kv": kv_config(store.address, "kv_both", save_mode="sync", save_decode=False),
         "prompts": prompts, "max_tokens": 8, "llm": tp2, "rounds": 3, "log_stats": True},
        {"name": "tp1-decode", "kv": kv_config(store.address, "kv_consumer"), "prompts": prompts, "max_tokens": 8,
         "llm": fp32},
    ], env=env, before={"tp2#2": empty_the_store, "tp2#3": after_tp2_saves})  # fmt: skip
    loaded_by_tp2, computed_by_tp2, loaded_own = out["tp2"]["rounds"]
    tp1_baseline = out["tp1"]["tokens"]  # the producer loaded nothing: its own compute
    # round 2 ran on an empty store: TP=2's own baseline; rounds 1 and 3 loaded KV
    assert marks["tp2-saved"]["hit_blocks"] == marks["emptied"]["hit_blocks"]
    assert loaded_by_tp2 == computed_by_tp2  # TP=1 prefill -> TP=2 decode
    assert loaded_own == computed_by_tp2  # TP=2 -> TP=2
    assert out["tp1-decode"]["tokens"] == tp1_baseline  # TP=2 prefill -> TP=1 decode
    final = stats(store.address)
    hits = full_blocks(prompts)
    assert marks["tp1-to-tp2"]["hit_blocks"] == hits  # TP=2 found every block TP=1 saved
    assert final["hit_blocks"] - marks["tp2-saved"]["hit_blocks"] == 2 * hits  # round 3 and TP=1's decode
    # TP=2's saves were two partial puts per block, made whole in the daemon
    assert marks["tp2-saved"]["partials_completed"] == marks["tp2-saved"]["blocks"] > 0
    # each rank wrote its heads where the block lies in the arena: the daemon copied none
    assert marks["tp2-saved"]["part_layers_copied"] == 0 < marks["tp2-saved"]["part_layers_in_place"]
    assert final["partial_blocks"] == 0
    with KVStoreClient(store.address) as kv:
        stored = list(kv.iter_blocks())
        (namespace,) = {b.namespace for b in stored}
        block_bytes = stored[0].size_bytes
    assert b"|tp" not in namespace and b"|float32|" in namespace  # one namespace for every TP
    # each TP=2 rank moved only its KV heads: half of each block, in rounds 1 and 3
    metrics = re.search(r"KV Transfer metrics: (.*)", out["tp2"]["log"])
    assert metrics is not None, "no KV Transfer metrics line in vLLM's log"
    for rank in (0, 1):
        moved = re.search(rf"Bytes loaded \(tp{rank}\)=(\d+)", metrics.group(1))
        assert moved is not None and int(moved.group(1)) == 2 * hits * block_bytes // 2, metrics.group(1)


class Subscriber:
    """A ZMQ SUB of KV event batches on a thread, decoded with the installed vLLM's classes;
    `connected()` waits until its connection is up (a SUB sees only what is sent after)."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sock.connect(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def connected(self, timeout_ms: int = 60_000) -> None:
        assert self._monitor.poll(timeout_ms), "the KV events subscriber never connected"
        self._monitor.recv_multipart()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                _, _, payload = self.sock.recv_multipart()
                self.batches.append(self._decoder.decode(payload))

    def events(self) -> list:
        return [e for b in self.batches for e in b.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()


def test_kv_events_from_the_engine_and_from_the_daemon(tmp_path, model, prompts):
    from vllm.distributed.kv_events import BlockStored

    daemon_events, engine_events = f"tcp://127.0.0.1:{free_port()}", free_port()
    store = Daemon(
        tmp_path / "data", capacity="1GiB", extra_args=["--kv-events-endpoint", daemon_events]
    ).start()
    from_daemon, from_engine = Subscriber(daemon_events), Subscriber(f"tcp://127.0.0.1:{engine_events}")
    try:
        from_daemon.connected()
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{engine_events}"}
        saved = sum(len(p) // BLOCK for p in prompts)

        def all_stored() -> None:
            eventually(lambda: sum(len(e.block_hashes) for e in from_daemon.events()) == saved)

        # two rounds: the engine reports what the store committed at its next steps
        run_engines(tmp_path, model, [
            {"name": "both", "kv": kv_config(store.address, "kv_both"), "prompts": prompts, "max_tokens": 2,
             "llm": {"kv_events_config": events}, "rounds": 2},
        ], before={"both": from_engine.connected, "both#2": all_stored})  # fmt: skip
        from_daemon_done = from_daemon.events()
    finally:
        from_daemon.close()
        from_engine.close()
        store.stop()
    # the daemon: every block the prefill stored, each prompt's in order, with its token ids
    stored = [e for e in from_daemon_done if isinstance(e, BlockStored)]
    tokens = sorted(e.token_ids for e in stored)
    assert tokens == sorted(p[: len(p) // BLOCK * BLOCK] for p in prompts)
    # saved through the arena: in the memory tier, vLLM's "CPU" (kvstore.kv_events_media)
    assert all(e.block_size == BLOCK and e.medium == "CPU" for e in stored)
    # the engine: the store's blocks under vLLM's own hashes (those of its GPU blocks),
    # each reported once: the saves of round 1, seen committed by its next steps
    engine = [e for e in from_engine.events() if isinstance(e, BlockStored)]
    gpu = {h for e in engine if e.medium == "GPU" for h in e.block_hashes}
    in_store = [h for e in engine if e.medium == "CPU" for h in e.block_hashes]
    assert len(in_store) == len(set(in_store)) == saved and set(in_store) <= gpu

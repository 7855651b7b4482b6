"""The connector's scheduler and worker halves against a real daemon.

A daemon process, as beside vLLM: the connector moves KV through the daemon's arena
(its default) or reads the store's files on the same host (local_reads), which needs
the store in another process (LMDB may be opened once per process), and some tests
kill or pause it. What touches the backend's files runs on both backends.

vLLM's own Request / SchedulerOutput / KVCacheBlocks are plain data here
(SimpleNamespace with the fields the connector reads); the engine-level
behaviour is proven on real vLLM in tests/e2e.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from types import SimpleNamespace

import pytest
import torch
from kvstore_connector.config import ConnectorConfig, NamespaceInfo
from kvstore_connector.costs import HOT_LOAD_RATE
from kvstore_connector.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_connector.scheduler import SchedulerSide
from kvstore_connector.worker import WorkerSide
from support.daemon import eventually

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes

from .helpers import both_backends
from .test_corruption import flip_payload_byte
from .test_metrics import calls, scrape

BS = 32
INFO = NamespaceInfo("test-model", "bfloat16", BS, 2, 64, False, "cpu", tp_size=1, pp_size=1)
NS = INFO.namespace(0)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
POOL = 24  # paged blocks per layer


def request(req_id: str, tokens: list[int], **extra: object) -> SimpleNamespace:
    fields = dict(
        request_id=req_id,
        prompt_token_ids=tokens,
        all_token_ids=list(tokens),  # the prompt, then what is generated
        num_tokens=len(tokens),
        mm_features=[],
        lora_request=None,
        cache_salt=None,
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step(new=(), cached=(), resumed=(), scheduled=None) -> SimpleNamespace:
    """A SchedulerOutput with the fields build_connector_meta reads."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=done) for r, ids, done in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[(ids,) if ids is not None else None for _, ids, _ in cached],
            num_computed_tokens=[done for _, _, done in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
    )


def config(address: str, **kw: object) -> ConnectorConfig:
    return ConnectorConfig(address=address, **kw)  # type: ignore[arg-type]


def per_head(layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's layers [n, heads, ...] as the connector stores them: a layer per KV head."""
    return {f"{name}#h{h}": t[:, h].contiguous() for name, t in layers.items() for h in range(t.shape[1])}


def joined(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of per_head: stored layers back as vLLM's [n, heads, ...]."""
    heads = INFO.num_kv_heads
    return {name: torch.stack([stored[f"{name}#h{h}"] for h in range(heads)], dim=1) for name in LAYERS}


def store_blocks(address: str, hashes: list[bytes], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layers = {name: torch.randn((len(hashes), 2, BS, 128), generator=g).to(torch.bfloat16) for name in LAYERS}
    with KVStoreClient(address, arena=False) as kv:  # a Put: in the persistent tier at once
        kv.put(NS, hashes, per_head(layers))
    return layers


PROMPT = list(range(1000, 1200))  # 200 tokens: 6 full blocks, 8 tokens over


# ---- scheduler side
def test_chunked_prefill_saves_each_block_once_as_it_fills(daemon) -> None:
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=True)
    req = request("r1", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, blocks([1, 2]), 0)
    want = block_hashes(INFO.hash_root, PROMPT, BS)

    meta = side.build_connector_meta(step(new=[("r1", [1, 2], 0)], scheduled={"r1": 64}))
    assert [(s.hashes, s.block_ids, s.parent_hash) for s in meta.saves] == [(want[0:2], [1, 2], b"")]
    meta = side.build_connector_meta(step(cached=[("r1", [3, 4], 64)], scheduled={"r1": 64}))
    assert [(s.hashes, s.block_ids, s.parent_hash) for s in meta.saves] == [(want[2:4], [3, 4], want[1])]
    # last chunk: 72 tokens complete blocks 4 and 5 (the 8-token tail is never saved)
    meta = side.build_connector_meta(step(cached=[("r1", [5, 6, 7], 128)], scheduled={"r1": 72}))
    assert [(s.hashes, s.block_ids) for s in meta.saves] == [(want[4:6], [5, 6])]
    # decode steps add nothing
    meta = side.build_connector_meta(step(cached=[("r1", None, 200)], scheduled={"r1": 1}))
    assert meta.saves == [] and meta.loads == []
    side.close()


@pytest.mark.parametrize("save_decode", [True, False])
def test_save_decode_saves_generated_blocks_as_they_fill_keyed_like_a_prompt(
    daemon, save_decode: bool
) -> None:
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=True, save_decode=save_decode)
    req = request("r1", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(list(range(1, 8))), 0)
    meta = side.build_connector_meta(step(new=[("r1", list(range(1, 8)), 0)], scheduled={"r1": 200}))
    assert [len(s.hashes) for s in meta.saves] == [6]  # the prompt's full blocks
    saved = []
    for i in range(60):  # decode steps: each feeds the token sampled last and computes its KV
        req.all_token_ids.append(5000 + i)
        req.num_tokens += 1
        done = len(req.all_token_ids) - 1
        new_ids = [8] if done == 7 * BS else [9] if done == 8 * BS else None  # a new paged block
        meta = side.build_connector_meta(step(cached=[("r1", new_ids, done)], scheduled={"r1": 1}))
        saved += [(s.hashes, s.block_ids, s.parent_hash, len(req.all_token_ids)) for s in meta.saves]
    # the same chain as a prompt of these tokens would have: a next turn's prompt hits it
    want = block_hashes(INFO.hash_root, req.all_token_ids, BS)
    if save_decode:
        assert saved == [([want[6]], [7], want[5], 7 * BS), ([want[7]], [8], want[6], 8 * BS)]
    else:
        assert saved == []
    side.close()


def test_kv_events_report_committed_saves_and_store_hits_under_vllms_hashes_then_evictions(daemon) -> None:
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=True, kv_events=True)
    try:
        _kv_events(daemon, side)
    finally:
        side.close()


def _kv_events(daemon, side: SchedulerSide) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    vllm_hashes = [bytes([i + 1]) * 32 for i in range(6)]  # vLLM's own hashes of the 6 full blocks
    published = [maybe_convert_block_hash(h) for h in vllm_hashes]  # as vLLM publishes its own
    req = request("r1", PROMPT, block_hashes=vllm_hashes)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks(list(range(1, 8))), 0)
    (save,) = side.build_connector_meta(step(new=[("r1", list(range(1, 8)), 0)], scheduled={"r1": 200})).saves
    assert side.take_events() == []  # planned is not stored: reported once the store has it
    store_blocks(daemon.address, save.hashes[:4])  # the worker's save, here a client's Put
    got: list = []
    eventually(lambda: bool(got.extend(side.take_events()) or got))
    (stored,) = got
    # the daemon has a memory tier: its blocks are loaded from host memory (kvstore.kv_events_media)
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        published[:4], None, PROMPT[: 4 * BS], BS)  # fmt: skip
    # another request's lookup finds the first three stored: already reported, nothing new;
    # evicting blocks 2.. reports those of them it had reported
    other = request("r2", PROMPT[: 3 * BS + 5], block_hashes=vllm_hashes[:3])
    assert side.get_num_new_matched_tokens(other, 0) == (3 * BS, False)
    side.update_state_after_alloc(other, blocks([9, 10, 11, 12]), 3 * BS)
    assert side.take_events() == []
    with KVStoreClient(daemon.address, arena=False) as kv:
        kv.evict(namespace=NS, block_hash=save.hashes[2])  # and its descendants
    got.clear()
    eventually(lambda: bool(got.extend(side.take_events()) or got))
    assert [(type(e), set(e.block_hashes), e.medium) for e in got] == [
        (BlockRemoved, set(published[2:4]), "CPU")
    ]  # leaf first


def test_hits_are_whole_blocks_beyond_the_local_cache_and_leave_a_token(daemon) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)
    store_blocks(daemon.address, hashes[:3])
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=True)
    req = request("r1", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    assert side.get_num_new_matched_tokens(req, BS) == (2 * BS, False)  # vLLM had block 0 itself
    side.update_state_after_alloc(req, blocks([7, 8, 9, 10, 11, 12, 13]), 2 * BS)
    meta = side.build_connector_meta(
        step(new=[("r1", [7, 8, 9, 10, 11, 12, 13], 3 * BS)], scheduled={"r1": 104})
    )
    assert [(ld.hashes, ld.block_ids) for ld in meta.loads] == [(hashes[1:3], [8, 9])]
    # what the store had is not saved again; what it lacked is
    assert [(s.hashes, s.parent_hash) for s in meta.saves] == [(hashes[3:6], hashes[2])]

    exact = request("r2", PROMPT[: 3 * BS])  # every block stored: one must still be computed
    assert side.get_num_new_matched_tokens(exact, 0) == (2 * BS, False)
    side.close()


def test_a_preempted_request_resumes_with_its_new_blocks(daemon) -> None:
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=True)
    req = request("r1", PROMPT)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, blocks([1, 2]), 0)
    side.build_connector_meta(step(new=[("r1", [1, 2], 0)], scheduled={"r1": 64}))
    # preempted; comes back with other paged blocks and recomputes from scratch
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # the save had not landed here
    meta = side.build_connector_meta(
        step(cached=[("r1", [9, 10, 11, 12, 13, 14, 15], 0)], resumed=["r1"], scheduled={"r1": 200})
    )
    want = block_hashes(INFO.hash_root, PROMPT, BS)
    assert [(s.hashes, s.block_ids) for s in meta.saves] == [(want[2:6], [11, 12, 13, 14])]
    side.request_finished(req)
    assert side.build_connector_meta(step(cached=[("r1", None, 200)], scheduled={"r1": 1})).saves == []
    side.close()


def test_a_consumer_never_saves_and_a_producer_never_loads(daemon) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)
    store_blocks(daemon.address, hashes[:2])
    consumer = SchedulerSide(INFO, config(daemon.address), load=True, save=False)
    producer = SchedulerSide(INFO, config(daemon.address), load=False, save=True)
    req = request("r1", PROMPT)
    assert consumer.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    producer.update_state_after_alloc(req, blocks(list(range(1, 8))), 0)
    meta = producer.build_connector_meta(step(new=[("r1", list(range(1, 8)), 0)], scheduled={"r1": 200}))
    assert [s.hashes for s in meta.saves] == [hashes[2:6]]  # the stored prefix is skipped
    consumer.update_state_after_alloc(req, blocks(list(range(1, 8))), 2 * BS)
    assert (
        consumer.build_connector_meta(step(new=[("r1", list(range(1, 8)), 64)], scheduled={"r1": 136})).saves
        == []
    )
    consumer.close()
    producer.close()


def test_a_store_that_is_down_is_a_miss_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        side = SchedulerSide(INFO, config(address, retry_interval=60.0), load=True, save=True)
        with caplog.at_level(logging.WARNING):
            for i in range(5):
                assert side.get_num_new_matched_tokens(request(f"r{i}", PROMPT), 0) == (0, False)
        side.close()
    warnings = [r for r in caplog.records if "failed" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert side.stats.data["lookup_errors"] == 1  # the other four did not even try


# ---- worker side
def make_worker(
    address: str, kv_first: bool = False, save_sync: bool = True, **kw: object
) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A worker over zeroed caches; `kv_first` lays them out [2, blocks, ...] (non-contiguous
    block views: loads go through host tensors instead of straight into the pages)."""
    worker = WorkerSide(
        NS,
        POOL,
        config(address, **kw),
        load=True,
        save=True,
        save_sync=save_sync,
        num_kv_heads=INFO.num_kv_heads,
    )
    if kv_first:
        raw = {name: torch.zeros((2, POOL, BS, 128), dtype=torch.bfloat16) for name in LAYERS}
        worker.register_kv_caches(raw)
        caches = {name: t.movedim(1, 0) for name, t in raw.items()}  # what the worker sees
    else:
        caches = {name: torch.zeros((POOL, 2, BS, 128), dtype=torch.bfloat16) for name in LAYERS}
        worker.register_kv_caches(caches)
    return worker, caches


def run_step(worker: WorkerSide, meta: KVStoreConnectorMetadata, caches: dict[str, torch.Tensor]) -> set[int]:
    """What vLLM does per step: start loads (and reserve the saves ahead), per layer
    wait/compute/save, then finish."""
    worker.open_saves_ahead(meta)
    worker.start_load(meta)
    for name in LAYERS:
        worker.wait_for_layer(name)
        worker.save_layer(meta, name)
    worker.finish_step_saves()
    return worker.block_ids_with_load_errors()


TRANSPORTS = {
    "arena": {},  # the default: KV moves through the daemon's shared-memory arena
    "same-host": {"arena": False},  # loads read the daemon's files
    "grpc": {"arena": False, "local_reads": False},
}


@both_backends
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kv_first", [False, True], ids=["blocks-first", "kv-first"])
def test_saved_blocks_load_back_into_other_paged_blocks_bit_exactly(
    daemon, kv_first: bool, transport: str
) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:4]
    saver, src = make_worker(daemon.address, kv_first, **TRANSPORTS[transport])
    for name in LAYERS:
        src[name].copy_(torch.randn(src[name].shape).to(torch.bfloat16))
    run_step(saver, KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes, [3, 4, 5, 6], b"")]), src)
    saver.wait_for_commits()
    with KVStoreClient(daemon.address, arena=False) as kv:
        assert kv.lookup(NS, hashes) == 4
        got = joined(kv.select(NS, hashes))[LAYERS[1]]
        assert got.view(torch.uint8).equal(src[LAYERS[1]][3:7].view(torch.uint8))
        assert kv.stats()["commits"] == (1 if transport == "arena" else 0)

    loader, dst = make_worker(daemon.address, kv_first, **TRANSPORTS[transport])
    with KVStoreClient(daemon.address, arena=False) as kv:
        before = kv.stats()
    errors = run_step(loader, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [10, 20, 11, 12])]), dst)
    assert errors == set()
    with KVStoreClient(daemon.address, arena=False) as kv:
        after = kv.stats()
    # arena: one pin; same host: the bytes came from the daemon's files; gRPC: from the daemon
    assert after["pins"] - before["pins"] == (1 if transport == "arena" else 0)
    files = transport == "same-host"
    assert (after["bytes_read"] == before["bytes_read"]) == files
    assert (loader.client.local_data_dir is not None) == files
    for name in LAYERS:
        for s, d in zip([3, 4, 5, 6], [10, 20, 11, 12], strict=True):
            assert dst[name][d].view(torch.uint8).equal(src[name][s].view(torch.uint8))
        assert dst[name][0].eq(0).all()
    stats = loader.take_stats()
    assert stats is not None and stats.data["blocks_loaded"] == 4
    saver.close()
    loader.close()


# the worker's two transports (kvstore_connector.transport), whichever it picks
BOTH = pytest.mark.parametrize("transport", ["arena", "grpc"])


@BOTH
def test_a_steps_saves_are_reserved_together_and_one_refused_save_stops_no_other(
    make_daemon, transport: str
) -> None:
    """Several requests saving in one step: through the arena, one ReserveMany and one
    CommitMany for all of them; a save the store refuses (over max_put_bytes) is counted
    as an error, and the others are stored all the same."""
    d = make_daemon(extra_args=["--metrics-port", "0", "--max-put-bytes", "96KiB"])  # 3 blocks of 32 KiB
    prompts = [block_hashes(INFO.hash_root, [t + 100 * k for t in PROMPT], BS) for k in range(3)]
    small, large, other = prompts[0][:2], prompts[1][:5], prompts[2][:3]
    worker, caches = make_worker(d.address, **TRANSPORTS[transport])
    for name in LAYERS:
        caches[name].copy_(torch.randn(caches[name].shape).to(torch.bfloat16))
    before = scrape(d.metrics_url)
    saves = [SaveSpec("a", small, [1, 2], b""), SaveSpec("b", large, [3, 4, 5, 6, 7], b""),
             SaveSpec("c", other, [8, 9, 10], b"")]  # fmt: skip
    run_step(worker, KVStoreConnectorMetadata(saves=saves), caches)
    worker.wait_for_commits()
    after = scrape(d.metrics_url)
    arena = transport == "arena"
    assert calls(after, "ReserveMany") - calls(before, "ReserveMany") == (1 if arena else 0)
    assert calls(after, "CommitMany") - calls(before, "CommitMany") == (1 if arena else 0)
    assert calls(after, "Reserve") == calls(before, "Reserve") and calls(after, "Commit") == calls(
        before, "Commit"
    )
    with KVStoreClient(d.address, arena=False) as kv:
        assert (kv.lookup(NS, small), kv.lookup(NS, large), kv.lookup(NS, other)) == (2, 0, 3)
        got = joined(kv.select(NS, other))[LAYERS[0]]
        assert got.view(torch.uint8).equal(caches[LAYERS[0]][8:11].view(torch.uint8))
    stats = worker.take_stats()
    assert stats is not None and stats.data["save_errors"] == 1 and stats.data["blocks_saved"] == 5
    worker.close()


@BOTH
def test_a_steps_loads_are_pinned_together_and_land_bit_exactly(make_daemon, transport: str) -> None:
    """Several requests loading in one step: through the arena, one PinMany for all of
    them (a miss among them loads nothing and is recomputed), then each copied into its
    own paged blocks."""
    d = make_daemon(extra_args=["--metrics-port", "0"])
    prompts = [block_hashes(INFO.hash_root, [t + 100 * k for t in PROMPT], BS)[:3] for k in range(4)]
    stored = [store_blocks(d.address, hashes, seed=k) for k, hashes in enumerate(prompts[:3])]
    worker, caches = make_worker(d.address, **TRANSPORTS[transport])
    loads = [LoadSpec(f"r{k}", hashes, [1 + 3 * k, 2 + 3 * k, 3 + 3 * k]) for k, hashes in enumerate(prompts)]
    before = scrape(d.metrics_url)
    errors = run_step(worker, KVStoreConnectorMetadata(loads=loads), caches)
    after = scrape(d.metrics_url)
    assert errors == {10, 11, 12}  # the fourth prompt was never stored
    arena = transport == "arena"
    assert calls(after, "PinMany") - calls(before, "PinMany") == (1 if arena else 0)
    assert calls(after, "PinStream") == calls(before, "PinStream") and calls(after, "Pin") == calls(
        before, "Pin"
    )
    for k, layers in enumerate(stored):
        for name in LAYERS:
            got = caches[name][1 + 3 * k : 4 + 3 * k]
            assert got.view(torch.uint8).equal(layers[name].view(torch.uint8))
    stats = worker.take_stats()
    assert stats is not None and stats.data["blocks_loaded"] == 9 and stats.data["load_errors"] == 3
    worker.close()


def test_a_steps_large_loads_each_stream_their_own_pin(make_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads over the together budget are not pinned together: each streams its own pin
    (PinStream), so a cold one's copies overlap its reads."""
    from kvstore_connector import worker as worker_module

    monkeypatch.setattr(worker_module, "_PIN_TOGETHER_BYTES", 1)
    d = make_daemon(extra_args=["--metrics-port", "0"])
    prompts = [block_hashes(INFO.hash_root, [t + 100 * k for t in PROMPT], BS)[:2] for k in range(2)]
    for k, hashes in enumerate(prompts):
        store_blocks(d.address, hashes, seed=k)
    worker, caches = make_worker(d.address)
    with KVStoreClient(d.address, arena=False) as kv:
        pins = kv.stats()["pins"]
        before = scrape(d.metrics_url)
        loads = [LoadSpec(f"r{k}", hashes, [1 + 2 * k, 2 + 2 * k]) for k, hashes in enumerate(prompts)]
        assert run_step(worker, KVStoreConnectorMetadata(loads=loads), caches) == set()
        assert calls(scrape(d.metrics_url), "PinMany") == calls(before, "PinMany")
        assert kv.stats()["pins"] - pins == 2  # a pin each (PinStream: counted when it ends)
    worker.close()


def test_saves_reserved_ahead_are_given_back_when_their_step_saves_no_layer(daemon) -> None:
    """start_load_kv reserves the step's saves ahead; a step that then saves no layer
    (never expected of vLLM) gives the reservations back at its end instead of holding
    arena space until their lease ends, and stores nothing."""
    worker, caches = make_worker(daemon.address)
    hashes = [block_hashes(INFO.hash_root, [t + k for t in PROMPT], BS)[:2] for k in (1, 2)]
    meta = KVStoreConnectorMetadata(
        saves=[SaveSpec("a", hashes[0], [1, 2], b""), SaveSpec("b", hashes[1], [3, 4], b"")]
    )
    worker.open_saves_ahead(meta)
    worker.finish_step_saves()  # no save_layer this step
    worker.wait_for_commits()
    with KVStoreClient(daemon.address, arena=False) as kv:
        assert kv.stats()["reserved_bytes"] == 0
        assert kv.lookup(NS, hashes[0]) == 0 and kv.lookup(NS, hashes[1]) == 0
    run_step(worker, meta, caches)  # the next step saves them, reserved ahead again
    worker.wait_for_commits()
    with KVStoreClient(daemon.address, arena=False) as kv:
        assert kv.lookup(NS, hashes[0]) == 2 and kv.lookup(NS, hashes[1]) == 2
        assert kv.stats()["reserved_bytes"] == 0
    worker.close()


@BOTH
def test_blocks_missing_from_the_store_are_reported_for_recompute(daemon, transport: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    store_blocks(daemon.address, hashes[:2])
    worker, caches = make_worker(daemon.address, **TRANSPORTS[transport])
    errors = run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [1, 2, 3])]), caches)
    assert errors == {3}  # blocks 1 and 2 loaded; the third was not there
    worker.close()


@BOTH
def test_a_dead_store_fails_loads_fast_and_whole(daemon, transport: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    store_blocks(daemon.address, hashes)
    worker, caches = make_worker(daemon.address, **TRANSPORTS[transport])
    daemon.kill()
    meta = KVStoreConnectorMetadata(
        loads=[LoadSpec("r", hashes, [1, 2, 3])], saves=[SaveSpec("s", hashes, [4, 5, 6], b"")]
    )
    assert run_step(worker, meta, caches) == {1, 2, 3}
    stats = worker.take_stats()
    assert stats is not None and stats.data["load_errors"] == 3
    worker.close()


@BOTH
def test_layer_layout_mismatch_is_a_load_error_not_wrong_bytes(daemon, transport: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:2]
    other = {name: torch.ones((2, 4, BS, 64), dtype=torch.bfloat16) for name in LAYERS}  # another shape
    with KVStoreClient(daemon.address) as kv:
        kv.put(NS, hashes, per_head(other))
    worker, caches = make_worker(daemon.address, **TRANSPORTS[transport])
    assert run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [1, 2])]), caches) == {1, 2}
    assert all(c.eq(0).all() for c in caches.values())
    worker.close()


@both_backends
def test_a_corrupt_block_in_the_arena_is_recomputed_and_dropped(daemon, backend: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    saver, src = make_worker(daemon.address)
    for name in LAYERS:
        src[name].copy_(torch.randn(src[name].shape).to(torch.bfloat16))
    run_step(saver, KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes, [1, 2, 3], b"")]), src)
    with KVStoreClient(daemon.address) as kv:
        # written behind first: else write-behind may find the flip before the load does
        eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
        pinned = kv.pin(NS, hashes)
        assert pinned is not None and pinned.num_blocks == 3
        pinned.block_view(1, 1)[100] ^= 0x40  # a stray write into the arena
        pinned.release()
    worker, caches = make_worker(daemon.address)
    errors = run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [4, 5, 6])]), caches)
    assert errors == {4, 5, 6}  # layer 1 failed: the request is recomputed from its first block
    with KVStoreClient(daemon.address) as kv:
        assert kv.stats()["checksum_failures"] == 1  # reported and verified by the daemon
        assert kv.lookup(NS, hashes) == 1
    assert (
        run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r2", hashes[:1], [7])]), caches) == set()
    )
    assert caches[LAYERS[0]][7].view(torch.uint8).equal(src[LAYERS[0]][1].view(torch.uint8))
    saver.close()
    worker.close()


@both_backends
def test_a_corrupt_block_in_the_persistent_tier_fails_its_load_and_is_removed(daemon, backend: str) -> None:
    """Promotion reads without verifying (the loader verifies on its device): the flipped
    byte fails the load, the request is recomputed, and the block reported is verified by
    the daemon and removed; the next load of the prefix before it is whole."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    layers = store_blocks(daemon.address, hashes)  # over gRPC: the persistent tier only
    needle = layers[LAYERS[1]][1].view(torch.uint8).numpy().tobytes()[:64]
    flip_payload_byte(daemon.data_dir, backend, hashes[1], needle)
    worker, caches = make_worker(daemon.address)
    errors = run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [1, 2, 3])]), caches)
    assert errors == {1, 2, 3}  # never wrong bytes: the request is recomputed
    with KVStoreClient(daemon.address) as kv:
        stats = kv.stats()
        assert (stats["checksum_failures"], stats["promoted_blocks"]) == (1, 3)
        assert kv.lookup(NS, hashes) == 1
    assert (
        run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r2", hashes[:1], [4])]), caches) == set()
    )
    assert caches[LAYERS[1]][4].view(torch.uint8).equal(layers[LAYERS[1]][0].view(torch.uint8))
    worker.close()


@both_backends
def test_a_corrupt_block_on_the_same_host_path_is_recomputed_and_dropped(daemon, backend: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    layers = store_blocks(daemon.address, hashes)
    needle = layers[LAYERS[1]][1].view(torch.uint8).numpy().tobytes()[:64]
    flip_payload_byte(daemon.data_dir, backend, hashes[1], needle)
    worker, caches = make_worker(daemon.address, arena=False)
    # the stream stops at the bad layer: the request is recomputed from its first block
    assert run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [1, 2, 3])]), caches) == {
        1,
        2,
        3,
    }
    with KVStoreClient(daemon.address) as kv:
        stats = kv.stats()
        assert stats["checksum_failures"] == 1  # the worker told the daemon, which dropped the block
        assert kv.lookup(NS, hashes) == 1
    # the next load takes the good prefix, still from the files
    assert (
        run_step(worker, KVStoreConnectorMetadata(loads=[LoadSpec("r2", hashes[:1], [7])]), caches) == set()
    )
    assert caches[LAYERS[0]][7].view(torch.uint8).equal(layers[LAYERS[0]][0].view(torch.uint8))
    assert worker.client.local_data_dir is not None
    worker.close()


@BOTH
def test_a_stalled_store_costs_one_deadline_then_recompute(daemon, transport: str) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    store_blocks(daemon.address, hashes)
    worker, caches = make_worker(daemon.address, load_timeout=1.0, save_timeout=1.0, **TRANSPORTS[transport])
    daemon.pause()  # alive and connected, answering nothing
    try:
        meta = KVStoreConnectorMetadata(
            loads=[LoadSpec("r", hashes, [1, 2, 3])], saves=[SaveSpec("s", hashes, [4, 5, 6], b"")]
        )
        errors = run_step(worker, meta, caches)  # returns: each wait is bounded by a deadline
    finally:
        daemon.resume()
    assert errors == {1, 2, 3}
    stats = worker.take_stats()
    assert stats is not None and stats.data["load_errors"] == 3
    worker.close()


@BOTH
@pytest.mark.parametrize("save_sync", [True, False], ids=["sync", "async"])
def test_a_forward_pass_longer_than_save_timeout_still_stores_every_block(
    daemon, save_sync: bool, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """save_timeout_s bounds the store, never the engine: a prefill whose layers take
    several save timeouts to compute (a long prompt on a slow CPU) stores all its blocks,
    logs nothing and leaves the store in service."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:6]
    worker, caches = make_worker(
        daemon.address, save_sync=save_sync, save_timeout=0.3, **TRANSPORTS[transport]
    )
    for name in LAYERS:
        caches[name].copy_(torch.randn(caches[name].shape).to(torch.bfloat16))
    meta = KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes, [1, 2, 3, 4, 5, 6], b"")])
    caplog.set_level(logging.INFO)
    worker.start_load(meta)
    started = time.monotonic()
    for name in LAYERS:
        time.sleep(0.6)  # this layer's compute: twice the save timeout, 4x over the pass
        worker.save_layer(meta, name)
    worker.finish_step_saves()
    worker.wait_for_commits()
    assert time.monotonic() - started > 4 * 0.3
    stats = worker.take_stats()
    assert stats is not None and (stats.data["blocks_saved"], stats.data["save_errors"]) == (6, 0)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert worker.health.available()
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(NS, hashes) == 6
        got = joined(kv.select(NS, hashes))[LAYERS[1]]
        assert got.view(torch.uint8).equal(caches[LAYERS[1]][1:7].view(torch.uint8))
    worker.close()


@BOTH
def test_a_save_the_store_refuses_is_logged_and_leaves_the_store_in_service(
    make_daemon, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A save that fails for a reason of its own (here: larger than the daemon's
    max_put_bytes) says what happened, once, and lookups and saves carry on."""
    block_bytes = len(LAYERS) * 2 * BS * 128 * 2
    daemon = make_daemon(extra_args=["--max-put-bytes", str(3 * block_bytes)])
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:6]
    worker, caches = make_worker(daemon.address, **TRANSPORTS[transport])
    caplog.set_level(logging.INFO)
    too_big = KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes[:4], [1, 2, 3, 4], b"")])
    for _ in range(2):
        run_step(worker, too_big, caches)
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(refusals) == 1 and "CapacityExceeded" in refusals[0] and "max_put_bytes" in refusals[0]
    assert "stays in use" in refusals[0]
    assert worker.health.available()
    run_step(worker, KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes[:2], [1, 2], b"")]), caches)
    stats = worker.take_stats()
    assert stats is not None and (stats.data["save_errors"], stats.data["blocks_saved"]) == (2, 2)
    worker.close()


def test_a_stalled_store_bounds_the_async_save_backlog(daemon, caplog: pytest.LogCaptureFixture) -> None:
    """While the store takes no saves, async saves hold their KV in host memory up to
    save_backlog_mib; saves beyond it are dropped (counted, one warning), and saving
    resumes once the backlog drains."""
    hashes = block_hashes(INFO.hash_root, list(range(2000, 2000 + 10 * BS)), BS)
    block_bytes = len(LAYERS) * 2 * BS * 128 * 2
    worker, caches = make_worker(
        daemon.address,
        save_sync=False,
        save_timeout=120.0,
        save_backlog_mib=4.5 * block_bytes / 2**20,
        arena=False,  # saves through the arena hold no host memory of their own
    )  # room for two saves of two blocks, not three
    for name in LAYERS:
        caches[name].copy_(torch.randn(caches[name].shape).to(torch.bfloat16))

    def saving(i: int) -> KVStoreConnectorMetadata:  # request i: blocks 2i and 2i+1 of the chain
        parent = hashes[2 * i - 1] if i else b""
        return KVStoreConnectorMetadata(
            saves=[SaveSpec(f"r{i}", hashes[2 * i : 2 * i + 2], [2 * i + 1, 2 * i + 2], parent)]
        )

    caplog.set_level(logging.INFO)
    daemon.pause()  # alive and connected, taking nothing
    try:
        for i in range(4):
            run_step(worker, saving(i), caches)  # never waits for the store
        assert worker.backlog.pending == 4 * block_bytes  # saves 0 and 1; 2 and 3 dropped
    finally:
        daemon.resume()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "saves are behind" in warnings[0], warnings
    worker.wait_for_commits()
    assert worker.backlog.pending == 0
    run_step(worker, saving(4), caches)
    worker.wait_for_commits()
    assert "kvstore saves caught up; 2 saves were dropped meanwhile" in caplog.text
    stats = worker.take_stats()
    assert stats is not None
    assert (stats.data["saves"], stats.data["saves_dropped"], stats.data["blocks_saved"]) == (3, 2, 6)
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(NS, hashes) == 4  # requests 0 and 1, then the gap
        assert kv.lookup(NS, hashes[4:8]) == 0
        assert kv.lookup(NS, hashes[8:]) == 2
        stored = joined(kv.select(NS, hashes[8:]))[LAYERS[0]]
        assert stored.view(torch.uint8).equal(caches[LAYERS[0]][9:11].view(torch.uint8))
    worker.close()


def tp_worker(address: str, tp: int, rank: int, **kw: object) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """Rank `rank` of a TP=`tp` engine over zeroed caches: vLLM gives it its KV heads only."""
    worker = WorkerSide(NS, POOL, config(address, **kw), load=True, save=True, save_sync=True,
                        num_kv_heads=INFO.num_kv_heads, tp_size=tp, tp_rank=rank)  # fmt: skip
    heads = max(1, INFO.num_kv_heads // tp)
    caches = {name: torch.zeros((POOL, heads, BS, 128), dtype=torch.bfloat16) for name in LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches


def rank_heads(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s share of a TP=1 cache [blocks, heads, ...] (replicas when tp > heads)."""
    heads = INFO.num_kv_heads
    first = rank * heads // tp if tp <= heads else rank // (tp // heads)
    return full[:, first : first + max(1, heads // tp)]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize(("save_tp", "load_tp"), [(1, 2), (2, 1), (2, 2), (4, 1), (1, 4)])
def test_kv_saved_with_one_tensor_parallelism_loads_bit_exactly_into_another(
    daemon, save_tp: int, load_tp: int, transport: str
) -> None:
    """Each rank saves its KV heads (a partial put: the blocks are visible once all ranks'
    parts are in) and loads only its heads, whatever tp saved them; 4 ranks over 2 heads
    are replicas, and only the first of each pair saves."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:4]
    full = {name: torch.randn((POOL, 2, BS, 128)).to(torch.bfloat16) for name in LAYERS}  # what TP=1 holds
    savers = [tp_worker(daemon.address, save_tp, r, **TRANSPORTS[transport]) for r in range(save_tp)]
    meta = KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes, [3, 4, 5, 6], b"")])
    writers = [r for r in range(save_tp) if save_tp <= 2 or r % 2 == 0]
    for rank, (saver, caches) in enumerate(savers):
        for name in LAYERS:
            caches[name].copy_(rank_heads(full[name], save_tp, rank))
        if rank <= writers[-1]:
            with KVStoreClient(daemon.address) as kv:
                assert kv.lookup(NS, hashes) == 0  # until the last writing rank's part is in
        run_step(saver, meta, caches)
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(NS, hashes) == 4
        got = joined(kv.select(NS, hashes))  # one layout: every head of every layer
        for name in LAYERS:
            assert got[name].view(torch.uint8).equal(full[name][3:7].view(torch.uint8))
        before = kv.stats()
    saved = [s.take_stats() for s, _ in savers]
    for rank, stats in enumerate(saved):  # only the first replica of each head saves
        assert (stats is not None) == (rank in writers)
    block_bytes = 2 * 2 * BS * 128 * 2  # layers x heads x [BS, 128] bf16
    assert sum(s.data["bytes_saved"] for s in saved if s is not None) == 4 * block_bytes

    if transport == "same-host":  # the files have the blocks once the arena wrote them behind
        with KVStoreClient(daemon.address) as kv:
            eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
    loaders = [tp_worker(daemon.address, load_tp, r, **TRANSPORTS[transport]) for r in range(load_tp)]
    load = KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [10, 11, 12, 13])])
    for rank, (loader, caches) in enumerate(loaders):
        assert run_step(loader, load, caches) == set()
        for name in LAYERS:
            want = rank_heads(full[name], load_tp, rank)[3:7]
            assert caches[name][10:14].view(torch.uint8).equal(want.contiguous().view(torch.uint8))
        stats = loader.take_stats()
        assert stats is not None
        # each rank moved only its heads
        share = block_bytes // min(load_tp, INFO.num_kv_heads)
        assert stats.data["bytes_loaded"] == stats.data[f"bytes_loaded_tp{rank}"] == 4 * share
    if transport == "grpc":
        with KVStoreClient(daemon.address) as kv:  # the daemon read each rank's heads only
            assert kv.stats()["bytes_read"] - before["bytes_read"] == 4 * block_bytes * max(1, load_tp // 2)
    for worker, _ in savers + loaders:
        worker.close()


def test_consuming_ranks_each_take_their_heads_and_the_last_frees_the_blocks(daemon) -> None:
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    layers = store_blocks(daemon.address, hashes)
    ranks = [tp_worker(daemon.address, 2, r, consume=True) for r in range(2)]
    load = KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [1, 2, 3])])
    assert run_step(ranks[0][0], load, ranks[0][1]) == set()
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(NS, hashes) == 3  # rank 1's heads are still to be taken
    assert run_step(ranks[1][0], load, ranks[1][1]) == set()
    for rank, (_, caches) in enumerate(ranks):
        for name in LAYERS:
            assert caches[name][1:4, 0].view(torch.uint8).equal(layers[name][:, rank].view(torch.uint8))
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(NS, hashes) == 0 and kv.stats()["blocks"] == 0
    for worker, _ in ranks:
        worker.close()


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_compressed_kv_moves_and_is_stored_at_half_size_within_its_error_bound(
    daemon, transport: str, codec: str
) -> None:
    info = NamespaceInfo(
        "test-model", "bfloat16", BS, 2, 64, False, "cpu", tp_size=1, pp_size=1, compression=codec
    )
    namespace = info.namespace(0)
    assert namespace != NS and namespace.endswith(f"|{codec}|pp0of1".encode())  # never mixed with raw KV

    def worker() -> tuple[WorkerSide, dict[str, torch.Tensor]]:
        w = WorkerSide(namespace, POOL, config(daemon.address, **TRANSPORTS[transport]), load=True, save=True,
                       save_sync=True, num_kv_heads=2, compression=codec)  # fmt: skip
        caches = {name: torch.zeros((POOL, 2, BS, 128), dtype=torch.bfloat16) for name in LAYERS}
        w.register_kv_caches(caches)
        return w, caches

    hashes = block_hashes(info.hash_root, PROMPT, BS)[:4]
    saver, src = worker()
    for name in LAYERS:
        src[name].copy_(torch.randn(src[name].shape).to(torch.bfloat16) * 3)
    run_step(saver, KVStoreConnectorMetadata(saves=[SaveSpec("r", hashes, [3, 4, 5, 6], b"")]), src)
    raw_bytes = 4 * len(LAYERS) * 2 * BS * 128 * 2
    with KVStoreClient(daemon.address) as kv:
        assert kv.lookup(namespace, hashes) == 4 and kv.lookup(NS, hashes) == 0
        stored = kv.stats()["bytes_used"]
    assert stored == 4 * len(LAYERS) * 2 * (4 + BS * 128)  # one byte per value and a scale per row
    assert stored / raw_bytes < 0.51
    loader, dst = worker()
    assert (
        run_step(loader, KVStoreConnectorMetadata(loads=[LoadSpec("r", hashes, [10, 11, 12, 13])]), dst)
        == set()
    )
    for name in LAYERS:
        want = src[name][3:7].float()
        got = dst[name][10:14].float()
        amax = want.abs().amax(dim=(2, 3), keepdim=True)  # per block and head: one scale each
        step = amax * 2**-4 if codec == "fp8" else amax / 127 / 2
        assert ((got - want).abs() <= step + want.abs() * 2**-8 + 1e-6).all()  # + bf16's rounding
        assert not got.equal(want)  # lossy: what was loaded is the dequantized KV
    stats = loader.take_stats()
    assert stats is not None and stats.data["bytes_loaded"] == stored  # the packed bytes moved
    for w in (saver, loader):
        w.close()


def test_hits_that_would_load_slower_than_recompute_are_left_to_recompute(daemon) -> None:
    """A hit never loses to recompute: with the daemon's measured persistent-tier rate,
    an engine that recomputes a block faster than that tier loads it takes the blocks in
    memory and leaves the rest of the prefix to recompute (counted as declined)."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)  # 6 full blocks
    g = torch.Generator().manual_seed(5)
    layers = {name: torch.randn((5, 2, BS, 128), generator=g).to(torch.bfloat16) for name in LAYERS}
    stored = per_head(layers)
    other = block_hashes(INFO.hash_root, list(range(5000, 5000 + 4 * BS)), BS)
    store_blocks(daemon.address, other, seed=1)
    with KVStoreClient(daemon.address) as kv:
        pinned = kv.pin(NS, other)  # a promotion: the daemon measures its persistent tier's rate
        assert pinned is not None and pinned.num_blocks == 4
        pinned.release()
        kv.put(NS, hashes[:2], {n: t[:2].contiguous() for n, t in stored.items()})  # the memory tier
    with KVStoreClient(daemon.address, arena=False) as kv:  # the persistent tier only
        kv.put(NS, hashes[2:5], {n: t[2:5].contiguous() for n, t in stored.items()}, parent_hash=hashes[1])
        where = kv.where(NS, hashes)
    assert (where.num_blocks, list(where.tiers)) == (5, [0, 0, 1, 1, 1])
    assert where.persistent_read_rate > 0
    info = dataclasses.replace(INFO, num_layers=len(LAYERS))
    block_bytes = info.block_bytes()
    assert block_bytes == len(LAYERS) * 2 * BS * 128 * 2  # what per_head stores of a block
    # recompute a block in a time between a memory load and a persistent-tier load of it
    memory_s, persistent_s = block_bytes / HOT_LOAD_RATE, block_bytes / where.persistent_read_rate
    assert memory_s < persistent_s
    rate = BS / (memory_s * persistent_s) ** 0.5
    side = SchedulerSide(info, config(daemon.address, recompute_tokens_per_s=rate), load=True, save=False)
    assert side.get_num_new_matched_tokens(request("r1", PROMPT), 0) == (2 * BS, False)
    assert side.stats.data["blocks_declined"] == 3
    always = SchedulerSide(info, config(daemon.address, recompute_tokens_per_s=0), load=True, save=False)
    assert always.get_num_new_matched_tokens(request("r2", PROMPT), 0) == (5 * BS, False)
    assert always.stats.data["blocks_declined"] == 0


def test_a_lookup_reads_ahead_what_only_the_persistent_tier_holds_where_loading_it_pays(daemon) -> None:
    """The scheduler side's lookup asks the daemon to read the hit's blocks that only the
    persistent tier holds into memory (its workers load them a step later); a side that
    recomputes a block faster than that tier, at the rate the daemon reported, asks for
    none."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)
    store_blocks(daemon.address, hashes[:4])  # over gRPC: the persistent tier only
    side = SchedulerSide(INFO, config(daemon.address, recompute_tokens_per_s=0), load=True, save=False)
    with KVStoreClient(daemon.address, arena=False) as kv:
        assert kv.stats()["memory_blocks"] == 0
        assert side.get_num_new_matched_tokens(request("r1", PROMPT), BS) == (3 * BS, False)
        assert side.stats.data["blocks_prefetched"] == 3  # blocks 1..3: vLLM had block 0
        eventually(lambda: kv.stats()["memory_blocks"] == 3)  # with no load asked yet
        assert kv.stats()["prefetched_blocks"] == 3
        rate = kv.where(NS, hashes).persistent_read_rate
        assert rate > 0  # measured on the prefetch
        # an engine that recomputes a block faster than the persistent tier reads it, and
        # slower than the memory tier does (the side weighs block bytes: the layer count)
        info = dataclasses.replace(INFO, num_layers=len(LAYERS))
        memory_s, persistent_s = info.block_bytes() / HOT_LOAD_RATE, info.block_bytes() / rate
        tokens_per_s = BS / (memory_s * persistent_s) ** 0.5
        fast = SchedulerSide(
            info, config(daemon.address, recompute_tokens_per_s=tokens_per_s), load=True, save=False
        )
        assert fast.get_num_new_matched_tokens(request("f1", PROMPT), BS) == (3 * BS, False)  # in memory now
        store_blocks(daemon.address, hashes[4:6], seed=1)  # again the persistent tier only
        fast.get_num_new_matched_tokens(request("f2", PROMPT), 4 * BS)
        assert fast.stats.data["blocks_prefetched"] == 0 and kv.stats()["prefetched_blocks"] == 3
        fast.close()
    side.close()


# ---- leases: the scheduler side's lookup pins what the workers then load
def saved_by_a_worker(address: str, hashes: list[bytes]) -> dict[str, torch.Tensor]:
    """Save `hashes` through the arena (they stay in the memory tier): what TP=1 held."""
    saver, src = make_worker(address)
    for name in LAYERS:
        src[name].copy_(torch.randn(src[name].shape).to(torch.bfloat16))
    ids = list(range(1, 1 + len(hashes)))
    run_step(saver, KVStoreConnectorMetadata(saves=[SaveSpec("s", hashes, ids, b"")]), src)
    saver.wait_for_commits()
    saver.close()
    return {name: src[name][ids].clone() for name in LAYERS}


@pytest.mark.parametrize("tp", [1, 2])
def test_a_lookups_lease_is_the_loads_pin_and_each_rank_gives_back_its_share(make_daemon, tp: int) -> None:
    """The scheduler's lookup leases the hit beyond vLLM's own cache; every rank loads its
    heads from the lease with no Pin call of its own, bit-exact, and the pin ends with
    the last rank's release."""
    d = make_daemon(extra_args=["--metrics-port", "0"])
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:4]
    full = saved_by_a_worker(d.address, hashes)
    side = SchedulerSide(dataclasses.replace(INFO, tp_size=tp), config(d.address), load=True, save=False)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, BS) == (3 * BS, False)  # vLLM had block 0
    side.update_state_after_alloc(req, blocks([5, 6, 7, 8, 9, 10, 11]), 3 * BS)
    meta = side.build_connector_meta(step())
    (load,) = meta.loads
    assert load.lease is not None and load.lease.num_blocks == 3 and load.block_ids == [6, 7, 8]
    ranks = [tp_worker(d.address, tp, r) for r in range(tp)]
    with KVStoreClient(d.address, arena=False) as kv:
        before = scrape(d.metrics_url)
        for rank, (worker, caches) in enumerate(ranks):
            assert kv.stats()["pinned_bytes"] > 0  # held for this rank (and those after it)
            assert run_step(worker, meta, caches) == set()
            for name in LAYERS:
                want = rank_heads(full[name], tp, rank)[1:4]
                assert caches[name][6:9].view(torch.uint8).equal(want.contiguous().view(torch.uint8))
            stats = worker.take_stats()
            assert stats is not None and stats.data["leased_loads"] == 1 and stats.data["blocks_loaded"] == 3
        after = scrape(d.metrics_url)
        for method in ("Pin", "PinMany", "PinStream"):
            assert calls(after, method) == calls(before, method)
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)  # the last rank's release ended it
    for worker, _ in ranks:
        worker.close()
    side.close()


def test_a_lease_that_is_not_loaded_goes_back(daemon) -> None:
    """Leases the scheduler side does not hand on are given back: a lookup asked again
    (the request waited for blocks), no blocks allocated, a request finished, and a
    worker whose loads go over gRPC gives back its share."""
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:4]
    saved_by_a_worker(daemon.address, hashes)
    side = SchedulerSide(INFO, config(daemon.address), load=True, save=False)
    with KVStoreClient(daemon.address, arena=False) as kv:
        req = request("r", PROMPT)
        assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
        held = kv.stats()["pins"]
        assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, False)  # asked again: leased afresh
        assert kv.stats()["pins"] == held + 1
        side.update_state_after_alloc(req, blocks([]), 0)  # no room: nothing loads
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)

        side.get_num_new_matched_tokens(req, 0)
        assert kv.stats()["pinned_bytes"] > 0
        side.request_finished(req)
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)

        other = request("o", PROMPT)
        side.get_num_new_matched_tokens(other, 0)
        side.update_state_after_alloc(other, blocks([1, 2, 3, 4, 5, 6, 7]), 4 * BS)
        meta = side.build_connector_meta(step())
        assert meta.loads[0].lease is not None
        worker, caches = make_worker(daemon.address, **TRANSPORTS["grpc"])
        assert run_step(worker, meta, caches) == set()  # loaded over gRPC
        eventually(lambda: kv.stats()["pinned_bytes"] == 0)
        worker.close()
    side.close()


def test_without_an_arena_lookups_take_no_lease(make_daemon) -> None:
    d = make_daemon(extra_args=["--memory", "0"])
    hashes = block_hashes(INFO.hash_root, PROMPT, BS)[:3]
    store_blocks(d.address, hashes)
    side = SchedulerSide(INFO, config(d.address), load=True, save=False)
    req = request("r", PROMPT)
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    side.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5, 6, 7]), 3 * BS)
    (load,) = side.build_connector_meta(step()).loads
    assert load.lease is None and load.hashes == hashes
    side.close()

"""The connector's pure parts: config, namespaces, stats, block movement (CPU)."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

import pytest
import torch
from kvstore_connector.config import ConnectorConfig, NamespaceInfo, role_summary
from kvstore_connector.hitlog import HitLog
from kvstore_connector.stats import KVStoreConnectorStats
from kvstore_connector.transfer import BlockMover, find_block_dim, index_select

from kvstore_client.hashing import connector_hash_root


# ---- config
def test_extra_config_maps_documented_keys() -> None:
    config = ConnectorConfig.from_extra_config(
        {"kvstore_address": "store:50051", "consume": True, "lookup_timeout_s": 0.2, "save_mode": "sync"}
    )
    assert (config.address, config.consume, config.lookup_timeout, config.save_mode) == (
        "store:50051",
        True,
        0.2,
        "sync",
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvstore_adress": "x:1"}, "unknown key 'kvstore_adress'"),
        ({"save_mode": "later"}, "save_mode"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s must be a positive number of seconds, not 0"),
        ({"load_timeout_s": "fast"}, "load_timeout_s must be"),
        ({"retry_interval_s": -1}, "retry_interval_s must be"),
        ({"consume": "yes"}, "consume"),
        ({"kvstore_address": "nohostport"}, "HOST:PORT"),
        ({"local_reads": "on"}, "local_reads"),
        ({"local_data_dir": 7}, "local_data_dir"),
        ({"save_backlog_mib": 0}, "save_backlog_mib"),
        ({"save_backlog_mib": "1GiB"}, "save_backlog_mib"),
        ({"save_backlog_mib": True}, "save_backlog_mib"),
        ({"compression": "zstd"}, "compression"),
        ({"compression": None}, "compression"),
    ],
)
def test_bad_extra_config_is_refused_with_its_name(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_every_problem_of_the_extra_config_is_told_at_once_under_the_keys_users_write() -> None:
    with pytest.raises(ValueError) as caught:
        ConnectorConfig.from_extra_config(
            {"kvstore_adress": "x:1", "lookup_timeout_s": 0, "save_mode": "later", "colour": 1}
        )
    message = str(caught.value)
    assert message.startswith("kv_connector_extra_config: ")
    assert "unknown key 'kvstore_adress' (did you mean 'kvstore_address'?)" in message
    assert "unknown key 'colour';" in message  # nothing close: no guess
    assert "lookup_timeout_s must be a positive number of seconds, not 0" in message
    assert "save_mode must be 'sync' or 'async', not 'later'" in message
    assert message.endswith("(known keys: arena, compression, consume, kvstore_address, load_timeout_s, "
                            "local_data_dir, local_reads, lookup_timeout_s, namespace, recompute_tokens_per_s, "
                            "retry_interval_s, "
                            "save_backlog_mib, save_decode, save_mode, save_timeout_s, tls_ca, tls_cert, tls_key, "
                            "token_env, tune_malloc)")  # fmt: skip
    # no chained exception: the message is the whole story
    assert caught.value.__cause__ is None and caught.value.__context__ is None


@pytest.mark.parametrize(
    ("role", "extra", "summary"),
    [
        ("kv_producer", {}, "loads nothing, saves sync"),
        ("kv_consumer", {}, "loads, saves nothing"),
        ("kv_consumer", {"consume": True}, "loads (consume: DropSelect), saves nothing"),
        (
            "kv_consumer",
            {"save_mode": "async"},
            "loads, saves nothing (save_mode and save_decode do not apply)",
        ),
        ("kv_both", {}, "loads, saves async"),
        ("kv_both", {"save_mode": "sync"}, "loads, saves sync"),
    ],
)
def test_the_start_up_line_says_what_the_role_does(role: str, extra: dict, summary: str) -> None:
    assert role_summary(role, ConnectorConfig.from_extra_config(extra)) == summary


def test_a_bad_extra_config_is_logged_once_before_the_engine_reports_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvstore_connector.connector import KVStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    transfer = SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={"kvstore_adress": "x:1"})
    vllm_config = SimpleNamespace(kv_transfer_config=transfer)
    with pytest.raises(ValueError, match="did you mean 'kvstore_address'") as caught:
        KVStoreConnector(vllm_config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [f"KVStoreConnector cannot start: {caught.value}"]
    assert caught.value.__context__ is None


def test_the_connectors_vllm_034_declarations() -> None:
    from kvstore_connector.connector import KVStoreConnector

    # never an asynchronous load, never a hand-off that reads freed blocks; sleep mode is fine;
    # no lookahead hashing; our layer hooks must run at every step (no full CUDA graphs)
    flagged = SimpleNamespace(kv_transfer_params={"do_remote_prefill": True})  # by a P/D proxy
    assert KVStoreConnector.may_load_async(None, flagged) is False  # type: ignore[arg-type]
    assert KVStoreConnector.requires_kv_delivery.fget(None) is False  # type: ignore[attr-defined]
    assert KVStoreConnector.supports_sleep_mode(None) is True  # type: ignore[arg-type]
    assert KVStoreConnector.supports_lookahead_block_hashes(None) is False  # type: ignore[arg-type]
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is True


def test_consume_hand_offs_never_take_the_same_host_path() -> None:
    # DropSelect removes what it hands out: only the daemon can do that
    assert ConnectorConfig.from_extra_config({}).client_options()["local_reads"] is True
    options = ConnectorConfig.from_extra_config(
        {"consume": True, "local_data_dir": "/mnt/kv"}
    ).client_options()
    assert options["local_reads"] is False and options["local_data_dir"] == "/mnt/kv"
    assert ConnectorConfig.from_extra_config({"local_reads": False}).client_options()["local_reads"] is False


def _info(**overrides: object) -> NamespaceInfo:
    values = dict(
        model="/models/llama",
        kv_dtype="bfloat16",
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        mla=False,
        device="cuda",
        tp_size=2,
        pp_size=1,
    )
    values.update(overrides)
    return NamespaceInfo(**values)  # type: ignore[arg-type]


def test_every_tensor_parallel_rank_shares_one_namespace_per_pipeline_stage() -> None:
    info = _info(pp_size=2)
    assert info.all_namespaces() == [info.namespace(0), info.namespace(1)]
    assert len(set(info.all_namespaces())) == 2
    for ns in info.all_namespaces():
        assert ns.decode().startswith(info.hash_root + "|pp")
        assert b"|tp" not in ns
    # the tensor parallelism is not part of it: TP=1 and TP=2 engines share blocks
    assert _info(tp_size=1).all_namespaces() == _info(tp_size=4).all_namespaces()
    # the layout changed from kvc1 (one rank's heads per layer): the old blocks stay apart
    assert info.hash_root.startswith("kvc2|")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"kv_dtype": "float8_e4m3fn"},
        {"block_size": 32},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"mla": True},
        {"device": "cpu"},
    ],
)
def test_what_makes_kv_incompatible_changes_the_namespace(change: dict) -> None:
    assert _info(**change).hash_root != _info().hash_root
    assert _info(**change).namespace(0) != _info().namespace(0)


def test_long_model_names_keep_namespaces_within_the_store_limit() -> None:
    info = _info(model="/very/long/path/" + "x" * 400)
    assert len(info.namespace(0)) <= 256
    assert _info(model="/very/long/path/" + "y" * 400).hash_root != info.hash_root


def _vllm_config(cache_dtype: str) -> SimpleNamespace:
    model = SimpleNamespace(model="/m", dtype=torch.bfloat16, use_mla=False,
                            get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 128)  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1),
    )


def test_compressed_kv_lives_apart_under_the_same_hash_root() -> None:
    raw, fp8, int8 = _info(), _info(compression="fp8"), _info(compression="int8")
    assert len({raw.namespace(0), fp8.namespace(0), int8.namespace(0)}) == 3
    assert raw.hash_root == fp8.hash_root == int8.hash_root  # the same prompts, the same hashes
    for info in (raw, fp8, int8):
        assert connector_hash_root(info.namespace(0)) == raw.hash_root.encode()


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_that_is_fp8_in_the_engine_is_never_quantized_again(cache_dtype: str) -> None:
    info = NamespaceInfo.from_vllm(_vllm_config(cache_dtype), None, "fp8")  # type: ignore[arg-type]
    assert info.compression == "none" and info.kv_dtype == cache_dtype
    assert NamespaceInfo.from_vllm(_vllm_config("auto"), None, "fp8").compression == "fp8"  # type: ignore[arg-type]


# ---- stats
def test_stats_aggregate_reduce_and_travel_between_processes() -> None:
    a, b = KVStoreConnectorStats(), KVStoreConnectorStats()
    assert a.is_empty() and a.take() is None
    a.add(blocks_loaded=3, bytes_loaded=3_000_000_000, load_seconds=2.0)
    b.add(blocks_loaded=1, bytes_loaded=1_000_000_000, load_seconds=2.0, load_errors=2)
    merged = pickle.loads(pickle.dumps(a)).aggregate(b)
    summary = merged.reduce()
    assert summary["Blocks loaded"] == 4
    assert summary["Load GB/s"] == 1.0
    assert summary["Load errors (blocks)"] == 2
    rank1, again = KVStoreConnectorStats(), KVStoreConnectorStats()
    rank1.add(bytes_loaded=5, bytes_loaded_tp1=5)  # a rank's own bytes, summed over its intervals
    again.add(bytes_loaded=7, bytes_loaded_tp1=7)
    assert rank1.aggregate(again).reduce()["Bytes loaded (tp1)"] == 12
    taken = merged.take()
    assert taken is not None and taken.data["blocks_loaded"] == 4
    assert merged.is_empty()


# ---- the hit log
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_hit_is_one_info_line_in_the_engines_log(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.hitlog")
    caplog.set_level(logging.INFO, logger="test.hitlog")
    hits = HitLog(log, clock=Clock())
    hits.hit("r1", 480, 512, 15)
    hits.hit("r2", 64, 100, 2, local_tokens=32)
    hits.flush(force=True)  # nothing beyond the burst: no summary
    assert [r.getMessage() for r in caplog.records] == [
        "kvstore: request r1: 480 of 512 prompt tokens loaded from kvstore (15 blocks)",
        "kvstore: request r2: 64 of 100 prompt tokens loaded from kvstore (2 blocks, after 32 in vLLM's prefix cache)",
    ]


def test_a_busy_interval_logs_a_few_lines_then_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.hitlog")
    caplog.set_level(logging.DEBUG, logger="test.hitlog")
    clock = Clock()
    hits = HitLog(log, interval_s=10.0, burst=2, clock=clock)
    for i in range(5):
        hits.hit(f"r{i}", 64, 100, 2)
    hits.flush()  # a step within the interval: nothing yet
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 2 and all("request r" in m for m in info)
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 3  # each request still told
    clock.now += 12
    hits.flush()  # the first step after the interval
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info[2:] == [
        "kvstore: 3 more requests: 192 of 300 prompt tokens loaded from kvstore (6 blocks) in the last 12 s"
    ]
    hits.hit("r9", 32, 40, 1)  # a new interval: per-request lines again
    assert caplog.records[-1].levelno == logging.INFO and "request r9" in caplog.records[-1].getMessage()


# ---- block movement
def test_block_dim_is_found_not_assumed() -> None:
    blocks = 10
    standard = torch.arange(blocks * 2 * 4 * 8).reshape(blocks, 2, 4, 8)
    assert find_block_dim(standard, blocks) is standard
    kv_first = torch.zeros(2, blocks, 4, 8)  # older [2, num_blocks, ...] layouts
    view = find_block_dim(kv_first, blocks)
    assert view.shape == (blocks, 2, 4, 8)
    view[3].fill_(1.0)
    assert kv_first[:, 3].eq(1.0).all()  # a view, not a copy
    split = torch.zeros(blocks * 2, 4, 8)  # kernel blocks: 2 per manager block
    assert find_block_dim(split, blocks).shape == (blocks, 2, 4, 8)
    with pytest.raises(ValueError, match="indexes its 10 blocks"):
        find_block_dim(torch.zeros(7, 3), blocks)


def test_gather_then_scatter_restores_exact_blocks_on_cpu() -> None:
    mover = BlockMover(torch.device("cpu"))
    cache = torch.randn(16, 2, 32, 8).to(torch.bfloat16)
    ids = mover.index([5, 1, 9])
    copy = mover.gather(cache, ids).wait()
    assert copy.shape == (3, 2, 32, 8) and copy.is_contiguous()
    target = torch.zeros_like(cache)
    assert mover.scatter(target, ids, copy) is None  # CPU: done on return
    for block in (5, 1, 9):
        assert torch.equal(target[block].view(torch.uint8), cache[block].view(torch.uint8))
    assert target[0].eq(0).all()


@pytest.mark.parametrize("codec", [None, "fp8"])
def test_a_ranks_heads_gathered_on_cpu_are_the_heads_of_each_block(codec: str | None) -> None:
    from kvstore_connector.compression import make_codec

    mover = BlockMover(torch.device("cpu"), make_codec(codec) if codec else None)
    cache = torch.randn(16, 4, 32, 8).to(torch.bfloat16)  # [num_blocks, heads, block_size, C]
    ids = mover.index([5, 1, 9])
    heads = cache[:, 1:3].transpose(0, 1)  # a rank's two heads, as save_layer passes its heads' view
    want = torch.stack([cache[[5, 1, 9], h] for h in (1, 2)])
    assert torch.equal(index_select(heads, 1, ids), want)
    if codec is None:
        dest = torch.empty(2, 3, 32, 8, dtype=torch.bfloat16)
        mover.gather_into(heads, ids, dest, dim=1).wait()
        assert torch.equal(dest.view(torch.uint8), want.view(torch.uint8))
    else:
        assert mover.codec is not None
        rows = want.flatten(0, 1)
        dest = torch.empty(2, 3, mover.codec.stored_shape(rows.shape[1:])[-1], dtype=torch.uint8)
        mover.gather_into(heads, ids, dest, dim=1).wait()
        assert torch.equal(dest.view(6, -1), mover.codec.encode(rows))
    with pytest.raises(ValueError, match="only 0 and 1"):
        index_select(cache, 2, ids)


def test_load_spec_types_are_plain_data() -> None:
    # metadata crosses vLLM's scheduler -> worker boundary: it must pickle
    from kvstore_connector.metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec

    meta = KVStoreConnectorMetadata(
        loads=[LoadSpec("r", [b"h" * 32], [3])], saves=[SaveSpec("r", [], [], b"")]
    )
    assert pickle.loads(pickle.dumps(meta)) == meta

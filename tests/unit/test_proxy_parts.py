"""kvstore-proxy's parts that need no server: instance URLs, scheduling policies, the
connector namespace it hashes under, and what a prefill request keeps."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the [proxy] extra; scripts/test.sh installs it

from kvstore_connector.config import NamespaceInfo  # noqa: E402

from kvstore_client.hashing import block_hashes  # noqa: E402
from kvstore_proxy.app import prefill_request  # noqa: E402
from kvstore_proxy.instances import Instance, LeastBusy, Pool, RoundRobin, normalize_url  # noqa: E402
from kvstore_proxy.store import StoreTarget  # noqa: E402


@pytest.mark.parametrize(
    ("given", "url"),
    [("10.0.0.5:8100", "http://10.0.0.5:8100"), ("http://d1:8200/", "http://d1:8200"),
     ("https://d1", "https://d1")],
)  # fmt: skip
def test_instances_are_urls(given: str, url: str) -> None:
    assert normalize_url(given) == url


@pytest.mark.parametrize("bad", ["", "  ", "ftp://x:1", "http://", "http://h:1/v1/completions"])
def test_what_is_not_an_instance_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT|empty"):
        normalize_url(bad)


def test_round_robin_turns_and_a_pool_prefers_healthy_instances() -> None:
    pool = Pool("decode", RoundRobin())
    a, b, c = (pool.add(u) for u in ("http://a:1", "http://b:1", "http://c:1"))
    firsts = [pool.order({})[0].url for _ in range(4)]
    assert firsts == ["http://a:1", "http://b:1", "http://c:1", "http://a:1"]
    assert pool.add("http://a:1") is a and len(pool.instances) == 3  # added once
    b.healthy = False
    assert all(b not in pool.order({}) for _ in range(3))
    a.healthy = c.healthy = False
    assert set(pool.order({})) == {a, b, c}  # none healthy: try them all, one may be back
    assert pool.remove("http://b:1") and not pool.remove("http://b:1")


def test_least_busy_takes_the_fewest_in_flight() -> None:
    instances = [Instance("http://a:1", "prefill", in_flight=3), Instance("http://b:1", "prefill", in_flight=1),
                 Instance("http://c:1", "prefill", in_flight=2)]  # fmt: skip
    assert [i.url for i in LeastBusy().order(instances, {})] == ["http://b:1", "http://c:1", "http://a:1"]


def test_the_namespace_target_hashes_as_the_connector_does() -> None:
    info = NamespaceInfo("org/model", "bfloat16", 16, 8, 128, False, "cuda", tp_size=2, pp_size=1)
    target = StoreTarget(info.namespace(0).decode())
    assert target.root == info.hash_root and target.block_size == 16
    assert target.lookup_namespace == info.namespace(0).decode()
    tokens = list(range(40))
    assert block_hashes(target.root, tokens, target.block_size) == block_hashes(info.hash_root, tokens, 16)
    # the root alone stands for PP=1 (the tensor parallelism is not part of a namespace)
    assert StoreTarget(info.hash_root).lookup_namespace == info.hash_root + "|pp0of1"


@pytest.mark.parametrize("bad", ["", "my-model", "kvc1|m|bfloat16|bsx|kvh2", "kvc1|m|bs0|x"])
def test_a_namespace_that_is_not_the_connectors_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="connector namespace"):
        StoreTarget(bad)


def test_a_prefill_request_makes_one_token_and_streams_nothing() -> None:
    body = {"model": "m", "prompt": "t1", "max_tokens": 64, "stream": True, "stream_options": {}, "n": 3,
            "min_tokens": 4, "temperature": 0.5}  # fmt: skip
    assert prefill_request(body, chat=False) == {"model": "m", "prompt": "t1", "max_tokens": 1, "n": 1,
                                                 "temperature": 0.5}  # fmt: skip
    assert prefill_request(body, chat=True)["max_completion_tokens"] == 1
    assert body["max_tokens"] == 64  # the client's request is left as it was


def test_the_store_address_defaults_to_the_daemons_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstore_proxy import main as proxy_main

    class Dialled(Exception):
        pass

    def client(address: str, **_: object) -> None:
        raise Dialled(address)

    async def every_instance_serves(model: str, urls: list[str]) -> list[str]:
        return []

    monkeypatch.setattr(proxy_main, "_check_all", every_instance_serves)
    monkeypatch.setattr(proxy_main, "KVStoreClient", client)
    namespace = "kvc2|m|bfloat16|bs16|kvh4|hd128|mha|cuda|pp0of1"
    argv = ["--model", "m", "--prefill", "p:1", "--decode", "d:2", "--kv-namespace", namespace]
    with pytest.raises(Dialled, match="^localhost:50051$"):
        proxy_main.main([*argv, "--store", "localhost"])
    with pytest.raises(SystemExit) as info:
        proxy_main.main([*argv, "--store", "localhost:http"])
    assert info.value.code == 2
    assert "--store: invalid address 'localhost:http': the port must be a number" in capsys.readouterr().err

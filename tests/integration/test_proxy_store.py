"""The proxy's view of the store (kvstore_proxy.store.StoreView) against a real server:
a late answer prefills that one request; only several in a row, or a store that is not
there, take the store out of the proxy's plans for a while."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from kvstore_connector.config import NamespaceInfo
from support.inproc import InProcServer
from support.ports import free_port

from kvstore_client import KVStoreClient
from kvstore_client.hashing import block_hashes
from kvstore_proxy.store import StoreTarget, StoreView

INFO = NamespaceInfo("org/model", "bfloat16", 16, 2, 8, False, "cpu", tp_size=1, pp_size=1)
TOKENS = list(range(100, 150))  # three full blocks of 16 and two tokens


@pytest.fixture
def mute() -> Iterator[KVStoreClient]:
    """A client of a port that takes connections and never answers (as a stopped daemon's
    does): every call misses its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with KVStoreClient(f"127.0.0.1:{listener.getsockname()[1]}", arena=False, local_reads=False) as kv:
            yield kv


def stored_view(server: InProcServer, **view: float) -> StoreView:
    target = StoreTarget(INFO.namespace(0).decode())
    hashes = block_hashes(target.root, TOKENS, target.block_size)
    with KVStoreClient(server.address, arena=False) as kv:
        kv.put(target.lookup_namespace, hashes, {"k": torch.ones(len(hashes), 64, dtype=torch.uint8)})
    return StoreView(KVStoreClient(server.address, arena=False, local_reads=False), target, **view)


def test_a_late_answer_prefills_one_request_and_several_in_a_row_take_the_store_out(
    server: InProcServer, mute: KVStoreClient
) -> None:
    view = stored_view(server, timeout_s=0.2, retry_s=60.0, slow_limit=3)
    answers = view.client
    try:
        assert view.connect(timeout_s=5.0)
        assert view.held_tokens(TOKENS) == 48
        view.client = mute  # the store stops answering in time
        assert view.held_tokens(TOKENS) is None
        assert view.held_tokens(TOKENS) is None
        assert view.up and view.timeouts == 2 and view.errors == 0
        view.client = answers  # an answer in time resets the count
        assert view.held_tokens(TOKENS) == 48
        view.client = mute
        for _ in range(3):
            assert view.held_tokens(TOKENS) is None
        assert not view.up and view.timeouts == 5 and view.errors == 1
        view.client = answers
        assert view.held_tokens(TOKENS) is None  # out for retry_s: not asked
        assert view.timeouts == 5
    finally:
        answers.close()


def test_a_store_that_is_not_there_is_out_at_once() -> None:
    target = StoreTarget(INFO.namespace(0).decode())
    view = StoreView(
        KVStoreClient(f"127.0.0.1:{free_port()}", arena=False), target, timeout_s=5.0, retry_s=60.0
    )
    try:
        assert not view.connect(timeout_s=1.0)
        assert view.held_tokens(TOKENS) is None
        assert not view.up and view.errors == 1 and view.timeouts == 0
    finally:
        view.close()

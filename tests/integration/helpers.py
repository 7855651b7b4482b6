"""Shared helpers of the integration suite: keys, tensors, comparisons, raw gRPC."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from support.hashes import NS, chain

from kvstore.service import SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, errors


def make_layers(
    n: int,
    *,
    num_layers: int = 2,
    shape: tuple[int, ...] = (2, 4, 8),
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """{layer.i: [n, *shape]} of random bit patterns (NaNs and all), deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    elsize = torch.empty((), dtype=dtype).element_size()
    out = {}
    for i in range(num_layers):
        raw = torch.randint(0, 256, (n, *shape[:-1], shape[-1] * elsize), dtype=torch.uint8, generator=g)
        out[f"layer.{i}"] = raw.view(dtype)
    return out


def rows(layers: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {name: t[start:stop].contiguous() for name, t in layers.items()}


def block_bytes(layers: Mapping[str, torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in layers.values())


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Same layers in the same order, same dtypes and shapes, bit-identical bytes."""
    assert list(got) == list(want)
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype, name
        assert actual.shape == expected.shape, name
        assert torch.equal(actual.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)), (
            name
        )


def seed_store(
    kv: KVStoreClient, tag: str = "seed", n: int = 3
) -> tuple[list[bytes], dict[str, torch.Tensor]]:
    """Store a small chain; `assert_intact` later proves it survived."""
    hashes = chain(tag, n)
    layers = make_layers(n, seed=1234)
    assert kv.put(NS, hashes, layers).blocks_written == n
    return hashes, layers


def assert_intact(kv: KVStoreClient, seeded: tuple[list[bytes], dict[str, torch.Tensor]]) -> None:
    hashes, layers = seeded
    assert kv.health() == "SERVING"
    assert kv.lookup(NS, hashes) == len(hashes)
    assert_same(kv.select(NS, hashes), layers)


def all_blocks(
    kv: KVStoreClient, namespace: str | bytes | None = None, page_size: int = 1000
) -> list[pb.BlockInfo]:
    return list(kv.iter_blocks(namespace, page_size=page_size))


def write_config(path: Path, **settings: Any) -> Path:
    """A daemon --config TOML file (JSON scalars are valid TOML values)."""
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    return path


# ---- raw gRPC (for requests the client refuses to build) ------------------------
def header(
    hashes: Sequence[bytes],
    layers: Sequence[tuple[str, str, Sequence[int]]] = (("l0", "float16", (4, 8)),),
    namespace: bytes = NS.encode(),
    parent_hash: bytes = b"",
) -> pb.PutRequest:
    return pb.PutRequest(
        header=pb.PutHeader(
            namespace=namespace,
            block_hashes=list(hashes),
            parent_hash=parent_hash,
            layers=[pb.LayerSpec(name=n, dtype=d, shape=list(s)) for n, d, s in layers],
        )
    )


def chunk(layer: int, first: int, data: bytes) -> pb.PutRequest:
    return pb.PutRequest(chunk=pb.LayerChunk(layer_index=layer, first_block=first, data=data))


def commit() -> pb.PutRequest:
    return pb.PutRequest(commit=pb.PutCommit())


def _serialize(msg: pb.PutRequest | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def raw_put(
    address: str, messages: Iterable[pb.PutRequest | bytes], options: Sequence[tuple[str, Any]] = ()
) -> pb.PutResponse:
    """A Put with exactly these messages (plain protobuf, or raw bytes), on its own channel."""
    with grpc.insecure_channel(address, options=list(options)) as channel:
        call = channel.stream_unary(SERVICE_PREFIX + "Put", _serialize, pb.PutResponse.FromString)
        return call(iter(list(messages)), timeout=30)


def raw_unary(address: str, method: str, request: Any, response_type: Any) -> Any:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            SERVICE_PREFIX + method, type(request).SerializeToString, response_type.FromString
        )
        return call(request, timeout=30)


def raw_stream(address: str, method: str, request: Any) -> list[pb.GetResponse]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(
            SERVICE_PREFIX + method, type(request).SerializeToString, pb.GetResponse.FromString
        )
        return list(call(request, timeout=30))


def rpc_code(fn: Callable[[], Any]) -> grpc.StatusCode:
    """Run a raw call that must fail; its status code."""
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError("the call succeeded")


# ---- DropSelect parking ----------------------------------------------------------
def wait_until_parked(kv: KVStoreClient, deadline_s: float = 20.0) -> None:
    """Return once another DropSelect holds the daemon's only waiter slot.

    Needs a daemon with max_waiting_drop_selects = 1. Probes with a DropSelect that
    never waits (timeout 0, absent key): it times out at once while the slot is
    free and is refused with RESOURCE_EXHAUSTED while the other call waits in it.
    """
    probe = [hashlib.sha256(b"never-stored probe").digest()]
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            kv.drop_select(NS, probe, timeout=0)
        except errors.CapacityExceeded:
            return
        except errors.StoreTimeout:
            continue
        raise AssertionError("the probe key was unexpectedly stored")
    raise AssertionError("the DropSelect never parked on the daemon")


def drop_select_parked(
    address: str, namespace: str, hashes: Sequence[bytes], timeout: float
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a DropSelect in a thread with its own client; retries while a probe holds the slot."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        with KVStoreClient(address, timeout=timeout + 30) as client:
            while True:
                try:
                    outcome["result"] = client.drop_select(namespace, hashes, timeout=timeout)
                except errors.CapacityExceeded:
                    continue  # a probe held the single waiter slot for a moment
                except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                    outcome["error"] = exc
                return

    thread = threading.Thread(target=run, name="drop-select", daemon=True)
    thread.start()
    return thread, outcome


# ---- backends ---------------------------------------------------------------------
# Tests run on the default backend (the `backend` fixture of tests/integration/conftest.py);
# this marks one whose behaviour depends on the backend to run on each of them.
both_backends = pytest.mark.parametrize("backend", ["lmdb", "disk"])

"""Blocks put in parts against a real server: each tensor-parallel rank puts its own KV
heads (a subset of the block's layers) and reads only its own.

A block is visible only once puts have covered every layer; parts whose other layers
never come are dropped after the lease; reads of a subset move only its bytes.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from support.daemon import eventually, settled

from kvstore.blocks import PutResult
from kvstore.v1 import kvstore_pb2 as pb
from kvstore_client import KVStoreClient, LayerSpec, errors

from .helpers import (
    NS,
    as_bytes,
    assert_same,
    chain,
    header,
    make_layers,
    raw_put,
    raw_stream,
    raw_unary,
    rpc_code,
)

RANK0, RANK1 = (0, 2), (1, 3)  # layers l0#h0 l0#h1 l1#h0 l1#h1: each rank's head of each layer


def per_head_layers(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    raw = make_layers(n, num_layers=4, shape=(4, 8), seed=seed)
    return {f"l{i // 2}#h{i % 2}": t for i, t in enumerate(raw.values())}


def specs(layers: dict[str, torch.Tensor]) -> list[LayerSpec]:
    return [LayerSpec.of(name, t) for name, t in layers.items()]


def put_part(
    kv: KVStoreClient,
    hashes: list[bytes],
    layers: dict[str, torch.Tensor],
    subset,
    via: str,
    parent: bytes = b"",
):
    """One rank's save: its layers of every block, over gRPC or through the arena."""
    names = list(layers)
    if via == "arena":
        res = kv.reserve(NS, hashes, specs(layers), subset=subset, parent_hash=parent)
        assert res is not None, "the arena is not in use"
        if not res.blocks:  # every block is stored already
            return PutResult(0, len(hashes), 0, 0)
        for position, k in enumerate(subset):
            res.layer(position).copy_(layers[names[k]][res.blocks])
        return res.commit()
    with kv.put_stream(NS, hashes, specs(layers), subset=subset, arena=False, parent_hash=parent) as stream:
        for k in subset:
            stream.write_layer(names[k], layers[names[k]])
        return stream.commit()


@pytest.fixture
def arena_kv(server):
    with KVStoreClient(server.address, timeout=20.0, arena=True) as client:
        assert client.arena_available()
        yield client


@pytest.mark.parametrize("via", ["grpc", "arena"])
def test_a_block_put_in_parts_is_visible_only_once_every_layer_is_in(arena_kv, kv, via: str) -> None:
    hashes = chain("parts", 3)
    layers = per_head_layers(3)
    first = put_part(arena_kv, hashes, layers, RANK0, via)
    assert first.blocks_written == 0
    assert kv.lookup(NS, hashes) == 0 and kv.select(NS, hashes) == {}
    stats = kv.stats()
    assert (stats["partial_blocks"], stats["partial_bytes"], stats["blocks"]) == (3, 3 * 4 * 64, 0)
    second = put_part(arena_kv, hashes, layers, RANK1, via)
    assert second.blocks_written == 3
    assert kv.lookup(NS, hashes) == 3
    assert_same(kv.select(NS, hashes), layers)  # both ranks' bytes, bit-exact, in the one layout
    stats = kv.stats()
    assert (stats["partial_blocks"], stats["partial_bytes"], stats["partials_completed"]) == (0, 0, 3)
    # made whole, the blocks sit in the arena as a commit's do: a Pin finds them there,
    # promoting nothing, and write-behind persists them
    assert (stats["memory_blocks"], stats["promotions"]) == (3, 0)
    pin = arena_kv.pin(NS, hashes)
    assert pin is not None and pin.num_blocks == 3
    assert pin.verify() is None  # every layer's checksum holds
    pin.release()
    assert kv.stats()["promotions"] == 0
    eventually(lambda: kv.stats()["write_behind_blocks"] == 0)
    assert kv.stats()["write_behind_dropped"] == 0
    if via == "arena":  # each rank wrote its layers where the block lies: nothing was copied
        assert (stats["part_layers_in_place"], stats["part_layers_copied"]) == (3 * 4, 0)
    # a part of blocks stored whole is skipped, as a put of them is
    assert put_part(arena_kv, hashes, layers, RANK0, via).blocks_skipped == 3
    assert kv.stats()["partial_blocks"] == 0


def write(res, layers: dict[str, torch.Tensor], subset) -> None:
    names = list(layers)
    for position, k in enumerate(subset):
        res.layer(position).copy_(layers[names[k]][res.blocks])


def test_ranks_saving_at_once_write_in_place_into_the_blocks_one_extent(arena_kv, kv) -> None:
    """Two TP ranks reserve before either commits: both get the blocks' one extent, each
    writes its heads where they lie in it, and the daemon copies nothing at commit."""
    hashes, layers = chain("in-place", 3), per_head_layers(3, seed=3)
    reserved = [arena_kv.reserve(NS, hashes, specs(layers), subset=subset) for subset in (RANK0, RANK1)]
    assert all(res is not None and res.in_place for res in reserved)
    assert len({res.offset for res in reserved if res is not None}) == 1
    for res, subset in zip(reserved, (RANK0, RANK1), strict=True):
        write(res, layers, subset)
    assert [res.commit().blocks_written for res in reserved if res is not None] == [0, 3]
    stats = kv.stats()
    assert (stats["part_layers_in_place"], stats["part_layers_copied"]) == (3 * 4, 0)
    assert_same(kv.select(NS, hashes), layers)
    pinned = arena_kv.pin(NS, hashes)
    assert pinned is not None and pinned.num_blocks == 3 and pinned.verify() is None
    pinned.release()
    settled(kv)
    assert kv.stats()["reserved_bytes"] == 0


def test_a_rank_saving_part_of_the_chain_writes_in_place_beside_the_others(arena_kv, kv) -> None:
    """Rank 1 saves the chain in two pieces (blocks 1-2, then 0): each lands where rank 0's
    reservation laid its blocks out, at their positions in the one extent."""
    hashes, layers = chain("in-place-piece", 3), per_head_layers(3, seed=4)
    first = arena_kv.reserve(NS, hashes, specs(layers), subset=RANK0)
    assert first is not None and first.in_place
    tail = {n: t[1:] for n, t in layers.items()}
    later = arena_kv.reserve(NS, hashes[1:], specs(layers), subset=RANK1, parent_hash=hashes[0])
    head = arena_kv.reserve(NS, hashes[:1], specs(layers), subset=RANK1)
    assert later is not None and head is not None and later.in_place and head.in_place
    assert later.offset == head.offset == first.offset
    write(first, layers, RANK0)
    write(later, tail, RANK1)
    write(head, layers, RANK1)
    assert [r.commit().blocks_written for r in (later, first, head)] == [0, 2, 1]
    assert kv.stats()["part_layers_copied"] == 0
    assert_same(kv.select(NS, hashes), layers)


def test_an_aborted_in_place_save_loses_nothing_and_its_retry_completes_the_block(arena_kv, kv) -> None:
    hashes, layers = chain("in-place-abort", 3), per_head_layers(3, seed=5)
    mine = arena_kv.reserve(NS, hashes, specs(layers), subset=RANK0)
    theirs = arena_kv.reserve(NS, hashes, specs(layers), subset=RANK1)
    assert mine is not None and theirs is not None
    write(mine, layers, RANK0)
    theirs.abort()  # rank 1's save failed: rank 0's part stays, in the same extent
    assert mine.commit().blocks_written == 0 and kv.stats()["partial_blocks"] == 3
    retry = arena_kv.reserve(NS, hashes, specs(layers), subset=RANK1)
    assert retry is not None and not retry.in_place  # its layers were claimed: an extent of its own
    write(retry, layers, RANK1)
    assert retry.commit().blocks_written == 3
    stats = kv.stats()
    assert (stats["part_layers_in_place"], stats["part_layers_copied"]) == (3 * 2, 3 * 2)
    assert_same(kv.select(NS, hashes), layers)
    settled(kv)
    assert kv.stats()["reserved_bytes"] == 0


def test_a_client_that_does_not_ask_in_place_gets_an_extent_of_its_own(server, arena_kv) -> None:
    hashes, layers = chain("not-in-place", 2), per_head_layers(2)
    request = pb.ReserveRequest(
        namespace=NS.encode(), block_hashes=hashes, layer_subset=RANK0,
        layers=[pb.LayerSpec(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in specs(layers)],
    )  # fmt: skip
    answer = raw_unary(server.address, "Reserve", request, pb.ReserveResponse)
    assert answer.reservation_id and (answer.extent_blocks, answer.position) == (0, 0)
    request.in_place = True
    answer = raw_unary(server.address, "Reserve", request, pb.ReserveResponse)
    assert answer.extent_blocks == 2 and answer.position == 0


def test_a_chain_completed_out_of_order_keeps_its_parents(kv) -> None:
    hashes = chain("order", 4)
    layers = per_head_layers(4)
    put_part(kv, hashes, layers, RANK0, "grpc")
    put_part(
        kv, hashes[2:], {n: t[2:] for n, t in layers.items()}, RANK1, "grpc", hashes[1]
    )  # the tail first
    assert kv.lookup(NS, hashes) == 0 and kv.lookup(NS, hashes[2:]) == 2
    put_part(kv, hashes[:2], {n: t[:2] for n, t in layers.items()}, RANK1, "grpc")
    assert kv.lookup(NS, hashes) == 4
    parents = {b.block_hash: b.parent_hash for b in kv.iter_blocks(NS)}
    assert parents == dict(zip(hashes, [b"", *hashes[:3]], strict=True))


@pytest.mark.parametrize("via", ["grpc", "arena"])
def test_each_rank_reads_only_its_layers_and_only_their_bytes_move(server, arena_kv, kv, via: str) -> None:
    hashes = chain("reads", 3)
    layers = per_head_layers(3)
    kv.put(NS, hashes, layers)  # a TP=1 engine's save: every head at once
    names = list(layers)
    client = arena_kv if via == "arena" else kv
    for subset in (RANK0, RANK1):
        before = kv.stats()["bytes_read"]
        got = client.get_stream(NS, hashes, subset=subset).read_all()
        assert list(got) == [names[k] for k in subset]
        for k in subset:
            assert as_bytes(got[names[k]]) == as_bytes(layers[names[k]])
        if via == "grpc":  # the daemon read and sent the subset's bytes, not the block's
            assert kv.stats()["bytes_read"] - before == 3 * sum(layers[names[k]][0].nbytes for k in subset)


def test_parts_whose_other_layers_never_come_are_dropped_after_the_lease(make_server) -> None:
    server = make_server(lease_seconds=0.5)
    with KVStoreClient(server.address, arena=False) as kv:
        hashes = chain("orphan", 3)
        layers = per_head_layers(3)
        put_part(kv, hashes, layers, RANK0, "grpc")  # rank 1 died before its save
        assert kv.lookup(NS, hashes) == 0
        eventually(lambda: kv.stats()["partials_expired"] == 3)
        stats = kv.stats()
        assert (stats["partial_blocks"], stats["partial_bytes"], stats["blocks"]) == (0, 0, 0)
        put_part(kv, hashes, layers, RANK1, "grpc")  # too late: it starts over, never half visible
        assert kv.lookup(NS, hashes) == 0


def test_parts_beyond_max_partial_bytes_are_refused_and_lose_nothing(make_server) -> None:
    server = make_server(max_partial_bytes=2 * 4 * 64)  # two blocks' worth
    with KVStoreClient(server.address, arena=False) as kv:
        kept = chain("kept", 2)
        kv.put(NS, kept, per_head_layers(2, seed=1))
        hashes = chain("big", 3)
        with pytest.raises(errors.CapacityExceeded, match="max_partial_bytes"):
            put_part(kv, hashes, per_head_layers(3), RANK0, "grpc")
        assert kv.stats()["partial_blocks"] == 0 and kv.lookup(NS, kept) == 2
        small = per_head_layers(2)
        put_part(kv, hashes[:2], small, RANK0, "grpc")
        put_part(kv, hashes[:2], small, RANK1, "grpc")
        assert kv.lookup(NS, hashes) == 2


def test_bad_subsets_are_invalid_argument(server, kv) -> None:
    hashes = chain("bad", 1)
    four = [(f"l{i}", "uint8", (8,)) for i in range(4)]

    def partial(subset) -> pb.PutRequest:
        msg = header(hashes, four)
        msg.header.layer_subset.extend(subset)
        return msg

    for subset in ([4], [2, 1], [1, 1]):
        assert (
            rpc_code(lambda s=subset: raw_put(server.address, [partial(s)]))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
    with pytest.raises(ValueError, match="strictly increasing"):
        kv.put_stream(NS, hashes, [LayerSpec(n, d, s) for n, d, s in four], subset=[3, 0])
    kv.put(NS, hashes, per_head_layers(1))
    request = pb.GetRequest(namespace=NS.encode(), block_hashes=hashes, layers=[7])
    assert rpc_code(lambda: raw_stream(server.address, "Get", request)) == grpc.StatusCode.INVALID_ARGUMENT
    # a part of another layout than the parts already held
    put_part(kv, chain("mixed", 1), per_head_layers(1), RANK0, "grpc")
    other = {n: t[..., :4].contiguous() for n, t in per_head_layers(1).items()}
    with pytest.raises(errors.InvalidRequest, match="layout"):
        put_part(kv, chain("mixed", 1), other, RANK1, "grpc")


def test_drop_select_of_parts_removes_a_block_once_all_its_layers_are_taken(kv) -> None:
    hashes = chain("take", 3)
    layers = per_head_layers(3)
    kv.put(NS, hashes, layers)
    names = list(layers)
    got = kv.take_stream(NS, hashes, wait=5, subset=RANK0).read_all()
    assert list(got) == [names[k] for k in RANK0]
    assert kv.lookup(NS, hashes) == 3  # rank 1 has not taken its heads yet
    got = kv.take_stream(NS, hashes, wait=5, subset=RANK1).read_all()
    assert as_bytes(got[names[3]]) == as_bytes(layers[names[3]])
    assert kv.lookup(NS, hashes) == 0 and kv.stats()["blocks"] == 0


@pytest.mark.parametrize(
    ("kinds", "stored"), [(("wsum32", "wsum32"), "wsum32"), (("wsum32", "xxh3"), "xxh3")]
)
def test_parts_keep_the_ranks_gpu_checksums_when_they_agree(arena_kv, kinds, stored: str) -> None:
    """Each rank commits its part with its own sums (a CUDA rank: wsum32, summed on its GPU):
    parts that agree keep them, as a whole commit would, and parts of two kinds are stored
    with xxh3, summed by the daemon. Either way every reader verifies the block."""
    from kvstore.blocks import wsum32

    hashes, layers = chain(f"part-kinds-{'-'.join(kinds)}", 3), per_head_layers(3, seed=7)
    names = list(layers)
    for subset, kind in zip((RANK0, RANK1), kinds, strict=True):
        res = arena_kv.reserve(NS, hashes, specs(layers), subset=subset)
        assert res is not None
        for position, k in enumerate(subset):
            res.layer(position).copy_(layers[names[k]])
        if kind == "wsum32":
            res.commit(
                [wsum32(res.layer_pieces(p)[b]) for b in range(3) for p in range(len(subset))], kind=kind
            )
        else:
            res.commit()
    pinned = arena_kv.pin(NS, hashes)
    assert pinned is not None and pinned.num_blocks == 3 and pinned.kinds == [stored] * 3
    assert pinned.verify() is None
    pinned.release()
    assert_same(arena_kv.select(NS, hashes), layers)

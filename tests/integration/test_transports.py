"""The connector's transport interface (kvstore_connector.transport), one set of tests run
against both implementations: ArenaTransport (the daemon's arena, gRPC as its fallback)
and GrpcTransport (the daemon's byte streams), with an in-process daemon.

What the worker relies on: a step's saves opened per request, each layer saved for all
of them at once (by its heads' paged view or layer by layer), committed one by one with
what they wrote; loads that say which layers are written as they are, into exactly the
paged blocks asked for; a layout that does not match fails the load before a byte lands.
The arena-only paths (device checksums, staged groups) are test_arena_transport's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kvstore_connector.arena_transport import ArenaSave, ArenaTransport
from kvstore_connector.grpc_transport import GrpcSave, GrpcTransport, SaveBacklog
from kvstore_connector.layout import StoreLayout
from kvstore_connector.metadata import LoadSpec, SaveSpec
from kvstore_connector.transfer import BlockMover
from kvstore_connector.transport import Committed, Transport
from support.daemon import eventually
from support.inproc import InProcServer

from kvstore import arena_format as fmt
from kvstore_client import KVStoreClient, errors

from .helpers import NS, chain, make_layers

POOL = 16
HEADS = 4
NAMES = ["attn.0", "attn.1"]

MakeTransport = Callable[..., Transport]


@pytest.fixture(params=["arena", "grpc"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sender() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-save")  # the worker's one sender
    yield pool
    pool.shutdown(wait=True)


@pytest.fixture
def kv(server: InProcServer, kind: str) -> Iterator[KVStoreClient]:
    with KVStoreClient(server.address, timeout=20.0, arena=kind == "arena") as client:
        assert client.arena_available() == (kind == "arena")
        yield client


@pytest.fixture
def make(kv: KVStoreClient, kind: str, sender: ThreadPoolExecutor) -> MakeTransport:
    """make(layout, backlog=None): the transport the worker would choose for this kind."""

    def build(layout: StoreLayout, backlog: SaveBacklog | None = None) -> Transport:
        mover = BlockMover(torch.device("cpu"))
        grpc = GrpcTransport(
            kv, NS.encode(), layout.subset_specs, layout.views, mover, sender, consume=False,
            save_timeout=10.0, on_stream=lambda _stream: None, stored=layout.specs, subset=layout.subset,
            backlog=backlog,
        )  # fmt: skip
        if kind == "grpc":
            return grpc
        return ArenaTransport(
            kv, NS.encode(), layout.subset_specs, layout.views, mover, stored=layout.specs,
            subset=layout.subset, heads=layout.head_targets, fallback=grpc, reserve_timeout=10.0,
        )  # fmt: skip

    return build


def caches(seed: int | None, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """A rank's paged caches [POOL, its heads, 4, 8] bf16: random (`seed`) or zeroed."""
    g = torch.Generator().manual_seed(seed or 0)
    full = {name: torch.randn((POOL, HEADS, 4, 8), generator=g).to(torch.bfloat16) for name in NAMES}
    per = HEADS // tp
    return {
        name: (t if seed is not None else torch.zeros_like(t))[:, rank * per : (rank + 1) * per].contiguous()
        for name, t in full.items()
    }


def layout_of(views: dict[str, torch.Tensor], tp: int = 1, rank: int = 0) -> StoreLayout:
    return StoreLayout.build(views, num_kv_heads=HEADS, tp_size=tp, tp_rank=rank, mla=False, codec=None)


def save_step(t: Transport, layout: StoreLayout, specs: list[SaveSpec], *, by_heads: bool = True) -> list:
    """One step's saves as the worker makes them: open each, each layer once for all of
    them, then commit each; the commits' results."""
    saves = [t.open(spec) for spec in specs]
    opened = [s for s in saves if s is not None]
    for name in NAMES:
        t.save_layer(opened, layout.by_layer[name], layout.heads[name] if by_heads else None)
    return [t.commit(s) if s is not None else "dropped" for s in saves]


def load(t: Transport, layout: StoreLayout, hashes: list[bytes], ids: list[int]) -> tuple[int, list[str]]:
    pending, done = list(layout.views), []
    n = t.load(LoadSpec("r", hashes, ids), pending, lambda name, _event=None: done.append(name), 10.0)
    # a layer leaves `pending` as it is reported written (the worker reports the rest)
    assert sorted(pending + done) == sorted(layout.views) and (not pending or n == 0)
    return n, done


@pytest.mark.parametrize("by_heads", [True, False], ids=["heads-view", "layer-by-layer"])
def test_a_steps_saves_load_back_bit_exactly_into_other_blocks(
    make: MakeTransport, kind: str, by_heads: bool
) -> None:
    source = caches(1)
    saver_layout = layout_of(source)
    saver = make(saver_layout)
    first, second = chain(f"transport-{kind}-{by_heads}-a", 3), chain(f"transport-{kind}-{by_heads}-b", 2)
    specs = [SaveSpec("a", first, [3, 9, 1], b""), SaveSpec("b", second, [14, 0], b"")]
    saves = [saver.open(spec) for spec in specs]
    assert all(isinstance(s, ArenaSave if kind == "arena" else GrpcSave) for s in saves)
    for name in NAMES:
        saver.save_layer(
            [s for s in saves if s is not None],
            saver_layout.by_layer[name],
            saver_layout.heads[name] if by_heads else None,
        )
    assert [saver.commit(s) for s in saves if s is not None] == [Committed(3, 3), Committed(2, 2)]

    target = caches(None)
    loader_layout = layout_of(target)
    n, done = load(make(loader_layout), loader_layout, first, [15, 2, 8])
    assert n == 3
    assert sorted(done) == sorted(loader_layout.views)  # each store layer once
    for name in NAMES:
        assert torch.equal(
            target[name][[15, 2, 8]].view(torch.int16), source[name][[3, 9, 1]].view(torch.int16)
        )
        untouched = [i for i in range(POOL) if i not in (15, 2, 8)]
        assert target[name][untouched].eq(0).all()


def test_a_load_takes_the_stored_prefix_and_reports_every_layer(make: MakeTransport) -> None:
    source = caches(2)
    layout = layout_of(source)
    hashes = chain("transport-prefix", 4)
    assert save_step(make(layout), layout, [SaveSpec("r", hashes[:2], [5, 6], b"")]) == [Committed(2, 2)]
    target = caches(None)
    target_layout = layout_of(target)
    n, done = load(make(target_layout), target_layout, hashes, [1, 2, 3, 4])
    assert n == 2 and sorted(done) == sorted(target_layout.views)
    for name in NAMES:
        assert torch.equal(target[name][1:3].view(torch.int16), source[name][5:7].view(torch.int16))
        assert target[name][3:5].eq(0).all()
    assert load(make(target_layout), target_layout, chain("transport-none", 2), [7, 8])[0] == 0


def test_blocks_stored_already_are_not_written_again(make: MakeTransport, kind: str) -> None:
    source = caches(3)
    layout = layout_of(source)
    hashes = chain(f"transport-again-{kind}", 2)
    spec = SaveSpec("r", hashes, [1, 2], b"")
    assert save_step(make(layout), layout, [spec]) == [Committed(2, 2)]
    # the arena reserves nothing for them (nothing sent); a gRPC put sends them, the store keeps its own
    assert save_step(make(layout), layout, [spec]) == [None if kind == "arena" else Committed(0, 2)]


@pytest.mark.parametrize(("save_tp", "load_tp"), [(2, 1), (1, 2)])
def test_each_rank_moves_its_heads_whatever_tp_saved_them(
    make: MakeTransport, save_tp: int, load_tp: int
) -> None:
    hashes = chain(f"transport-tp-{save_tp}-{load_tp}", 3)
    for rank in range(save_tp):
        views = caches(4, save_tp, rank)
        layout = layout_of(views, save_tp, rank)
        (result,) = save_step(make(layout), layout, [SaveSpec("r", hashes, [5, 6, 7], b"")])
        assert isinstance(result, Committed) and result.blocks_sent == 3
        assert result.blocks_written == (3 if rank == save_tp - 1 else 0)  # the last part makes them visible
    whole = caches(4)
    for rank in range(load_tp):
        target = caches(None, load_tp, rank)
        layout = layout_of(target, load_tp, rank)
        n, done = load(make(layout), layout, hashes, [1, 2, 3])
        assert n == 3 and sorted(done) == sorted(layout.views)
        per = HEADS // load_tp
        for name in NAMES:
            want = whole[name][5:8, rank * per : (rank + 1) * per]
            assert torch.equal(target[name][1:4].view(torch.int16), want.view(torch.int16))


def test_a_layout_mismatch_fails_the_load_before_a_byte_lands(make: MakeTransport) -> None:
    hashes = chain("transport-mismatch", 2)
    source = caches(5)
    layout = layout_of(source)
    save_step(make(layout), layout, [SaveSpec("r", hashes, [1, 2], b"")])
    other = {name: torch.zeros((POOL, HEADS, 4, 16), dtype=torch.bfloat16) for name in NAMES}  # another shape
    other_layout = layout_of(other)
    with pytest.raises(errors.KVStoreError, match="layout"):
        load(make(other_layout), other_layout, hashes, [3, 4])
    assert all(t.eq(0).all() for t in other.values())


def test_an_async_save_over_a_full_backlog_is_dropped(make: MakeTransport, kind: str) -> None:
    """Only saves that hold host memory count: over gRPC each async save waits in the
    backlog until committed; through the arena a save holds none and is never dropped."""
    source = caches(6)
    layout = layout_of(source)
    block_bytes = layout.subset_bytes
    backlog = SaveBacklog(2 * block_bytes)
    t = make(layout, backlog)
    specs = [
        SaveSpec(f"r{i}", chain(f"transport-backlog-{kind}-{i}", 2), [2 * i, 2 * i + 1], b"")
        for i in range(2)
    ]
    saves = [t.open(spec) for spec in specs]
    if kind == "grpc":
        assert saves[1] is None and backlog.pending == 2 * block_bytes  # the first is in, the second over
    else:
        assert all(s is not None for s in saves) and backlog.pending == 0
    opened = [s for s in saves if s is not None]
    for name in NAMES:
        t.save_layer(opened, layout.by_layer[name], layout.heads[name])
    assert [t.commit(s) for s in opened] == [Committed(2, 2)] * len(opened)
    assert backlog.pending == 0


def test_the_arena_hands_what_it_cannot_take_to_its_fallback(make_server, sender: ThreadPoolExecutor) -> None:
    """A save the arena has no room for (all of it pinned) goes over gRPC through the arena
    transport's fallback, whole all the same; the blocks load back through the arena."""
    d = make_server(memory=16 * fmt.ALIGN)  # 16 pages, one the header: extents of 7 and 8 fill it
    with KVStoreClient(d.address, timeout=20.0, arena=True) as client:
        assert client.arena_available()
        fillers = [chain(f"transport-fill-{i}", 7 + i, namespace=b"filler") for i in range(2)]
        for i, hashes in enumerate(fillers):
            client.put(
                b"filler",
                hashes,
                make_layers(len(hashes), num_layers=1, shape=(fmt.ALIGN,), dtype=torch.uint8, seed=i),
            )
            # written behind before the next: else the second could not evict the first
            eventually(lambda: client.stats()["write_behind_blocks"] == 0)
        pins = [client.pin(b"filler", hashes) for hashes in fillers]
        assert [p.num_blocks if p is not None else 0 for p in pins] == [7, 8]

        source = caches(7)
        layout = layout_of(source)
        mover = BlockMover(torch.device("cpu"))
        grpc = GrpcTransport(
            client, NS.encode(), layout.subset_specs, layout.views, mover, sender, consume=False,
            save_timeout=10.0, on_stream=lambda _stream: None, stored=layout.specs, subset=layout.subset,
        )  # fmt: skip
        arena = ArenaTransport(
            client, NS.encode(), layout.subset_specs, layout.views, mover, stored=layout.specs,
            subset=layout.subset, heads=layout.head_targets, fallback=grpc, reserve_timeout=10.0,
        )  # fmt: skip
        hashes = chain("transport-fallback", 2)
        save = arena.open(SaveSpec("r", hashes, [1, 2], b""))
        assert isinstance(save, GrpcSave)  # the arena refused it for room
        for name in NAMES:
            arena.save_layer([save], layout.by_layer[name], layout.heads[name])
        assert arena.commit(save) == Committed(2, 2)
        for p in pins:
            assert p is not None and p.release()
        assert client.lookup(NS, hashes) == 2

        target = caches(None)
        target_layout = layout_of(target)
        loader = ArenaTransport(
            client, NS.encode(), target_layout.subset_specs, target_layout.views, mover,
            stored=target_layout.specs, subset=target_layout.subset, heads=target_layout.head_targets,
            reserve_timeout=10.0,
        )  # fmt: skip
        assert load(loader, target_layout, hashes, [5, 6])[0] == 2
        for name in NAMES:
            assert torch.equal(target[name][5:7].view(torch.int16), source[name][1:3].view(torch.int16))


def test_the_arena_mapping_is_prepared_once_and_let_go_with_its_last_client(server: InProcServer) -> None:
    """The connector pre-faults the mapping (CPU) once however many clients share it, and
    stops when the last one closes; the client itself leaves the pages alone."""
    from kvstore_connector import host_memory

    with KVStoreClient(server.address, arena=True) as first:
        mapping = first.arena_mapping()
        assert mapping is not None and mapping not in host_memory._PREPARED
        assert host_memory.prepare_arena(first, cuda=False)
        prepared = host_memory._PREPARED[mapping]
        with KVStoreClient(server.address, arena=True) as second:
            assert host_memory.prepare_arena(second, cuda=False)
            assert second.arena_mapping() is mapping and host_memory._PREPARED[mapping] is prepared
        assert not prepared._closed  # the first client still maps it
    assert prepared._closed  # the last client let go: the pre-fault thread ended with it
    assert prepared._prefaulter is not None and not prepared._prefaulter.is_alive()
    assert not mapping.on_close(lambda: None)  # closed: nothing more to undo

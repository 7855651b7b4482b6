"""The connector's arena transport with device checksums (wsum32), on CPU.

On a GPU the transport saves wsum32 checksums computed on the device and loads by
staging groups of layers on the device and checking them there before scattering;
the BlockMover runs the same calls in order on CPU, so this is the code a CUDA
worker runs, against an in-process daemon and its real arena: groups of layers,
runs that are whole extents (one copy per group) or parts of one (one per layer),
several runs, layers of different sizes, and a flipped byte."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvstore_connector import arena_transport
from kvstore_connector.arena_transport import ArenaSave, ArenaTransport
from kvstore_connector.transfer import BlockMover
from support.daemon import eventually
from support.inproc import InProcServer

from kvstore.blocks import WSUM32
from kvstore_client import KVStoreClient, LayerSpec, errors

from .helpers import NS, chain

POOL = 16
# two layers of one shape, then one of another (a group never spans two block sizes)
SHAPES = {"layer.0": (2, 4, 8), "layer.1": (2, 4, 8), "layer.2": (3, 4, 8)}


def paged(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(-(2**15), 2**15, (POOL, *shape), generator=g, dtype=torch.int16).view(
            torch.bfloat16
        )
        for name, shape in SHAPES.items()
    }


def transport(kv: KVStoreClient, caches: dict[str, torch.Tensor]) -> ArenaTransport:
    specs = [LayerSpec.of(name, t) for name, t in caches.items()]
    return ArenaTransport(
        kv, NS, specs, caches, BlockMover(torch.device("cpu")), device_checksums=True, reserve_timeout=10
    )


def save(t: ArenaTransport, hashes: list[bytes], ids: list[int], parent: bytes = b"") -> int:
    spec = SimpleNamespace(req_id="r", hashes=hashes, block_ids=ids, parent_hash=parent, token_ids=[])
    save = t.open(spec)  # type: ignore[arg-type]
    assert isinstance(save, ArenaSave), "the arena is not in use"
    for name in t.caches:
        t.save_layer([save], [name], None)
    save.wait()  # as a caller may (the bench does): the copies are done, the sums still to take
    result = t.commit(save)
    return 0 if result is None else int(result.blocks_written)


def load(t: ArenaTransport, hashes: list[bytes], ids: list[int]) -> tuple[int, list[str]]:
    spec = SimpleNamespace(req_id="r", hashes=hashes, block_ids=ids)
    pending, done = list(t.caches), []
    n = t.load(spec, pending, lambda name, _event: done.append(name), timeout=10)  # type: ignore[arg-type]
    assert not pending
    return n, done


@pytest.fixture
def kv(server: InProcServer):
    with KVStoreClient(server.address, timeout=20.0, arena=True) as client:
        assert client.arena_available()
        yield client


@pytest.mark.parametrize("group_bytes", [1, 1 << 30], ids=["a-layer-a-group", "one-group-per-size"])
def test_device_checked_loads_are_bit_exact_over_whole_and_partial_extents(
    kv: KVStoreClient, monkeypatch: pytest.MonkeyPatch, group_bytes: int
) -> None:
    monkeypatch.setattr(arena_transport, "_GROUP_BYTES", group_bytes)
    hashes = chain("staged", 8)
    source = paged(1)
    saver = transport(kv, source)
    src_ids = [3, 9, 1, 14, 0, 7, 12, 5]
    # two saves: blocks 0-4 in one extent, 5-7 in another (two runs on load)
    assert save(saver, hashes[:5], src_ids[:5]) == 5
    assert save(saver, hashes[5:], src_ids[5:], parent=hashes[4]) == 3
    pinned = kv.pin(NS, hashes)
    assert pinned is not None and set(pinned.kinds) == {WSUM32} and len(pinned.runs) == 2
    pinned.release()

    for wanted in (8, 3):  # the whole chain; a prefix: part of the first extent only
        target = paged(2)
        loader = transport(kv, target)
        dst_ids = [15, 2, 8, 6, 11, 4, 13, 10][:wanted]
        n, done = load(loader, hashes[:wanted], dst_ids)
        assert n == wanted and sorted(done) == sorted(SHAPES)
        for name in SHAPES:
            assert torch.equal(
                target[name][dst_ids].view(torch.int16), source[name][src_ids[:wanted]].view(torch.int16)
            ), name
            untouched = [i for i in range(POOL) if i not in dst_ids]
            assert torch.equal(
                target[name][untouched].view(torch.int16), paged(2)[name][untouched].view(torch.int16)
            )
    # each load's pin ended with a Release sent in the background (finish())
    eventually(lambda: kv.stats()["pinned_bytes"] == 0)


def test_layer_groups_follow_block_sizes_and_the_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    groups = arena_transport._layer_groups
    assert groups([4, 4, 4, 8, 8], 10) == [range(0, 3), range(3, 5)]
    monkeypatch.setattr(arena_transport, "_GROUP_BYTES", 80)  # two 40-byte layers per group
    assert groups([4, 4, 4, 8, 8], 10) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]


@pytest.mark.parametrize(
    ("block", "layer"), [(0, 0), (0, 2), (3, 0), (3, 2), (2, 1)],
    ids=["first-block-first-layer", "first-block-last-layer", "last-block-first-layer", "last-block-last-layer",
         "middle"],
)  # fmt: skip
def test_a_byte_flipped_after_the_save_fails_the_device_check_and_drops_the_block(
    make_server, block: int, layer: int
) -> None:
    """The batched device check (one pass per group of layers over every block) finds a
    flipped byte wherever it lies: first, middle, last layer; first, last block."""
    d = make_server(write_behind_bytes=1)  # only the arena has them: write-behind would find the flip first
    hashes = chain("staged-flip", 4)
    with KVStoreClient(d.address, timeout=20.0, arena=True) as kv:
        assert save(transport(kv, paged(3)), hashes, [0, 1, 2, 3]) == 4
        pinned = kv.pin(NS, hashes)
        assert pinned is not None
        pinned.block_view(block, layer)[7] ^= 0x10  # a stray write by any process that maps the arena
        pinned.release()
        target = paged(4)
        before = {name: t.clone() for name, t in target.items()}
        with pytest.raises(errors.LocalDataCorrupt, match="on the device"):
            load(transport(kv, target), hashes, [4, 5, 6, 7])
        assert kv.lookup(NS, hashes) == block  # the daemon verified the report and dropped the block
        # nothing of the failing group reached the paged cache
        name = f"layer.{layer}"
        assert torch.equal(target[name].view(torch.int16), before[name].view(torch.int16))


def test_layer_groups_of_a_ranks_layers_are_runs_of_consecutive_ones() -> None:
    groups = arena_transport._layer_groups
    assert groups([4, 4, 4, 8, 8], 10, [0, 2, 3, 4]) == [range(0, 1), range(2, 3), range(3, 5)]


def test_a_device_checked_load_of_some_layers_touches_only_theirs(kv: KVStoreClient) -> None:
    """A tensor-parallel rank's load: its layers of the stored blocks (staged and checked on
    the device), the other layers' pages untouched."""
    hashes = chain("staged-subset", 4)
    source = paged(4)
    assert save(transport(kv, source), hashes, [0, 1, 2, 3]) == 4
    stored = [LayerSpec.of(name, t) for name, t in source.items()]
    target = paged(5)
    mine = {name: target[name] for name in ("layer.0", "layer.2")}
    loader = ArenaTransport(kv, NS, [stored[0], stored[2]], mine, BlockMover(torch.device("cpu")),
                            device_checksums=True, stored=stored, subset=(0, 2))  # fmt: skip
    n, done = load(loader, hashes, [8, 9, 10, 11])
    assert n == 4 and sorted(done) == ["layer.0", "layer.2"]
    for name in ("layer.0", "layer.2"):
        assert torch.equal(target[name][8:12].view(torch.int16), source[name][0:4].view(torch.int16))
    assert torch.equal(target["layer.1"].view(torch.int16), paged(5)["layer.1"].view(torch.int16))


@pytest.mark.parametrize("codec_name", ["fp8", "int8"])
def test_compressed_blocks_take_the_device_path_quantized_and_back(
    kv: KVStoreClient, codec_name: str
) -> None:
    from kvstore_connector.compression import make_codec

    codec = make_codec(codec_name)
    assert codec is not None
    g = torch.Generator().manual_seed(6)
    source = {
        name: torch.randn((POOL, *shape), generator=g).to(torch.bfloat16) for name, shape in SHAPES.items()
    }
    packed = [LayerSpec(name, "uint8", codec.stored_shape(shape)) for name, shape in SHAPES.items()]

    def make(caches: dict[str, torch.Tensor]) -> ArenaTransport:
        mover = BlockMover(torch.device("cpu"), codec)
        return ArenaTransport(kv, NS, packed, caches, mover, device_checksums=True, reserve_timeout=10)

    hashes = chain(f"staged-{codec_name}", 3)
    assert save(make(source), hashes, [4, 5, 6]) == 3
    target = {name: torch.zeros_like(t) for name, t in source.items()}
    n, _ = load(make(target), hashes, [0, 1, 2])
    assert n == 3
    for name in SHAPES:
        want, got = source[name][4:7].float(), target[name][0:3].float()
        amax = want.abs().flatten(1).amax(dim=1).view(-1, *[1] * (want.dim() - 1))
        step = amax * 2**-4 if codec_name == "fp8" else amax / 127 / 2
        assert ((got - want).abs() <= step + want.abs() * 2**-8 + 1e-6).all(), name


ATTN = ["attn.0", "attn.1"]  # two attention layers of 4 KV heads (the heads tests)


def attention_kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((POOL, 4, 4, 8), generator=g).to(torch.bfloat16) for name in ATTN}


def heads_rank(
    kv: KVStoreClient,
    full: dict[str, torch.Tensor],
    tp: int,
    r: int,
    source: dict[str, torch.Tensor] | None,
    *,
    codec: Any = None,
    device_checksums: bool = True,
) -> tuple[ArenaTransport, Any]:
    """Rank r of a TP=tp engine over `full`'s heads, as the connector builds it: its paged
    caches (its heads of `source`, zeros without one), its layout, its transport."""
    from kvstore_connector.layout import StoreLayout

    caches = {n: (source[n] if source else torch.zeros_like(full[n]))[:, r * 4 // tp : (r + 1) * 4 // tp]
              .contiguous() for n in ATTN}  # fmt: skip
    layout = StoreLayout.build(caches, num_kv_heads=4, tp_size=tp, tp_rank=r, mla=False, codec=codec)
    t = ArenaTransport(kv, NS, layout.subset_specs, layout.views, BlockMover(torch.device("cpu"), codec),
                       device_checksums=device_checksums, stored=layout.specs, subset=layout.subset,
                       heads=layout.head_targets)  # fmt: skip
    return t, layout


@pytest.mark.parametrize("codec_name", ["none", "fp8"])
@pytest.mark.parametrize(("save_tp", "load_tp"), [(1, 1), (1, 2), (2, 1)])
def test_a_ranks_heads_move_with_one_copy_per_layer_on_the_device_path(
    kv: KVStoreClient, codec_name: str, save_tp: int, load_tp: int
) -> None:
    """The connector's layout (a store layer per KV head): saves of a layer's heads in one
    indexed copy (save_layer with their heads' view, summed on the device), staged loads scattering them in one."""
    from kvstore_connector.compression import make_codec

    codec = make_codec(codec_name)
    names, full = ATTN, attention_kv(8)

    def rank(tp: int, r: int, source: dict[str, torch.Tensor] | None) -> tuple[ArenaTransport, Any]:
        return heads_rank(kv, full, tp, r, source, codec=codec)

    hashes = chain(f"heads-{codec_name}-{save_tp}-{load_tp}", 3)
    spec = SimpleNamespace(req_id="r", hashes=hashes, block_ids=[5, 6, 7], parent_hash=b"", token_ids=[])
    for r in range(save_tp):
        t, layout = rank(save_tp, r, full)
        save = t.open(spec)  # type: ignore[arg-type]
        assert isinstance(save, ArenaSave)
        for name in names:
            t.save_layer([save], layout.by_layer[name], layout.heads[name])
        t.commit(save)
    assert kv.lookup(NS, hashes) == 3
    for r in range(load_tp):
        t, layout = rank(load_tp, r, None)
        n, done = load(t, hashes, [1, 2, 3])
        assert n == 3 and sorted(done) == sorted(layout.views)
        for name in names:
            want = full[name][5:8, r * 4 // load_tp : (r + 1) * 4 // load_tp].float()
            got = layout.heads[name][1:4].float()
            if codec is None:
                assert torch.equal(got, want)
            else:
                amax = want.abs().amax(dim=(2, 3), keepdim=True)
                assert ((got - want).abs() <= amax * 2**-4 + want.abs() * 2**-8 + 1e-6).all()
            assert layout.heads[name][[0, *range(4, POOL)]].eq(0).all()  # nothing else written


@pytest.mark.parametrize("device_checksums", [True, False])
def test_a_rank_saving_part_of_a_chain_writes_its_heads_in_place_beside_the_other_ranks(
    kv: KVStoreClient, device_checksums: bool
) -> None:
    """TP=2: rank 0 saves a chain of three blocks, rank 1 saves it in two pieces (blocks 1-2,
    then block 0). Each piece is written where its blocks lie in the one extent rank 0's
    reservation laid out for three blocks: a layer's two heads are not side by side there
    (a run of two blocks, then the next head's three), so each head is its own copy. The
    daemon copies nothing, and a TP=1 load reads every block back bit-exact."""
    names, full = ATTN, attention_kv(9)

    def rank(tp: int, r: int, source: dict[str, torch.Tensor] | None) -> tuple[ArenaTransport, Any]:
        return heads_rank(kv, full, tp, r, source, device_checksums=device_checksums)

    hashes = chain(f"in-place-pieces-{device_checksums}", 3)
    ids = [5, 6, 7]
    for r, first, stop in [(0, 0, 3), (1, 1, 3), (1, 0, 1)]:
        t, layout = rank(2, r, full)
        parent = hashes[first - 1] if first else b""
        spec = SimpleNamespace(req_id="r", hashes=hashes[first:stop], block_ids=ids[first:stop],
                               parent_hash=parent, token_ids=[])  # fmt: skip
        save = t.open(spec)  # type: ignore[arg-type]
        assert isinstance(save, ArenaSave) and save.reservation.in_place
        for name in names:
            t.save_layer([save], layout.by_layer[name], layout.heads[name])
        t.commit(save)
    assert kv.lookup(NS, hashes) == 3
    stats = kv.stats()
    assert stats["part_layers_copied"] == 0 and stats["part_layers_in_place"] == 3 * 2 * 4
    t, layout = rank(1, 0, None)
    n, _ = load(t, hashes, [1, 2, 3])
    assert n == 3
    for name in names:
        assert torch.equal(layout.heads[name][1:4], full[name][5:8])


def _cold(make_server, hashes: list[bytes], source: dict[str, torch.Tensor], ids: list[int]) -> InProcServer:
    """A server whose persistent tier alone holds `hashes` (saved from `source` at `ids`,
    written behind, then the memory tier gone as at a reboot), restarted on the same data."""
    first = make_server("cold")
    with KVStoreClient(first.address, timeout=20.0, arena=True) as kv:
        assert save(transport(kv, source), hashes, ids) == len(hashes)
        eventually(lambda: kv.stats()["written_behind"] == len(hashes))
    first.stop()
    memory_dir = first.data_dir.parent / f"{first.data_dir.name}-shm"
    for path in memory_dir.iterdir():
        path.unlink()
    return make_server("cold")


@pytest.mark.parametrize("range_bytes", [1, 1 << 30], ids=["a-block-a-copy", "one-copy"])
@pytest.mark.parametrize("device_checksums", [True, False], ids=["device-checked", "arena-checked"])
def test_a_cold_load_copies_promoted_blocks_by_ranges_and_saved_ones_by_layers(
    make_server, monkeypatch: pytest.MonkeyPatch, range_bytes: int, device_checksums: bool
) -> None:
    """A promotion places its blocks side by side, a block's layers together (block-major
    runs: copied by ranges of blocks as they are read); blocks saved through the arena lie
    layer by layer (layer-major: copied by groups of layers). One load of both is bit-exact."""
    monkeypatch.setattr(arena_transport, "_RANGE_BYTES", range_bytes)
    hashes = chain("cold-ranges", 9)
    source = paged(5)
    src_ids = [3, 9, 1, 14, 0, 7, 12, 5, 10]
    d = _cold(make_server, hashes[:6], source, src_ids[:6])
    with KVStoreClient(d.address, timeout=20.0, arena=True) as kv:
        saver = transport(kv, source)
        saver.device_checksums = device_checksums
        assert save(saver, hashes[6:], src_ids[6:], parent=hashes[5]) == 3  # in memory, layer-major
        target = paged(6)
        loader = transport(kv, target)
        loader.device_checksums = device_checksums
        dst_ids = [15, 2, 8, 6, 11, 4, 13, 1, 0]
        n, done = load(loader, hashes, dst_ids)
        assert n == 9 and sorted(done) == sorted(SHAPES)
        for name in SHAPES:
            assert torch.equal(
                target[name][dst_ids].view(torch.int16), source[name][src_ids].view(torch.int16)
            )
            untouched = [i for i in range(POOL) if i not in dst_ids]
            assert torch.equal(
                target[name][untouched].view(torch.int16), paged(6)[name][untouched].view(torch.int16)
            )
        stats = kv.stats()
        assert (stats["promotions"], stats["promoted_blocks"]) == (1, 6)
        pinned = kv.pin(NS, hashes)  # what that load saw: the promoted blocks, then the saved ones
        assert pinned is not None
        assert [(run.first, run.count, bool(run.stride)) for run in pinned.runs] == [
            (0, 6, True),
            (6, 3, False),
        ]
        assert pinned.verify() is None
        pinned.release()


@pytest.mark.parametrize("backend", ["disk"])
def test_a_byte_flipped_on_disk_fails_the_cold_loads_device_check_before_any_layer_lands(
    make_server, backend: str
) -> None:
    hashes = chain("cold-flip", 4)
    source = paged(7)
    d = _cold(make_server, hashes, source, [0, 1, 2, 3])
    files = sorted(d.data_dir.rglob("*.safetensors"))
    assert len(files) == 4
    with open(files[0], "r+b") as f:  # a block's last byte: the end of its last layer's payload
        f.seek(-1, 2)
        byte = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([byte ^ 0x01]))
    with KVStoreClient(d.address, timeout=20.0, arena=True) as kv:
        target = paged(8)
        with pytest.raises(errors.LocalDataCorrupt, match="on the device"):
            load(transport(kv, target), hashes, [4, 5, 6, 7])
        for name in SHAPES:  # nothing reached the paged cache
            assert torch.equal(target[name].view(torch.int16), paged(8)[name].view(torch.int16))
        assert kv.lookup(NS, hashes) < 4  # the daemon verified the report and dropped the block

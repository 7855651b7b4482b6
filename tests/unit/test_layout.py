"""The stored KV layout: each rank's KV heads, for every tensor parallelism."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvstore_connector.layout import StoreLayout, head_range

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 8, 12])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8, 16])
def test_every_head_is_held_and_saved_by_exactly_one_first_replica(heads: int, tp: int) -> None:
    if heads % tp and tp % heads:  # neither divides: vLLM refuses the model, so do we
        with pytest.raises(ValueError, match="cannot"):
            head_range(heads, tp, 0)
        return
    ranges = [head_range(heads, tp, rank) for rank in range(tp)]
    held = [h for first, end, _ in ranges for h in range(first, end)]
    saved = [h for first, end, saves in ranges if saves for h in range(first, end)]
    assert sorted(saved) == list(range(heads))  # every head saved once
    assert sorted(set(held)) == list(range(heads))
    for first, end, _ in ranges:  # each rank's heads are one contiguous run of equal length
        assert end - first == max(1, heads // tp)
    if tp <= heads:
        assert held == list(range(heads)) and all(saves for *_, saves in ranges)
    else:  # replicated: tp / heads ranks per head, consecutive, the first of them saves
        assert held == [h for h in range(heads) for _ in range(tp // heads)]


@pytest.mark.parametrize(("heads", "tp", "rank"), [(0, 1, 0), (2, 0, 0), (2, 2, 2), (2, 2, -1)])
def test_impossible_ranks_are_refused(heads: int, tp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        head_range(heads, tp, rank)


def _caches(heads: int, blocks: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((blocks, heads, 4, 6), generator=g) for name in LAYERS}


def _rank_caches(full: dict[str, torch.Tensor], heads: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What vLLM gives rank `rank` of `tp`: its heads' slice of the full caches."""
    first, end, _ = head_range(heads, tp, rank)
    return {name: t[:, first:end].contiguous() for name, t in full.items()}


@pytest.mark.parametrize(("heads", "tp"), [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (3, 1), (3, 3)])
def test_every_tp_sees_the_same_stored_layers_and_the_same_bytes_under_their_names(
    heads: int, tp: int
) -> None:
    full = _caches(heads)
    reference = StoreLayout.build(full, num_kv_heads=heads, tp_size=1, tp_rank=0, mla=False)
    assert [s.name for s in reference.specs] == [f"{n}#h{h}" for n in LAYERS for h in range(heads)]
    assert reference.subset == () and reference.saves
    seen: set[str] = set()
    for rank in range(tp):
        layout = StoreLayout.build(_rank_caches(full, heads, tp, rank), num_kv_heads=heads, tp_size=tp,
                                   tp_rank=rank, mla=False)  # fmt: skip
        assert layout.specs == reference.specs  # one layout whatever the parallelism
        first, end, saves = head_range(heads, tp, rank)
        assert layout.saves == saves
        assert [layout.specs[k].name.rsplit("#h", 1)[1] for k in layout.subset_indices] == [
            str(h) for _ in LAYERS for h in range(first, end)
        ]
        assert layout.subset_bytes == reference.subset_bytes * (end - first) // heads  # only its heads move
        for k in layout.subset_indices:  # a rank's view of a store layer holds what TP=1 holds there
            name = layout.specs[k].name
            assert torch.equal(layout.views[name], reference.views[name])
            seen.add(name)
        for layer, names in layout.by_layer.items():
            assert names == [
                layout.specs[k].name for k in layout.subset_indices if layout.specs[k].name.startswith(layer)
            ]
    assert seen == {s.name for s in reference.specs}


def test_mla_is_one_store_layer_per_layer_saved_by_rank_zero_loaded_by_all() -> None:
    latent = {name: torch.randn((5, 4, 576)) for name in LAYERS}  # no head dimension
    for rank in range(4):
        layout = StoreLayout.build(latent, num_kv_heads=1, tp_size=4, tp_rank=rank, mla=True)
        assert [s.name for s in layout.specs] == LAYERS and layout.subset == ()
        assert layout.saves == (rank == 0)
        assert layout.views[LAYERS[0]] is latent[LAYERS[0]]


def test_a_cache_without_this_ranks_heads_first_is_refused() -> None:
    wrong = {name: torch.zeros((5, 4, 3, 6)) for name in LAYERS}  # [blocks, block_size, heads, ...]
    with pytest.raises(ValueError, match="KV heads first"):
        StoreLayout.build(wrong, num_kv_heads=6, tp_size=2, tp_rank=0, mla=False)


def test_views_are_the_paged_memory_itself() -> None:
    full = _caches(2)
    layout = StoreLayout.build(full, num_kv_heads=2, tp_size=1, tp_rank=0, mla=False)
    layout.views[f"{LAYERS[1]}#h1"][3].fill_(7.0)  # a load writing a block of head 1
    assert full[LAYERS[1]][3, 1].eq(7.0).all() and not full[LAYERS[1]][3, 0].eq(7.0).any()


def test_all_combinations_cover_the_issue_matrix() -> None:
    # H divisible by t and not, t' likewise: each pair of engines finds every head it holds
    for heads, save_tp, load_tp in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8]):
        saved = {
            h for r in range(save_tp) for f, e, s in [head_range(heads, save_tp, r)] if s for h in range(f, e)
        }
        for rank in range(load_tp):
            first, end, _ = head_range(heads, load_tp, rank)
            assert set(range(first, end)) <= saved

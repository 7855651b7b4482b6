"""How a block's KV is laid out in the store: the same for every tensor parallelism.

A stored block holds, for each attention layer, every KV head of the model, each
head as a layer of its own ("store layers": `<layer>#h<j>`, shape the paged
view's per-head slice, e.g. [block_size, 2 * head_size] on vLLM's CPU backend),
layer-major: layer 0's heads 0..H-1, then layer 1's. Tensor-parallel rank r of
tp holds KV heads

    [r * H / tp, (r + 1) * H / tp)      when tp <= H (H divisible by tp), or
    [r // (tp / H)]                     when tp > H (tp divisible by H: each head
                                        on tp / H ranks, replicas of one another)

so a rank saves and loads exactly its heads' store layers, whatever tp the KV
was saved with: a TP=1 prefill's block serves a TP=2 decode (each rank reads
half of it) and a TP=2 prefill's (two partial puts, visible once both are in)
serves a TP=1 decode. Of the replicas of a head only the first saves it.

MLA (one latent, the same on every rank; no head dimension): one store layer
per layer, saved by rank 0 and loaded by every rank.

Pipeline stages hold different layers: they stay apart in the namespace
(kvstore_connector.config.NamespaceInfo), as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore_client import LayerSpec
from kvstore_client.tensors import dtype_name

if TYPE_CHECKING:
    from kvstore_connector.compression import Codec

HEAD_SEP = "#h"


def head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, bool]:
    """(first head, end, saves): the KV heads rank `tp_rank` of `tp_size` holds, and whether
    it is the rank that saves them (the first of their replicas). Raises ValueError where
    neither divides the other (vLLM refuses such models too)."""
    if num_kv_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"no rank {tp_rank} of {tp_size} for {num_kv_heads} KV heads")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} ranks")
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per, True
    if tp_size % num_kv_heads:
        raise ValueError(f"{tp_size} ranks cannot share {num_kv_heads} KV heads evenly")
    replicas = tp_size // num_kv_heads
    head = tp_rank // replicas
    return head, head + 1, tp_rank % replicas == 0


@dataclass(frozen=True)
class StoreLayout:
    """One rank's view of the stored layout.

    `specs`: every store layer of a block (all heads), in stored order; `subset_indices`:
    the indices of this rank's (its layer subset, every index listed even when it holds
    all: `subset` is the form a put or read passes); `views`: by store layer name, the
    paged view a rank's store layer is copied from and to ([num_blocks, *spec.shape], a
    strided view into vLLM's cache); `by_layer`: vLLM's layer name -> this rank's store
    layer names; `saves`: whether this rank writes its store layers (the first replica)."""

    specs: tuple[LayerSpec, ...]
    subset_indices: tuple[int, ...]
    views: dict[str, torch.Tensor]
    by_layer: dict[str, list[str]]
    saves: bool
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    """vLLM's layer name -> its paged view [num_blocks, this rank's heads, ...] (not for MLA):
    a rank's store layers of one layer are consecutive, so one indexed copy moves them all."""

    @property
    def subset_specs(self) -> list[LayerSpec]:
        """The specs of this rank's store layers (its layer subset)."""
        return [self.specs[k] for k in self.subset_indices]

    @property
    def subset(self) -> tuple[int, ...]:
        """The rank's layer subset as a put or read passes it: empty when it holds all."""
        return () if len(self.subset_indices) == len(self.specs) else self.subset_indices

    @property
    def head_targets(self) -> dict[str, tuple[torch.Tensor, int]]:
        """By this rank's store layer: the paged view of its layer's heads and its index there."""
        return {
            name: (self.heads[layer], i)
            for layer, names in self.by_layer.items()
            if layer in self.heads
            for i, name in enumerate(names)
        }

    @property
    def subset_bytes(self) -> int:
        """One block's bytes of this rank's store layers (its layer subset)."""
        return sum(self.specs[k].nbytes for k in self.subset_indices)

    @classmethod
    def build(
        cls,
        caches: dict[str, torch.Tensor],
        *,
        num_kv_heads: int,
        tp_size: int,
        tp_rank: int,
        mla: bool,
        codec: Codec | None = None,
    ) -> StoreLayout:
        """From vLLM's block-major cache views ([num_blocks, ...] per layer). `codec`: store
        layers hold its packed rows (uint8) instead of the cache's dtype. Raises ValueError
        for a cache whose per-block shape does not start with this rank's KV heads."""

        def spec(name: str, view: torch.Tensor, shape: tuple[int, ...]) -> LayerSpec:
            if codec is None:
                return LayerSpec(name, dtype_name(view.dtype), shape)
            return LayerSpec(name, "uint8", codec.stored_shape(shape))

        specs: list[LayerSpec] = []
        subset: list[int] = []
        views: dict[str, torch.Tensor] = {}
        by_layer: dict[str, list[str]] = {}
        for name in caches:
            if HEAD_SEP in name:
                raise ValueError(f"layer name {name!r} contains {HEAD_SEP!r}")
        if mla:
            for name, view in caches.items():
                subset.append(len(specs))
                specs.append(spec(name, view, tuple(view.shape[1:])))
                views[name] = view
                by_layer[name] = [name]
            return cls(tuple(specs), tuple(subset), views, by_layer, tp_rank == 0)
        first, end, saves = head_range(num_kv_heads, tp_size, tp_rank)
        local = end - first
        for name, view in caches.items():
            if view.dim() < 3 or view.shape[1] != local:
                raise ValueError(
                    f"KV cache of {name!r} has per-block shape {list(view.shape[1:])}: the store needs "
                    f"this rank's {local} KV heads first ([num_blocks, heads, ...], vLLM's standard views)"
                )
            shape = tuple(view.shape[2:])
            by_layer[name] = []
            for head in range(num_kv_heads):
                store_name = f"{name}{HEAD_SEP}{head}"
                if first <= head < end:
                    subset.append(len(specs))
                    views[store_name] = view.select(1, head - first)
                    by_layer[name].append(store_name)
                specs.append(spec(store_name, view, shape))
        heads = {name: caches[name] for name in by_layer}
        return cls(tuple(specs), tuple(subset), views, by_layer, saves, heads)

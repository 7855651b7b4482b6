"""kvstore_client.streams.ChunkOrder: the order every LayerSource's chunks must come in."""

from __future__ import annotations

import pytest

from kvstore import wire
from kvstore_client import LayerSpec, errors
from kvstore_client.streams import ChunkOrder, LayerStream

LAYERS = [LayerSpec("k", "uint8", (4,)), LayerSpec("v", "uint8", (2,))]


def chunk(layer: int, first: int, nbytes: int) -> wire.Chunk:
    return wire.Chunk(layer, first, memoryview(bytes(nbytes)))


def test_layers_complete_in_order() -> None:
    order = ChunkOrder(LAYERS, 3)
    assert [order.place(c) for c in (chunk(0, 0, 8), chunk(0, 2, 4), chunk(1, 0, 0), chunk(1, 0, 6))] == [
        False,
        True,
        False,
        True,
    ]
    assert order.done
    order.finish()


@pytest.mark.parametrize(
    "bad",
    [chunk(1, 0, 6), chunk(0, 1, 4), chunk(0, 0, 6), chunk(0, 0, 16)],
    ids=["another layer", "a gap", "part of a block", "past the last block"],
)
def test_a_chunk_out_of_order_is_refused(bad: wire.Chunk) -> None:
    with pytest.raises(errors.StoreInternalError, match="out-of-order"):
        ChunkOrder(LAYERS, 3).place(bad)


def test_data_after_the_end_and_an_early_end_are_refused() -> None:
    order = ChunkOrder(LAYERS, 0)
    with pytest.raises(errors.StoreInternalError, match="after the last layer"):
        order.place(chunk(0, 0, 4))
    with pytest.raises(errors.StoreInternalError, match="ended early"):
        ChunkOrder(LAYERS, 1).finish()


class ListSource:
    """A LayerSource over chunks in memory."""

    def __init__(self, layers: list[LayerSpec], num_blocks: int, chunks: list[wire.Chunk]) -> None:
        self.layers, self.num_blocks, self._chunks = layers, num_blocks, chunks
        self.cancelled = False

    def chunks(self):  # type: ignore[no-untyped-def]
        yield from self._chunks

    def cancel(self) -> None:
        self.cancelled = True


def test_a_layer_stream_over_any_source_yields_whole_layers() -> None:
    torch = pytest.importorskip("torch")
    data = [wire.Chunk(0, 0, memoryview(bytes(range(8)))), wire.Chunk(1, 0, memoryview(bytes([9] * 4)))]
    layers = dict(LayerStream(ListSource(LAYERS, 2, data)))
    assert list(layers) == ["k", "v"]
    assert layers["k"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert torch.equal(layers["v"], torch.full((2, 2), 9, dtype=torch.uint8))


def test_a_layer_stream_refuses_a_source_that_ends_early() -> None:
    stream = LayerStream(ListSource(LAYERS, 2, [wire.Chunk(0, 0, memoryview(bytes(8)))]))
    with pytest.raises(errors.StoreInternalError, match="ended early"):
        stream.read_all()

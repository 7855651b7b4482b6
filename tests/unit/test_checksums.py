"""The two checksum kinds: xxh3 (host) and wsum32 (what a GPU computes), defined once."""

from __future__ import annotations

import pytest
import torch
from kvstore_connector.transfer import signed, unsigned, wsum32_blocks

from kvstore.blocks import WSUM32, XXH3, BlockMeta, LayerSpec, StoredBlock, wsum32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_the_device_sums_equal_the_host_definition(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (5, 2, 16, 64), dtype=torch.uint8, generator=g)
    blocks = raw.view(dtype) if dtype != torch.uint8 else raw
    got = wsum32_blocks(blocks)
    assert got is not None
    want = [wsum32(blocks[i].contiguous().view(torch.uint8).numpy().tobytes()) for i in range(5)]
    assert [unsigned(v) for v in got.tolist()] == want
    assert [signed(v) for v in want] == got.tolist()


def test_wsum32_notices_any_changed_word_and_word_order() -> None:
    data = bytearray(range(256)) * 16
    base = wsum32(bytes(data))
    for at in (0, 5, 1000, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 0x01
        assert wsum32(bytes(changed)) != base
    swapped = data[4:8] + data[0:4] + data[8:]
    assert wsum32(bytes(swapped)) != base
    assert wsum32(b"\x01\x02\x03") == 0x030201  # a short tail is one zero-padded word


def test_a_block_record_keeps_its_checksum_kind() -> None:
    layers = (LayerSpec("l", "uint8", (8,)),)
    payload = bytes(range(8))
    meta = BlockMeta(b"ns", b"h" * 32, b"", layers, (wsum32(payload),), 1.0, WSUM32)
    again = BlockMeta.from_json(meta.to_json())
    assert again == meta and again.checksum_kind == WSUM32
    assert StoredBlock(again, [memoryview(payload)]).corrupt_layer() is None
    assert StoredBlock(again, [memoryview(payload[::-1])]).corrupt_layer() == 0
    plain = BlockMeta(b"ns", b"h" * 32, b"", layers, (1,), 1.0)
    assert b'"ck"' not in plain.to_json() and BlockMeta.from_json(plain.to_json()).checksum_kind == XXH3

"""kvstore.blocks: the one LayerSpec, and the usable prefix of a read (leading_blocks)."""

from __future__ import annotations

import struct

import pytest

from kvstore import blocks as kb
from kvstore import records, wire
from kvstore.blocks import BlockMeta, LayerSpec, StoredBlock, checksum, leading_blocks


def test_layer_spec_derives_its_size_and_compares_with_a_given_one() -> None:
    derived = LayerSpec("k", "float16", [8, 8])  # type: ignore[arg-type]  # a list becomes a tuple
    assert derived.shape == (8, 8)
    assert derived.nbytes == derived.block_bytes == 128
    assert derived == LayerSpec("k", "float16", (8, 8), 128)
    assert hash(derived) == hash(LayerSpec("k", "float16", (8, 8), 128))


def test_layer_spec_refuses_a_size_its_dtype_and_shape_do_not_make() -> None:
    with pytest.raises(ValueError, match="make 128"):
        LayerSpec("k", "float16", (8, 8), 127)
    with pytest.raises(ValueError, match="not supported"):
        LayerSpec("k", "complex64", (8,))


def test_layer_spec_of_a_tensor() -> None:
    torch = pytest.importorskip("torch")
    spec = LayerSpec.of("v", torch.zeros(3, 2, 4, dtype=torch.bfloat16))
    assert spec == LayerSpec("v", "bfloat16", (2, 4), 16)


def _block(name: bytes, layers: tuple[LayerSpec, ...], *, corrupt: bool = False) -> StoredBlock:
    data = [memoryview(bytes([i + 1]) * spec.nbytes) for i, spec in enumerate(layers)]
    sums = tuple(checksum(view) ^ (1 if corrupt else 0) for view in data)
    return StoredBlock(BlockMeta(b"ns", name.ljust(32, b"\0"), b"", layers, sums), data)


A = (LayerSpec("k", "uint8", (4,)), LayerSpec("v", "uint8", (2,)))
B = (LayerSpec("k", "uint8", (2, 2)), LayerSpec("v", "uint8", (2,)))


def test_leading_blocks_stops_at_a_missing_block() -> None:
    blocks = [_block(b"a", A), _block(b"b", A), None, _block(b"d", A)]
    prefix = leading_blocks(blocks)
    assert prefix.blocks == blocks[:2] and prefix.stop == "missing" and prefix.layers == A


def test_leading_blocks_stops_at_another_layout() -> None:
    blocks = [_block(b"a", A), _block(b"b", B)]
    prefix = leading_blocks(blocks)
    assert prefix.blocks == blocks[:1] and prefix.stop == "layout"


def test_leading_blocks_verifies_unless_told_not_to() -> None:
    blocks = [_block(b"a", A), _block(b"b", A, corrupt=True)]
    prefix = leading_blocks(blocks)
    assert prefix.blocks == blocks[:1] and prefix.stop == "corrupt" and prefix.bad_layer == 0
    unverified = leading_blocks(blocks, verify=False)
    assert unverified.blocks == blocks and unverified.stop is None


def test_leading_blocks_of_nothing() -> None:
    prefix = leading_blocks([])
    assert prefix.blocks == [] and prefix.stop is None and prefix.layers == ()


def test_a_prefix_says_why_it_stopped_as_a_stop_reason() -> None:
    full = leading_blocks([_block(b"a", A)])
    assert full.stop_reason() == kb.STOP_NONE
    missing = leading_blocks([_block(b"a", A), None])
    assert missing.stop_reason() == kb.STOP_NOT_STORED  # to a reader of the files
    assert (
        missing.stop_reason(missing=kb.STOP_EVICTED) == kb.STOP_EVICTED
    )  # to the daemon, whose index had it
    assert leading_blocks([_block(b"a", A), _block(b"b", B)]).stop_reason() == kb.STOP_LAYER_SET_DIFFERS
    corrupt = leading_blocks([_block(b"a", A, corrupt=True)])
    assert corrupt.stop_reason() == kb.STOP_CHECKSUM_FAILED


def test_every_stop_reason_has_its_wire_value_and_back() -> None:
    names = {value for key, value in vars(kb).items() if key.startswith("STOP_")} - {kb.STOP_UNKNOWN}
    assert set(wire.STOP_REASONS) == names
    assert len(set(wire.STOP_REASONS.values())) == len(names)
    for name, value in wire.STOP_REASONS.items():
        assert wire.stop_reason_name(value) == name
    # a daemon that does not say (UNSPECIFIED), or says what this side does not know
    assert wire.stop_reason_name(0) == wire.stop_reason_name(999) == kb.STOP_UNKNOWN


def test_packed_checksums_read_as_the_integers_they_pack() -> None:
    sums = (0, 1, 2**64 - 1, 0x0123456789ABCDEF)
    packed = kb.PackedSums(struct.pack("<4Q", *sums))
    assert len(packed) == 4 and list(packed) == list(sums)
    assert packed[2] == 2**64 - 1 and packed[-1] == sums[-1] and packed[1:3] == sums[1:3]
    assert packed == sums and sums == packed and packed == list(sums)
    assert packed != sums[:3] and packed != (*sums[:3], 5) and packed != "not sums"
    assert hash(packed) == hash(sums) and packed == kb.PackedSums(packed.packed)
    with pytest.raises(IndexError):
        packed[4]
    with pytest.raises(ValueError, match="whole number"):
        kb.PackedSums(b"\x00" * 12)


def test_a_parsed_record_keeps_its_checksums_packed_and_equal_to_the_written_ones() -> None:
    layers = (LayerSpec("k", "uint8", (16,)), LayerSpec("v", "uint8", (16,)))
    meta = BlockMeta(b"ns", b"h" * 32, b"p" * 32, layers, (checksum(b"a"), checksum(b"b")), 12.5)
    raw, layout = records.pack((1, 2, 3), meta)
    back = records.parse(records.index_key(b"ns", b"h" * 32), raw, {layout.digest: layers})
    assert isinstance(back.meta.checksums, kb.PackedSums)
    assert back.meta == meta and back.where == (1, 2, 3) and back.sums == records.pack_sums(meta.checksums)
    assert records.pack(back.where, back.meta)[0] == raw  # written back unchanged
    with pytest.raises(records.BAD_RECORD):
        records.parse(records.index_key(b"ns", b"h" * 32), raw[:-1], {layout.digest: layers})


def test_a_record_is_checked_whole_when_parsed_though_its_meta_is_made_later() -> None:
    """parse reads where and layers and checks the rest (kind, layout, length) at once; a
    record of an unknown kind or layout, or too short, fails there, not when its meta is
    first used. The meta made later is the written one, from bytes the parse copied."""
    layers = (LayerSpec("k", "uint8", (16,)), LayerSpec("v", "uint8", (16,)))
    meta = BlockMeta(b"ns", b"h" * 32, b"", layers, (7, 8), 3.0, kb.WSUM32)
    raw, layout = records.pack((4, 5, 6), meta)
    key = records.index_key(b"ns", b"h" * 32)
    buffer = bytearray(raw)
    back = records.parse(key, memoryview(buffer), {layout.digest: layers})
    assert back.where == (4, 5, 6) and back.layers is layers
    buffer[:] = bytes(len(buffer))  # the caller's buffer reused (an LMDB transaction ended)
    assert back.meta == meta and back.meta.checksum_kind == kb.WSUM32 and back.meta is back.meta
    bad_kind = bytearray(raw)
    bad_kind[records._HEAD.size - 10] = 9  # the kind's code
    with pytest.raises(IndexError):
        records.parse(key, bytes(bad_kind), {layout.digest: layers})
    with pytest.raises(KeyError):
        records.parse(key, raw, {})
    with pytest.raises(ValueError, match="too short"):
        records.parse(key, raw[:-8], {layout.digest: layers})

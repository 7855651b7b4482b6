"""kvstore_client.hashing: the chained block keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from kvstore_client.hashing import HASH_BYTES, MultiModalInput, block_hashes, root_hash

BS = 4
TOKENS = list(range(100, 124))  # 24 tokens = 6 full blocks of 4


def reference(namespace: bytes, tokens: list[int], block_size: int, extras_by_block=None) -> list[bytes]:
    """Independent implementation of the formula in the module docstring."""

    def field(tag: bytes, value: bytes) -> bytes:
        return tag + struct.pack("<I", len(value)) + value

    prev = hashlib.sha256(field(b"kvstore-root-v1", namespace)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        payload = (
            b"kvstore-block-v1"
            + prev
            + struct.pack("<I", block_size)
            + struct.pack(f"<{block_size}I", *block)
        )
        payload += (extras_by_block or {}).get(i, b"")
        prev = hashlib.sha256(payload).digest()
        out.append(prev)
    return out


def test_matches_documented_formula() -> None:
    assert block_hashes(b"ns", TOKENS, BS) == reference(b"ns", TOKENS, BS)
    salt = b"salt" + struct.pack("<I", 3) + b"abc"
    assert block_hashes(b"ns", TOKENS, BS, cache_salt="abc") == reference(b"ns", TOKENS, BS, {0: salt})


def test_hashes_are_32_bytes_and_distinct() -> None:
    hashes = block_hashes("ns", TOKENS, BS)
    assert len(hashes) == 6
    assert all(isinstance(x, bytes) and len(x) == HASH_BYTES for x in hashes)
    assert len(set(hashes)) == 6


def test_str_and_bytes_namespace_agree_and_namespaces_differ() -> None:
    assert block_hashes("ns", TOKENS, BS) == block_hashes(b"ns", TOKENS, BS)
    assert root_hash("ns") == root_hash(b"ns")
    other = block_hashes("other", TOKENS, BS)
    assert not set(other) & set(block_hashes("ns", TOKENS, BS))


def test_repeated_block_content_gives_different_hashes() -> None:
    # identical token blocks at different positions are different keys (the chain)
    hashes = block_hashes("ns", [7] * 12, BS)
    assert len(set(hashes)) == 3


_SUBPROCESS_CODE = (
    "from kvstore_client.hashing import block_hashes, MultiModalInput;"
    "print(','.join(x.hex() for x in block_hashes('ns', list(range(100, 124)), 4, "
    "mm_inputs=[MultiModalInput('img-1', 5, 6)], cache_salt='s', lora_name='lora-a')))"
)


def test_deterministic_across_processes_with_different_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_CODE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.append(proc.stdout.strip())
    here = ",".join(
        x.hex()
        for x in block_hashes(
            "ns", TOKENS, BS, mm_inputs=[MultiModalInput("img-1", 5, 6)], cache_salt="s", lora_name="lora-a"
        )
    )
    assert outputs[0] == outputs[1] == here
    assert len(here.split(",")) == 6


@pytest.mark.parametrize("start_block", [1, 2, 5])
def test_chain_continuation_equals_whole_prompt(start_block: int) -> None:
    kwargs = dict(mm_inputs=[MultiModalInput("img", 6, 9)], cache_salt="salty", lora_name="lora")
    whole = block_hashes("ns", TOKENS, BS, **kwargs)
    rest = block_hashes(
        "ns",
        TOKENS[start_block * BS :],
        BS,
        parent=whole[start_block - 1],
        start_block=start_block,
        **kwargs,
    )
    assert rest == whole[start_block:]


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes("ns", TOKENS[:3], BS) == []
    assert block_hashes("ns", [], BS) == []
    partial = block_hashes("ns", TOKENS[:10], BS)
    assert len(partial) == 2
    assert partial == block_hashes("ns", TOKENS[:8], BS)
    # a trailing partial block never changes the full ones before it
    assert block_hashes("ns", TOKENS[:11], BS) == partial


def test_cache_salt_changes_block_zero_and_hence_all() -> None:
    plain = block_hashes("ns", TOKENS, BS)
    salted = block_hashes("ns", TOKENS, BS, cache_salt="tenant-1")
    other = block_hashes("ns", TOKENS, BS, cache_salt="tenant-2")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert all(a != b for a, b in zip(salted, other, strict=True))
    # The salt enters block 0 only: later blocks differ only through the chain,
    # so continuing from the salted block 0 without a salt gives the salted chain.
    assert block_hashes("ns", TOKENS[BS:], BS, parent=salted[0], start_block=1) == salted[1:]
    # the empty salt is no salt
    assert block_hashes("ns", TOKENS, BS, cache_salt="") == plain


def test_different_images_at_same_offset_differ_but_earlier_blocks_do_not() -> None:
    # image placeholders cover tokens 9..14 -> blocks 2 and 3
    a = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("image-A", 9, 6)])
    b = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("image-B", 9, 6)])
    plain = block_hashes("ns", TOKENS, BS)
    assert a[:2] == b[:2] == plain[:2]
    for i in range(2, 6):
        assert a[i] != b[i]
        assert a[i] != plain[i]


def test_image_position_and_length_are_part_of_the_key() -> None:
    base = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("img", 8, 4)])  # block 2 only
    moved = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("img", 9, 3)])
    longer = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("img", 8, 5)])  # blocks 2 and 3
    assert base[:2] == moved[:2] == longer[:2]
    assert base[2] != moved[2]
    assert base[2] != longer[2]


def test_image_ending_at_block_boundary_leaves_next_block_alone() -> None:
    # tokens 4..7 are exactly block 1; block 2 only differs via the chain
    with_img = block_hashes("ns", TOKENS, BS, mm_inputs=[MultiModalInput("img", 4, 4)])
    plain = block_hashes("ns", TOKENS, BS)
    assert with_img[0] == plain[0]
    assert with_img[1] != plain[1]
    assert block_hashes("ns", TOKENS[2 * BS :], BS, parent=with_img[1], start_block=2) == with_img[2:]


def test_mm_input_order_does_not_matter() -> None:
    items = [MultiModalInput("x", 2, 3), MultiModalInput("y", 13, 2)]
    assert block_hashes("ns", TOKENS, BS, mm_inputs=items) == block_hashes(
        "ns", TOKENS, BS, mm_inputs=items[::-1]
    )


def test_lora_name_changes_every_block() -> None:
    plain = block_hashes("ns", TOKENS, BS)
    a = block_hashes("ns", TOKENS, BS, lora_name="adapter-a")
    b = block_hashes("ns", TOKENS, BS, lora_name="adapter-b")
    assert all(x != y for x, y in zip(plain, a, strict=True))
    assert all(x != y for x, y in zip(a, b, strict=True))
    # LoRA enters every block, not only through the chain
    assert block_hashes("ns", TOKENS[BS:], BS, parent=a[0], start_block=1) != a[1:]
    assert block_hashes("ns", TOKENS[BS:], BS, parent=a[0], start_block=1, lora_name="adapter-a") == a[1:]


def test_block_size_is_part_of_the_hash() -> None:
    by4 = block_hashes("ns", TOKENS, 4)
    by8 = block_hashes("ns", TOKENS, 8)
    assert not set(by4) & set(by8)
    # Same previous hash and the same tokens; only the size field could tell
    # these apart, so hashing without it must not reproduce the key.
    tokens = TOKENS[:8]
    without_size = hashlib.sha256(
        b"kvstore-block-v1" + root_hash("ns") + struct.pack("<8I", *tokens)
    ).digest()
    assert block_hashes("ns", tokens, 8) == reference(b"ns", tokens, 8)
    assert block_hashes("ns", tokens, 8)[0] != without_size


def test_token_range_is_uint32() -> None:
    assert len(block_hashes("ns", [0, 1, 2, 2**32 - 1], BS)) == 1


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [0, 0, 0, 2**32], [0, 2**40, 0, 0]])
def test_invalid_token_ids_raise_value_error(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token ids"):
        block_hashes("ns", bad, BS)


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes("ns", TOKENS, block_size)


def test_parent_must_be_a_full_hash() -> None:
    with pytest.raises(ValueError, match="32-byte"):
        block_hashes("ns", TOKENS, BS, parent=b"short", start_block=1)


@pytest.mark.parametrize(("offset", "length"), [(-1, 4), (0, 0), (3, -2)])
def test_multimodal_input_validation(offset: int, length: int) -> None:
    with pytest.raises(ValueError, match="offset"):
        MultiModalInput("img", offset, length)

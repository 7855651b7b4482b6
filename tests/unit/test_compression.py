"""kvstore_connector.compression: fp8 and int8 block codecs, against bounds derived from the formats.

fp8 (e4m3fn, 3 mantissa bits): a code is within half an ulp of x / scale, 2**-4 relative
for normals; below e4m3's smallest normal (2**-6) the step is 2**-9, so at most 2**-10
code units. int8: round to nearest, at most half a code. Both then scale in float32 (a
few 2**-24 relative) and cast to the output dtype (its eps relative, generously).
"""

from __future__ import annotations

import struct

import pytest
import torch
from kvstore_connector import compression
from kvstore_connector.compression import CODECS, Codec, make_codec, stored_kv_dtype_is_fp8

SHAPE = (32, 64)  # [block_size, 2 * head_size], small
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
QMAX = {"fp8": 448.0, "int8": 127.0}
F32_SLACK = 2.0**-20  # float32 division and product: a few 2**-24 relative, with room


def codec(name: str) -> Codec:
    c = make_codec(name)
    if c is None:
        raise AssertionError(f"no codec for {name}")
    return c


def stored_scales(packed: torch.Tensor) -> torch.Tensor:
    """Each row's scale, read as the little-endian float32 of its first four bytes."""
    return torch.tensor(
        [struct.unpack("<f", bytes(row[:4].tolist()))[0] for row in packed], dtype=torch.float64
    )


def bound(name: str, x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The largest |x - decode(encode(x))| the formats allow, per element (float64).

    x: [n, m] float64 of the encoded values; scale: [n] float64."""
    ax = x.abs()
    s = scale[:, None]
    if name == "fp8":
        quant = torch.maximum(ax * 2.0**-4, s * 2.0**-10)
    else:
        quant = s / 2
    out_rounding: torch.Tensor | float = 0.0
    if out_dtype != torch.float32:  # eps relative, and its subnormals' step below its smallest normal
        info = torch.finfo(out_dtype)
        out_rounding = ax * info.eps + info.smallest_normal * info.eps
    return quant + ax * F32_SLACK + out_rounding


def data(kind: str, dtype: torch.dtype, n: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *SHAPE), generator=g, dtype=torch.float32)
    if kind == "outliers":  # a few large elements per row: the rest fall into fp8's subnormals
        flat = x.view(n, -1)
        idx = torch.randint(0, flat.shape[1], (n, 3), generator=g)
        flat.scatter_(1, idx, torch.randn((n, 3), generator=g) * 300)
    elif kind == "magnitudes":  # rows from 1e-4 to 1e4: each with its own scale
        x *= torch.logspace(-4, 4, n)[:, None, None]
    limit = 6e4 if dtype == torch.float16 else None  # fp16's range
    if limit is not None:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def check_round_trip(name: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    c = codec(name)
    packed = c.encode(x)
    y = c.decode(packed, out_dtype, x.shape[1:])
    assert y.shape == x.shape and y.dtype == out_dtype
    x64 = x.reshape(len(x), -1).double()
    err = (y.reshape(len(x), -1).double() - x64).abs()
    scale = stored_scales(packed)
    limit = bound(name, x64, scale, out_dtype)
    worst = (err - limit).max().item()
    assert worst <= 0, f"error over the bound by {worst} (max error {err.max().item()})"
    return packed


# ---- the factory
def test_make_codec_names() -> None:
    assert CODECS == ("none", "fp8", "int8")
    assert make_codec("none") is None
    assert [codec(n).name for n in ("fp8", "int8")] == ["fp8", "int8"]
    with pytest.raises(ValueError, match="'none', 'fp8', 'int8'"):
        make_codec("fp4")
    with pytest.raises(ValueError, match="compression must be one of"):
        make_codec("FP8")


def test_stored_kv_dtype_is_fp8() -> None:
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        assert stored_kv_dtype_is_fp8(dtype)
    assert stored_kv_dtype_is_fp8(torch.uint8)  # how vLLM holds kv_cache_dtype=fp8
    for dtype in (*FLOATS, torch.float64, torch.int32, torch.bool):
        assert not stored_kv_dtype_is_fp8(dtype)


# ---- round trips within the formats' bounds
@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", ["normal", "outliers", "magnitudes"])
def test_round_trip_within_bounds(name: str, dtype: torch.dtype, kind: str) -> None:
    check_round_trip(name, data(kind, dtype), dtype)


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])  # fmt: skip
def test_decode_to_another_dtype(name: str, dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    check_round_trip(name, data("normal", dtype) * 0.5, out_dtype)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_error_is_of_the_expected_size(name: str) -> None:
    """The bound is not vacuous: the codec does lose about what its format says, no more."""
    x = data("normal", torch.float32, n=8)
    c = codec(name)
    y = c.decode(c.encode(x), torch.float32, SHAPE)
    rel = ((y - x).abs() / x.abs().amax(dim=(1, 2), keepdim=True)).mean().item()
    # mean error over amax: int8 uniform rounding ~ 1/(4*127); fp8 ~ 2**-5 * mean|x|/amax
    expected = 1 / (4 * 127) if name == "int8" else 2.0**-5 * 0.8 / 4.0
    assert expected / 3 < rel < expected * 3, rel


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_each_row_has_its_own_scale(name: str) -> None:
    x = data("magnitudes", torch.float32, n=9)
    c = codec(name)
    packed = c.encode(x)
    expected = x.reshape(9, -1).abs().amax(dim=1).double() / QMAX[name]
    assert torch.allclose(stored_scales(packed), expected, rtol=2**-22, atol=0)
    # a huge row beside a small one changes nothing of the small one's bytes
    for i in range(9):
        assert torch.equal(packed[i], c.encode(x[i : i + 1])[0])
    # and its error stays relative to its own magnitude
    y = c.decode(packed, torch.float32, SHAPE)
    rel = (y - x).abs().amax(dim=(1, 2)) / x.abs().amax(dim=(1, 2))
    assert rel.max().item() <= (2.0**-4 if name == "fp8" else 1 / 254) * (1 + 1e-5)


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_zeros_round_trip_to_zeros(name: str, dtype: torch.dtype) -> None:
    x = torch.zeros((3, *SHAPE), dtype=dtype)
    x[1] = -0.0
    c = codec(name)
    packed = c.encode(x)
    assert stored_scales(packed).tolist() == [1.0, 1.0, 1.0]
    assert torch.count_nonzero(packed[:, 4:]).item() in (0, x[1].numel())  # -0.0 may keep its sign bit
    assert torch.equal(c.decode(packed, dtype, SHAPE).abs(), x.abs())


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_max_magnitude_element_is_reproduced(name: str, dtype: torch.dtype) -> None:
    x = data("outliers", dtype, n=6)
    c = codec(name)
    y = c.decode(c.encode(x), torch.float32, SHAPE)
    flat_x, flat_y = x.reshape(6, -1).float(), y.reshape(6, -1)
    at = flat_x.abs().argmax(dim=1, keepdim=True)
    # amax / scale is qmax up to float32 rounding, whose code is exact: amax comes back
    assert torch.allclose(flat_y.gather(1, at), flat_x.gather(1, at), rtol=2**-21, atol=0)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_signs_are_kept(name: str) -> None:
    x = data("outliers", torch.float32)
    c = codec(name)
    y = c.decode(c.encode(x), torch.float32, SHAPE)
    assert bool(((y.sign() == x.sign()) | (y == 0)).all())
    # what is not rounded to zero keeps its sign, and the large values all stay nonzero
    scale = x.abs().amax(dim=(1, 2), keepdim=True) / QMAX[name]
    large = x.abs() > scale
    assert bool((y.sign() == x.sign())[large].all())


def test_tiny_rows_stay_finite_and_within_bounds() -> None:
    # rows whose amax / qmax would underflow float32: the scale is clamped to float32's tiny
    x = torch.full((2, *SHAPE), 1e-42, dtype=torch.float32)
    x[1, 0, 0] = -3e-40
    for name in ("fp8", "int8"):
        packed = check_round_trip(name, x, torch.float32)
        assert bool((stored_scales(packed) > 0).all())


def test_int8_codes_are_symmetric() -> None:
    x = data("outliers", torch.float32)
    codes = codec("int8").encode(x)[:, 4:].view(torch.int8)
    assert codes.min().item() == -127 or codes.max().item() == 127
    assert codes.min().item() >= -127


# ---- the packed layout
@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_packed_layout(name: str, dtype: torch.dtype) -> None:
    x = data("normal", dtype, n=4)
    c = codec(name)
    packed = c.encode(x)
    numel = SHAPE[0] * SHAPE[1]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (4, 4 + numel)
    assert c.stored_shape(SHAPE) == (4 + numel,)
    scale = stored_scales(packed)
    x64 = x.reshape(4, -1).double()
    assert torch.allclose(scale, x64.abs().amax(dim=1) / QMAX[name], rtol=2**-22, atol=0)
    # exactly float32's amax / qmax (a true division: the same bytes on every device)
    amax32 = x.reshape(4, -1).abs().amax(dim=1).float()
    assert torch.equal(scale.float(), amax32 / torch.full_like(amax32, QMAX[name]))
    # then one code per element, in x's element order
    codes = packed[:, 4:].view(torch.float8_e4m3fn if name == "fp8" else torch.int8).double()
    units = x64 / scale[:, None]
    if name == "int8":
        # float32's x / scale may fall on the other side of a .5 than float64's
        assert bool(((codes - units).abs() <= 0.5 + units.abs() * F32_SLACK).all())
        assert (codes == units.round()).double().mean().item() > 0.99
    else:
        assert bool(((codes - units).abs() <= torch.maximum(units.abs() * 2.0**-4, torch.tensor(2.0**-10))
                     + units.abs() * F32_SLACK).all())  # fmt: skip


@pytest.mark.parametrize("dtype", FLOATS)
def test_stored_bytes_are_about_half_of_bf16(dtype: torch.dtype) -> None:
    x = data("normal", dtype, n=2)
    packed = codec("fp8").encode(x)
    per_block = packed[0].numel()
    assert per_block == 4 + SHAPE[0] * SHAPE[1]
    bf16_bytes = SHAPE[0] * SHAPE[1] * 2
    assert 0.5 < per_block / bf16_bytes < 0.51
    assert per_block / (x[0].numel() * x.element_size()) <= 0.51  # a quarter for fp32


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("fill", [0, 255])
def test_encode_into_writes_the_bytes_of_encode(name: str, fill: int) -> None:
    x = data("outliers", torch.bfloat16, n=5)
    c = codec(name)
    out = torch.full((5, 4 + SHAPE[0] * SHAPE[1]), fill, dtype=torch.uint8)
    assert c.encode_into(x, out) is out
    assert torch.equal(out, c.encode(x))


def test_cpu_slices_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    x = data("magnitudes", torch.bfloat16, n=10)
    for name in ("fp8", "int8"):
        whole = codec(name).encode(x)
        decoded = codec(name).decode(whole, torch.float32, SHAPE)
        monkeypatch.setattr(compression, "_CPU_CHUNK_ELEMENTS", 3 * SHAPE[0] * SHAPE[1])  # 3 rows a slice
        assert torch.equal(codec(name).encode(x), whole)
        assert torch.equal(codec(name).decode(whole, torch.float32, SHAPE), decoded)
        monkeypatch.undo()


def test_non_contiguous_and_empty_input() -> None:
    c = codec("fp8")
    x = data("normal", torch.float32, n=4)
    t = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
    assert not t.is_contiguous()
    assert torch.equal(c.encode(t), c.encode(x))
    empty = c.encode(torch.zeros((0, *SHAPE)))
    assert tuple(empty.shape) == (0, 4 + SHAPE[0] * SHAPE[1])
    assert tuple(c.decode(empty, torch.bfloat16, SHAPE).shape) == (0, *SHAPE)


# ---- validation at the edge
def test_encode_refuses_what_it_cannot_encode() -> None:
    c = codec("int8")
    with pytest.raises(ValueError, match="not torch.int32"):
        c.encode(torch.zeros((2, *SHAPE), dtype=torch.int32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        c.encode(torch.zeros((2, *SHAPE)).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"\[n, \*shape\]"):
        c.encode(torch.zeros(16))
    with pytest.raises(ValueError, match="torch.Tensor"):
        c.encode([[1.0]])  # type: ignore[arg-type]


def test_encode_into_refuses_a_wrong_buffer() -> None:
    c = codec("fp8")
    x = data("normal", torch.bfloat16, n=3)
    P = 4 + SHAPE[0] * SHAPE[1]
    with pytest.raises(ValueError, match="out must be uint8"):
        c.encode_into(x, torch.empty((3, P - 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be uint8"):
        c.encode_into(x, torch.empty((3, P), dtype=torch.int8))
    with pytest.raises(ValueError, match="out must be uint8"):
        c.encode_into(x, torch.empty((2, P), dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        c.encode_into(x, torch.empty((P, 3), dtype=torch.uint8).t())


def test_decode_refuses_a_wrong_packing() -> None:
    c = codec("fp8")
    packed = c.encode(data("normal", torch.bfloat16, n=3))
    with pytest.raises(ValueError, match="do not hold fp8 blocks"):
        c.decode(packed, torch.bfloat16, (32, 32))
    with pytest.raises(ValueError, match="do not hold fp8 blocks"):
        c.decode(packed[:, 1:], torch.bfloat16, SHAPE)
    with pytest.raises(ValueError, match="2-d uint8"):
        c.decode(packed.view(torch.int8), torch.bfloat16, SHAPE)
    with pytest.raises(ValueError, match="2-d uint8"):
        c.decode(packed.reshape(-1), torch.bfloat16, SHAPE)
    with pytest.raises(ValueError, match="not torch.int8"):
        c.decode(packed, torch.int8, SHAPE)
    with pytest.raises(ValueError, match="positive integers"):
        c.stored_shape((32, 0))

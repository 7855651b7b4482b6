"""kvstore_client.tensors: dtype names and zero-copy byte views."""

from __future__ import annotations

import pytest
import torch

from kvstore.wire import DTYPES
from kvstore_client.tensors import byte_view, dtype_name, torch_dtype, writable_view

TORCH_DTYPES = [name for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]


def test_this_torch_has_the_dtypes_that_matter() -> None:
    assert {"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"} <= set(TORCH_DTYPES)


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_dtype_round_trip(name: str) -> None:
    dtype = torch_dtype(name)
    assert isinstance(dtype, torch.dtype)
    assert dtype_name(dtype) == name
    # the wire's element size agrees with torch
    assert torch.empty((), dtype=dtype).element_size() == DTYPES[name][0]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fnuz, torch.quint8])
def test_unsupported_torch_dtypes(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="not supported"):
        dtype_name(dtype)


@pytest.mark.parametrize("name", ["complex64", "float", "Tensor", "nn", "", "BF16"])
def test_unsupported_names(name: str) -> None:
    # names that torch has as attributes but the wire does not carry are refused too
    with pytest.raises(ValueError, match=repr(name).replace("(", r"\(")):
        torch_dtype(name)


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_byte_view_is_zero_copy(name: str) -> None:
    dtype = torch_dtype(name)
    tensor = torch.zeros((3, 4), dtype=dtype)
    view = byte_view(tensor)
    assert isinstance(view, memoryview)
    assert view.format == "B" and view.ndim == 1
    assert view.nbytes == tensor.nbytes
    assert bytes(view) == bytes(tensor.nbytes)
    # writes through the tensor show in the view: same memory
    tensor.view(torch.uint8).view(-1)[5] = 0x3C
    assert view[5] == 0x3C
    raw = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    assert torch.equal(raw, tensor.reshape(-1).view(torch.uint8))


def test_byte_view_of_bf16_values() -> None:
    tensor = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    view = byte_view(tensor)
    assert bytes(view) == bytes.fromhex("803f00c0003f")  # little-endian bf16
    back = torch.frombuffer(bytearray(view), dtype=torch.bfloat16)
    assert torch.equal(back, tensor)


def test_byte_view_of_a_contiguous_slice_starts_at_the_slice() -> None:
    base = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    part = base[1:3]
    assert part.is_contiguous() and part.storage_offset() == 3
    view = byte_view(part)
    assert view.nbytes == 6 * 4
    assert bytes(view) == part.numpy().tobytes()
    base[1, 0] = 99
    assert int.from_bytes(view[:4], "little") == 99


def test_byte_view_of_empty_and_scalar_tensors() -> None:
    assert byte_view(torch.empty(0, 8, dtype=torch.float16)).nbytes == 0
    assert bytes(byte_view(torch.tensor(7, dtype=torch.int16))) == (7).to_bytes(2, "little")


def test_byte_view_refuses_non_contiguous() -> None:
    tensor = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(tensor.t())
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(tensor[:, ::2])


def test_byte_view_refuses_non_cpu_tensors() -> None:
    tensor = torch.empty(4, 4, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        byte_view(tensor)


def test_writable_view_fills_the_tensor() -> None:
    tensor = torch.zeros(2, 3, dtype=torch.float8_e4m3fn)
    dest = writable_view(tensor)
    assert dest.nbytes == tensor.nbytes
    dest[:] = 0x38  # 1.0 in float8_e4m3fn
    assert torch.equal(tensor.float(), torch.ones(2, 3))
    with pytest.raises(ValueError, match="contiguous CPU"):
        writable_view(torch.zeros(3, 3).t())
    with pytest.raises(ValueError, match="contiguous CPU"):
        writable_view(torch.empty(3, device="meta"))

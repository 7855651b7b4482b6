"""torch <-> wire: dtype names and zero-copy byte views of tensors.

Only this module and streams.py's tensor methods import torch (lazily); hashing
and the CLI work without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.wire import DTYPES

if TYPE_CHECKING:
    import numpy as np
    import torch


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None) if name in DTYPES else None
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not supported by this torch")
    return dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.device.type != "cpu":
        raise ValueError("tensor must be on the CPU; copy device tensors to (pinned) host memory first")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    import torch

    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer


def writable_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory, for filling it."""
    import torch

    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("destination must be a contiguous CPU tensor")
    return tensor.reshape(-1).view(torch.uint8).numpy()

"""torch <-> wire: dtype names and zero-copy byte views of tensors.

Only this module, streams.py's tensor methods and arena/'s device paths import
torch, lazily (tests/unit/test_imports.py): hashing and the CLI work without it.
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


def copy_into(dest: torch.Tensor, src: torch.Tensor) -> None:
    """dest.copy_(src); between contiguous CPU tensors of one size, on this thread alone
    (numpy, the GIL released). torch splits a CPU copy over its intra-op threads and
    waits for the last: with the cores busy (a daemon writing behind on the other core
    of a small host), a copy into the arena ran 5-10x slower than on one thread."""
    if (
        dest.device.type == "cpu"
        and src.device.type == "cpu"
        and dest.is_contiguous()
        and src.is_contiguous()
        and dest.nbytes == src.nbytes
        and dest.dtype == src.dtype
    ):
        import numpy as np

        np.copyto(writable_view(dest), writable_view(src))
        return
    dest.copy_(src)

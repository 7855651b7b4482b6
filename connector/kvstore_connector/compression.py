"""Opt-in codecs for KV blocks: one byte per element and one float32 scale per block row.

    make_codec(name)              "none" -> None, "fp8" / "int8" -> a Codec (CODECS lists them)
    Codec.stored_shape(shape)     the stored per-block shape: (4 + prod(shape),) of uint8
    Codec.encode(x)               [n, *shape] float -> [n, P] uint8, on x's device
    Codec.encode_into(x, out)     the same, written into a given uint8 [n, P] (arena, pinned buffer)
    Codec.decode(packed, dtype, shape)  [n, P] uint8 -> [n, *shape] of dtype, on packed's device
    stored_kv_dtype_is_fp8(dtype) the KV is one byte per element already: never quantize it again

What is stored. The connector keeps KV as store layers, each one (attention layer,
KV head) pair; one block of one store layer is a tensor of `shape` (e.g.
[block_size, 2 * head_size]). Compressed, that block is one row of P = 4 + prod(shape)
bytes: bytes 0..3 hold the row's scale as a little-endian float32, then one code byte
per element in the element order of the block (x.reshape(-1)). A stored bf16 block
thus takes about half its bytes (a fp32 one a quarter). Everything is computed in
float32 and on the tensors' own device, in whole-batch tensor operations: no loop over
blocks, no host synchronisation on CUDA.

  fp8   scale = amax(|row|) / 448 (e4m3's largest finite value), code = e4m3fn(x / scale)
        rounded to nearest even after a clamp to +-448 (saturating, never NaN).
        |x - decode(encode(x))| <= max(|x| * 2**-4, scale * 2**-10): 3 mantissa bits give
        a relative error of half an ulp, 2**-4, down to e4m3's smallest normal (2**-6 in
        code units); below it the step is 2**-9 code units, so at most 2**-10 * scale.
  int8  symmetric: scale = amax(|row|) / 127, code = round(x / scale) in [-127, 127]
        (-128 is never used), stored as its two's-complement byte.
        |x - decode(encode(x))| <= scale / 2 = amax / 254, the same for every element.

Both: a row of zeros gets scale 1 (and decodes to zeros); a row's largest element is
reproduced within the bound (fp8: within 2**-4 of it, usually exactly; int8: exactly up to
float32 rounding); signs are kept (a code is 0 or has the sign of x). Decoding to bf16 or
fp16 adds that dtype's own rounding (|x| * its eps / 2) on top; float32 arithmetic adds a
few 2**-24 relative. Non-finite input (inf, NaN) gives non-finite or meaningless rows: KV
of a working model is finite, and checking it would cost a host synchronisation.

NOTE: per block row, not per tensor or per layer. One scale per block of one store layer
(one layer, one head) keeps a block self-contained: it is stored, evicted and loaded
alone, its scale is known when it is saved (no statistics across requests or time), and
an outlier in one head or one block of tokens costs precision only there, not in every
block of the layer. Four bytes per row of thousands of elements cost < 0.1%.
"""

from __future__ import annotations

import abc
import math
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

CODECS = ("none", "fp8", "int8")
"""The values of the connector's "compression" setting; "none" stores KV as it is."""

SCALE_BYTES = 4
"""The float32 scale at the start of each stored row."""

_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_INT8_MAX = 127.0
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # smallest normal: a scale never underflows to 0
# CPU: rows are encoded and decoded in slices of about this many elements, so that the
# float32 temporaries stay in cache: 2x the GB/s of one pass over 64 MiB on 2 cores
_CPU_CHUNK_ELEMENTS = 1 << 20
_LITTLE_ENDIAN = sys.byteorder == "little"


def stored_kv_dtype_is_fp8(dtype: torch.dtype) -> bool:
    """Whether KV of `dtype` is already one byte per element (fp8): then it is never quantized.

    True for every 1-byte float (float8_e4m3fn, float8_e5m2, their fnuz forms, ...) and for
    the 1-byte integer dtypes too: vLLM keeps a kv_cache_dtype=fp8 cache in torch.uint8
    tensors on most backends (vllm.utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE["fp8"]), and
    a byte per element has nothing left to gain from a codec.
    """
    return dtype.itemsize == 1 and dtype != torch.bool


def _numel(shape: Sequence[int]) -> int:
    if not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"a block shape is positive integers, not {tuple(shape)!r}")
    return math.prod(shape)


def _row_step(device: torch.device, row_elements: int, n: int) -> int:
    """How many rows one slice of an encode or decode takes: all of them on a device (one
    pass, no launches per slice), about _CPU_CHUNK_ELEMENTS elements on the CPU."""
    if device.type != "cpu":
        return max(1, n)
    return max(1, _CPU_CHUNK_ELEMENTS // row_elements)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """[n, 1] float32 -> [n, 4] uint8 of its little-endian bytes."""
    raw = scale.view(torch.uint8)
    return raw if _LITTLE_ENDIAN else raw.flip(-1)


class Codec(abc.ABC):
    """A per-row quantizer to one byte per element; fp8 and int8 below differ only in their
    code type and rounding. Stateless: one instance may serve every layer and thread."""

    name: str = ""
    qmax: float = 1.0
    """The largest code magnitude: a row's amax maps to it."""
    code_dtype: torch.dtype = torch.uint8

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ---- what subclasses define
    @abc.abstractmethod
    def _quantize_into(self, y: torch.Tensor, codes: torch.Tensor) -> None:
        """Round `y` (float32 values in code units, may be modified) into `codes` (a view of
        the packed rows' code bytes as self.code_dtype)."""

    # ---- the contract
    def stored_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The stored per-block shape for blocks of `shape`: (4 + prod(shape),), uint8."""
        return (SCALE_BYTES + _numel(shape),)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[n, *shape] floats -> [n, 4 + prod(shape)] uint8 on x's device (see the module)."""
        rows = self._rows(x)
        out = torch.empty((rows.shape[0], SCALE_BYTES + rows.shape[1]), dtype=torch.uint8, device=x.device)
        self._encode_rows(rows, out)
        return out

    def encode_into(self, x: torch.Tensor, out: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """encode(x) written into `out`, a contiguous uint8 [n, 4 + prod(shape)] tensor (e.g.
        an arena reservation or a pinned buffer); returns `out`.

        When `out` is on x's device the rows are written in place; else they are encoded
        into a temporary on x's device and copied over. `non_blocking` (CUDA to pinned
        host memory): queue that copy on the current stream and return at once; the
        caller waits for the stream (an event) before reading `out`."""
        rows = self._rows(x)
        expected = (rows.shape[0], SCALE_BYTES + rows.shape[1])
        if out.dtype != torch.uint8 or tuple(out.shape) != expected:
            raise ValueError(
                f"out must be uint8 {list(expected)} for {self.name} blocks of {list(x.shape[1:])}, "
                f"not {out.dtype} {list(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if out.device == x.device:
            self._encode_rows(rows, out)
        else:
            out.copy_(self.encode(x), non_blocking=non_blocking)
        return out

    def decode(self, packed: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """[n, 4 + prod(shape)] uint8 -> [n, *shape] of `dtype` on packed's device: each
        element code * scale, computed in float32, then cast to `dtype`."""
        numel = _numel(shape)
        if not dtype.is_floating_point or stored_kv_dtype_is_fp8(dtype):
            raise ValueError(f"decode produces float16, bfloat16 or float32 (or float64), not {dtype}")
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"packed blocks are a 2-d uint8 tensor, not {packed.dtype} {list(packed.shape)}")
        if packed.shape[1] != SCALE_BYTES + numel:
            raise ValueError(
                f"packed rows of {packed.shape[1]} bytes do not hold {self.name} blocks of {list(shape)} "
                f"({SCALE_BYTES + numel} bytes each)"
            )
        n = packed.shape[0]
        head = packed[:, :SCALE_BYTES]
        if not _LITTLE_ENDIAN:
            head = head.flip(-1)
        scale = head.contiguous().view(torch.float32)  # [n, 1]
        codes = packed[:, SCALE_BYTES:].view(self.code_dtype)
        out = torch.empty((n, numel), dtype=dtype, device=packed.device)
        step = _row_step(packed.device, numel, n)
        for start in range(0, n, step):  # one pass on a device; cache-sized slices on the CPU
            part = codes[start : start + step]
            # NOTE: torch does not promote float8 in arithmetic: fp8 codes go to float32
            # first. int8 codes times a float32 scale compute in float32; out= casts.
            values = part.to(torch.float32) if self.code_dtype != torch.int8 else part
            torch.mul(values, scale[start : start + step], out=out[start : start + step])
        return out.view(n, *shape)

    # ---- shared by both
    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as [n, prod(shape)] (a view where x is contiguous), validated."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"encode takes a torch.Tensor, not {type(x).__name__}")
        if not x.dtype.is_floating_point or stored_kv_dtype_is_fp8(x.dtype):
            raise ValueError(f"{self.name} encodes float16, bfloat16 or float32 KV, not {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"encode takes a batch of blocks [n, *shape], not {list(x.shape)}")
        return x.reshape(x.shape[0], _numel(tuple(x.shape[1:])))

    def _encode_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize `rows` ([n, m] float) into `out` ([n, 4 + m] uint8, same device)."""
        n, m = rows.shape
        step = _row_step(rows.device, m, n)
        for start in range(0, n, step):  # one pass on a device; cache-sized slices on the CPU
            part = rows[start : start + step]
            dest = out[start : start + step]
            low, high = torch.aminmax(part, dim=1, keepdim=True)  # exact in any float dtype
            amax = torch.maximum(high.to(torch.float32), low.to(torch.float32).neg())
            # NOTE: a tensor divisor, not a Python float: CUDA divides by a host scalar as a
            # product with its reciprocal, a last-bit different scale than the CPU's
            scale = torch.div(amax, torch.full_like(amax, self.qmax)).clamp_min_(_FLOAT32_TINY)
            scale = torch.where(amax > 0, scale, torch.ones_like(amax))
            dest[:, :SCALE_BYTES] = _scale_bytes(scale)
            y = torch.div(part, scale)  # float32 whatever part's dtype: scale is float32
            self._quantize_into(y, dest[:, SCALE_BYTES:].view(self.code_dtype))


class Fp8Codec(Codec):
    """float8_e4m3fn codes, scale = amax / 448 per row."""

    name = "fp8"
    qmax = _FP8_MAX
    code_dtype = torch.float8_e4m3fn

    def _quantize_into(self, y: torch.Tensor, codes: torch.Tensor) -> None:
        # clamp first: a float32 rounding may put amax / scale a hair above 448, and casts
        # out of e4m3's range are not guaranteed to saturate
        y.clamp_(-_FP8_MAX, _FP8_MAX)
        codes.copy_(y)  # the cast rounds to nearest even


class Int8Codec(Codec):
    """Symmetric int8 codes, scale = amax / 127 per row."""

    name = "int8"
    qmax = _INT8_MAX
    code_dtype = torch.int8

    def _quantize_into(self, y: torch.Tensor, codes: torch.Tensor) -> None:
        y.round_().clamp_(-_INT8_MAX, _INT8_MAX)
        codes.copy_(y)  # whole numbers in range: the cast is exact


_CODECS: dict[str, type[Codec]] = {"fp8": Fp8Codec, "int8": Int8Codec}


def make_codec(name: str) -> Codec | None:
    """The codec for a "compression" setting: None for "none" (store KV as it is)."""
    if name == "none":
        return None
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ValueError(f"compression must be one of {', '.join(map(repr, CODECS))}, not {name!r}")
    return codec()

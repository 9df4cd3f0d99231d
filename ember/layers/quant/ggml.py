"""GGML's block formats decoded to float32: ember's vectorized torch decoders for the common
types (the same bits as gguf-py's numpy ones), gguf-py's for the rest. A leaf of the layers:
the GGUF loader and BlockTensor both decode here, and it imports no loader. The `gguf`
package is imported when a type needs it, so `import ember` needs torch alone."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import gguf

# `block_size` values; the decoders below see the bytes as (n_blocks, type_size) and
# return (n_blocks, block_size) float32. Scales d and minimums m are float16, and all
# arithmetic happens in float32 in the same order as gguf-py, so the bits match. (A
# product d * q of an 11-bit f16 mantissa and a <= 8-bit integer is exact in float32, so
# even an fma would agree; the one rounding is the "+ m" of the types with a minimum.)


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 holding little-endian float16 -> (n, 1) float32."""
    return cols.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) uint8 -> (n, 32) uint8: value j is qs[j] & 0xF, value 16+j is qs[j] >> 4."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
    return out


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) uint8, a little-endian uint32 -> (n, 32) uint8: value j is bit j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


# Q4_0, 32 values in 18 bytes:
#   | d f16 | qs[0] .. qs[15]            |   value j    = d * ((qs[j] & 0xF) - 8)
#   0       2                            18  value 16+j = d * ((qs[j] >> 4)  - 8)
def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]).float().sub_(8).mul_(d)  # q - 8 is exact in float32


# Q4_1, 32 values in 20 bytes:
#   | d f16 | m f16 | qs[0] .. qs[15]    |   value j    = d * (qs[j] & 0xF) + m
#   0       2       4                    20  value 16+j = d * (qs[j] >> 4)  + m
def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    out = _nibbles(b[:, 4:20]).float()
    return out.mul_(d).add_(m)  # (d * q) + m as gguf-py; d * q is exact, the add rounds once


# Q5_0, 32 values in 22 bytes:
#   | d f16 | qh u32 | qs[0] .. qs[15]   |   q_j = (low nibble as Q4_0) | (bit j of qh) << 4
#   0       2        6                   22  value j = d * (q_j - 16)
def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return (_nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)).float().sub_(16).mul_(d)


# Q5_1, 32 values in 24 bytes:
#   | d f16 | m f16 | qh u32 | qs[0] .. qs[15]  |   q_j as Q5_0
#   0       2       4        8                  24  value j = d * q_j + m
def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    out = (_nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)).float()
    return out.mul_(d).add_(m)


# Q8_0, 32 values in 34 bytes:
#   | d f16 | qs[0] .. qs[31] int8       |   value j = qs[j] * d
#   0       2                            34
def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return b[:, 2:34].view(torch.int8).float().mul_(d)


# BF16: 2 bytes a value, the top half of a float32:  value = bits << 16 (exact, NaNs too)
def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.bfloat16).float()


# F16: 2 bytes a value, IEEE half (exact in float32).
def _f16_values(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float16).float()


# F32: 4 bytes a value.
def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float32).clone()


# qtype value -> its decoder (the block and type sizes are gguf-py's GGML_QUANT_SIZES). Values
# from ggml.h, which fixes them.
_DECODERS = {
    0: _f32,  # F32
    1: _f16_values,  # F16
    2: _q4_0,  # Q4_0
    3: _q4_1,  # Q4_1
    6: _q5_0,  # Q5_0
    7: _q5_1,  # Q5_1
    8: _q8_0,  # Q8_0
    30: _bf16,  # BF16
}


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread for the decoders: a few passes over memory each. On the shared
    2-core machine a second thread made them up to 1.8x faster while it was quiet, and small
    tensors up to 40x slower (the whole default model 4-6x) while other work held the cores
    (benchmarks/BENCHMARKS.md, 2026-12-01). A load should not depend on the neighbours."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType | int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a tensor's stored bytes to a new float32 tensor of `shape` (PyTorch order).

    raw: the bytes as stored (any dtype; read as bytes, never modified).
    """
    import gguf

    try:
        qt = gguf.GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"unknown GGML tensor type {int(qtype)}; is the file from a newer llama.cpp?") from None
    shape = tuple(int(n) for n in shape)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qt]
    numel = math.prod(shape)
    row = shape[-1] if shape else 1
    if row % block_size != 0:
        raise ValueError(f"a {qt.name} row holds whole blocks of {block_size} values; shape {shape} does not")
    want = numel // block_size * type_size
    data = np.asarray(raw)
    if data.nbytes != want:
        raise ValueError(f"{qt.name} tensor of shape {shape} needs {want} bytes, got {data.nbytes}")
    data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)

    if int(qt) in _DECODERS:
        decode = _DECODERS[int(qt)]
        with warnings.catch_warnings():  # the memory map is read-only; the decoders only read it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            blocks = torch.from_numpy(data).view(-1, type_size)
        with _one_thread():
            return decode(blocks).reshape(shape)  # a new tensor: callers own the result

    try:  # K-quants, IQ types, ...: gguf-py's numpy decoders
        values = gguf.quants.dequantize(data.reshape(-1, row // block_size * type_size), qt)
    except NotImplementedError:
        raise ValueError(
            f"cannot dequantize tensor type {qt.name}: neither ember nor gguf-py "
            f"{getattr(gguf, '__version__', '')} decodes it. Use a file quantized differently "
            "(F16, BF16, Q8_0, Q4_K, ...)."
        ) from None
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(shape)

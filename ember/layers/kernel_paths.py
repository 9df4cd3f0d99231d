"""Which matmul a linear layer's input takes: ember's CUDA paths (the small-batch GEMV,
kernels/gemv.py; the FP8, integer-weight and GGUF kernels, layers/quant/fp8.py, int_weight.py,
gguf_cuda.py) for CUDA tensors, cuBLAS / plain torch otherwise. `gemv_on_cpu()` sends CPU
tensors down the CUDA paths too, through Triton's interpreter, for tests.
`EMBER_SMALL_BATCH_GEMV=0` leaves every size to cuBLAS (FP8 weights to torch._scaled_mm,
integer weights to kernels/wna16.py's matmul, GGUF blocks to kernels/gguf.py's)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

GEMV_MAX_WEIGHT = 1 << 24  # elements: Llama-8B's o_proj; its q|k|v, gate|up and down go to cuBLAS
# FP8 weights: rows up to this go to the weight-only fp8 GEMV, more to the fp8 x fp8 matmuls.
# A first guess (the GEMV reads the fp8 weight once and skips quantizing the activations; for
# bf16 weights cuBLAS won from 2 rows up): the lead measures it on the H200
# (benchmarks/scripts/fp8_gemm_bench.py) and sets it from there.
FP8_GEMV_MAX_ROWS = 4
# integer weights (layers/quant/int_weight.py): rows up to this go to the GEMV (weight-only, its
# prologues fused), more to kernels/wna16.py's tensor-core matmul. Measured on the H100
# (benchmarks/scripts/int4_gemv_bench.py, 4-bit, groups of 128, Llama-3.1-8B's shapes, the tuned
# tiles): at 2 rows the word GEMV takes 8.8-46 us a layer against the matmul's 12.6-45; at 4 rows
# 15-90 us against 12.5-45 (gate_up: 90 against 45), so 3 and 4 rows go to the matmul.
INT_GEMV_MAX_ROWS = 2
# GGUF blocks on CUDA (layers/quant/gguf_cuda.py): rows up to this go to the GEMV, more to the
# tensor-core matmul of kernels/gguf.py. A first guess, as for integer weights.
GGUF_GEMV_MAX_ROWS = 4
_GEMV_ENABLED = os.environ.get("EMBER_SMALL_BATCH_GEMV", "1") != "0"
_ON_CPU = False  # tests run the kernels on CPU tensors through Triton's interpreter


@contextlib.contextmanager
def gemv_on_cpu() -> Iterator[None]:
    """Take the CUDA paths (GEMV, FP8 kernels) for CPU tensors too (Triton's interpreter): for tests."""
    global _ON_CPU
    _ON_CPU = True
    try:
        yield
    finally:
        _ON_CPU = False


def cuda_paths(x: torch.Tensor) -> bool:
    """x takes the CUDA kernels: it is on CUDA, or tests asked for them on the CPU."""
    return x.is_cuda or _ON_CPU


def kernels_on(device: str | torch.device) -> bool:
    """Weights loaded onto `device` take the CUDA kernels' formats: it is CUDA, or tests asked
    for the kernels on the CPU."""
    return torch.device(device).type == "cuda" or _ON_CPU


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer on x runs as ember's GEMV kernel: one row on CUDA, and a
    weight of at most 2^24 elements. There the kernel beat cuBLAS on the H200; at 2 to 4
    rows, and for bigger weights, cuBLAS is faster (benchmarks/BENCHMARKS.md, session 4)."""
    return ((x.is_cuda and _GEMV_ENABLED) or _ON_CPU) and x.dim() == 2 and x.shape[0] == 1 \
        and weight.numel() <= GEMV_MAX_WEIGHT and x.dtype == weight.dtype and x.stride(1) == 1 \
        and weight.device == x.device


def _few_rows(x: torch.Tensor, max_rows: int) -> bool:
    return ((x.is_cuda and _GEMV_ENABLED) or _ON_CPU) and x.dim() == 2 and 0 < x.shape[0] <= max_rows \
        and x.stride(1) == 1


def uses_fp8_gemv(x: torch.Tensor) -> bool:
    """Whether a layer holding FP8 weights runs x [M, K] as the weight-only fp8 GEMV."""
    return _few_rows(x, FP8_GEMV_MAX_ROWS)


def uses_int_gemv(x: torch.Tensor) -> bool:
    """Whether a layer holding integer weights runs x [M, K] as the GEMV, not the matmul."""
    return _few_rows(x, INT_GEMV_MAX_ROWS)


def uses_gguf_gemv(x: torch.Tensor) -> bool:
    """Whether a layer holding GGUF blocks on CUDA runs x [M, K] as the GEMV, not the matmul."""
    return _few_rows(x, GGUF_GEMV_MAX_ROWS)

"""GGML blocks for the block kernels' tests (the CPU's, kernels/cpu/quant_gemm.cpp, and CUDA's,
kernels/gguf.py), in the file's own bytes:

    random_blocks(qtype, n, k, seed)      every byte random but the float16 scales (finite, of
                                          both signs): every bit pattern of the values
    quantized_blocks(qtype, n, k, seed)   a random normal weight quantized by llama.cpp's
                                          gguf-py (Q4_0 .. Q8_0: gguf-py 0.19 quantizes no K-quant)
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def random_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k values: random bytes, with the scales set to finite float16 values."""
    rng = np.random.default_rng(seed)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, raw.shape[:2]).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if qtype in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K):  # d and a minimum (K: dmin)
        raw[..., 0:2], raw[..., 2:4] = f16(-0.1, 0.1), f16(-0.1, 0.1)
    elif qtype == T.Q6_K:
        raw[..., 208:210] = f16(-0.01, 0.01)
    else:
        raw[..., 0:2] = f16(-0.1, 0.1)
    return raw.reshape(n, -1)


def quantized_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """A weight of N(0, 1 / k) values quantized to qtype by gguf-py: uint8 [n, row bytes]."""
    weight = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / np.float32(k ** 0.5)
    return gguf.quants.quantize(weight, qtype)

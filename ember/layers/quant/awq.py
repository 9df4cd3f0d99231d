"""AWQ checkpoints (AutoAWQ's GEMM packing, `version: gemm`), read into int_weight.py's layout.

    qweight  int32 [K, N / 8]   8 four-bit values a word along N, interleaved: word c holds
                                column 8c + AWQ_ORDER[j] at bits 4j
    qzeros   int32 [G, N / 8]   the zero points, packed alike
    scales   float16 [G, N]     G = K / group_size (one group a row: group_size -1)
    W^T[k, n] = (q[k, n] - z[k // group_size, n]) * s[k // group_size, n]

(AutoAWQ's WQLinear_GEMM.from_linear packs so, and its dequantize_gemm undoes it.)
"""

from __future__ import annotations

import torch

from ember.layers.quant.int_weight import IntTensor, unpack_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each nibble of a word (of its 8)


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N / 8] in AWQ's order -> uint8 [R, N], column n in place n."""
    values = unpack_words(words, 4)
    order = torch.tensor(AWQ_ORDER, device=words.device)
    columns = (torch.arange(words.shape[1], device=words.device)[:, None] * 8 + order).reshape(-1)
    out = torch.empty_like(values)
    out[:, columns] = values
    return out


def awq_tensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> IntTensor:
    """One AWQ GEMM weight (4 bits) as an IntTensor [N, K]."""
    k, words = qweight.shape
    n = words * 8
    group_size = k if group_size <= 0 else group_size
    if k % group_size:
        raise ValueError(f"AWQ groups of {group_size} do not divide the {k} input features")
    groups = k // group_size
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, words) \
            or tuple(scales.shape) != (groups, n):
        raise ValueError(f"an AWQ weight of qweight int32 [{k}, {words}] in groups of {group_size} has qzeros int32 "
                         f"[{groups}, {words}] and scales [{groups}, {n}]; got qweight {qweight.dtype}, qzeros "
                         f"{qzeros.dtype} {list(qzeros.shape)}, scales {list(scales.shape)}")
    q = awq_columns(qweight).t()
    zeros = awq_columns(qzeros).t()
    return IntTensor.from_values(q.contiguous(), scales.t(), zeros, None, 4, group_size)

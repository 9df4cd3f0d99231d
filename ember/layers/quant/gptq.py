"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum: `checkpoint_format` gptq or gptq_v2), read
into int_weight.py's layout.

    qweight  int32 [K / per, N]   per = 32 / bits values a word along K: word r of column n
                                  holds row per * r + j at bits j * bits
    qzeros   int32 [G, N / per]   the zero points, packed alike along N; the classic format
                                  ("gptq", v1) stores each one less than it is, gptq_v2 as it is
    scales   float16 [G, N]
    g_idx    int32 [K]            row k's group: k // group_size, or any order with act-order
                                  (desc_act)
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
"""

from __future__ import annotations

import torch

from ember.layers.quant.int_weight import IntTensor, unpack_words


def gptq_tensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                bits: int, group_size: int, zeros_minus_one: bool) -> IntTensor:
    """One GPTQ weight as an IntTensor [N, K]; `zeros_minus_one`: the v1 format's zero points."""
    per = 32 // bits
    words, n = qweight.shape
    k = words * per
    group_size = k if group_size <= 0 else group_size
    groups = -(-k // group_size)
    zero_words = -(-n // per)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, zero_words) \
            or tuple(scales.shape) != (groups, n) or (g_idx is not None and tuple(g_idx.shape) != (k,)):
        raise ValueError(f"a {bits}-bit GPTQ weight of qweight int32 [{words}, {n}] in groups of {group_size} has "
                         f"qzeros int32 [{groups}, {zero_words}], scales [{groups}, {n}] and g_idx [{k}]; got qweight "
                         f"{qweight.dtype}, qzeros {qzeros.dtype} {list(qzeros.shape)}, scales {list(scales.shape)}, "
                         f"g_idx {None if g_idx is None else list(g_idx.shape)}")
    q = unpack_words(qweight.t().contiguous(), bits)
    zeros = unpack_words(qzeros, bits)[:, :n].to(torch.int32)
    if zeros_minus_one:
        zeros = zeros + 1
        if int(zeros.max()) == 1 << bits:
            raise ValueError(f"a GPTQ v1 (checkpoint_format 'gptq') zero point stored as {(1 << bits) - 1} would be "
                             f"{1 << bits}, which {bits} bits cannot hold (a zero of 0 saved in the v1 format): the "
                             "checkpoint cannot be read exactly; use its gptq_v2 export")
    return IntTensor.from_values(q, scales.t(), zeros.t(), g_idx, bits, group_size)

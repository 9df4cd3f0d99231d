"""compressed-tensors integer weights read into int_weight.py's layout: `pack-quantized`
(llm-compressor's W4A16 / W8A16 schemes), whose layout is int_weight.py's own,

    weight_packed      int32 [N, ceil(K / per)]   per = 32 / bits values a word along K, value
                                                  k at bits (k % per) * bits, stored as the
                                                  signed value + 2^(bits - 1)
    weight_scale       [N, G]                     strategy group (G = ceil(K / group_size)) or
                                                  channel (G = 1), in the model's dtype
    weight_shape       int [2]                    [N, K]
    weight_g_idx       int32 [K]                  actorder "group": column k's group
    weight_zero_point  int32 [ceil(N / per), G]   asymmetric (W4A16_ASYM): the zero points
                                                  packed alike but along N (the rows), each
                                                  the signed zero + 2^(bits - 1)
    W[n, k] = (stored[n, k] - 2^(bits - 1)) * s[n, g(k)]   symmetric
    W[n, k] = (stored[n, k] - stored_zero[n, g(k)]) * s[n, g(k)]   asymmetric

(compressed-tensors' pack_to_int32 / unpack_from_int32 pack and unpack so: 32 values in `bits`
words, value i at bit i * bits, which for 4 and 8 bits is one word's values in order), and weight-only
`int-quantized` (8-bit values stored one a byte):

    weight             int8 [N, K]                the signed value
    weight_scale       [N, G] or one number       strategy group, channel (G = 1) or tensor
    W[n, k] = weight[n, k] * s[n, g(k)]

(an int-quantized checkpoint that quantizes the activations too is W8A8: layers/quant/w8a8.py.)
"""

from __future__ import annotations

import torch

from ember.layers.quant.int_weight import IntTensor, act_order, unpack_words


def pack_quantized_tensor(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, g_idx: torch.Tensor | None,
                          bits: int, group_size: int | None, zero_point: torch.Tensor | None = None) -> IntTensor:
    """One pack-quantized weight as an IntTensor [N, K]; group_size None: per channel;
    zero_point: an asymmetric weight's packed zero points (None: symmetric)."""
    if shape.numel() != 2:
        raise ValueError(f"weight_shape holds [out, in]; got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    group_size = k if group_size is None else group_size
    if scale.dim() == 1:
        scale = scale[:, None]
    try:
        if packed.shape[0] != n:
            raise ValueError(f"weight_packed holds {packed.shape[0]} rows")
        group_size = min(group_size, k)
        zeros = None if zero_point is None else _zero_points(zero_point, n, scale.shape[1], bits)
        return IntTensor(packed, scale.contiguous(), zeros, act_order(g_idx, k, group_size, scale.shape[1]), bits,
                         group_size, k)
    except ValueError as e:
        raise ValueError(f"a pack-quantized weight {[n, k]} of {bits} bits in groups of {group_size}: {e}") from None


def _zero_points(packed: torch.Tensor, n: int, groups: int, bits: int) -> torch.Tensor:
    """weight_zero_point int32 [ceil(N / per), G] -> uint8 [N, G], each stored as its signed
    zero + 2^(bits - 1) (IntTensor's unsigned zero, as the values are stored)."""
    per = 32 // bits
    if packed.dtype != torch.int32 or tuple(packed.shape) != (-(-n // per), groups):
        raise ValueError(f"weight_zero_point of {groups} group(s) a row packs into int32 [{-(-n // per)}, {groups}]; "
                         f"got {packed.dtype} {list(packed.shape)}")
    return unpack_words(packed.t(), bits)[:, :n].t().contiguous()


def int_quantized_tensor(weight: torch.Tensor, scale: torch.Tensor, group_size: int | None) -> IntTensor:
    """One weight-only int-quantized weight (int8 values, symmetric) as an IntTensor [N, K];
    group_size None: one scale a row, or one for the whole weight (strategy tensor)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"an int-quantized weight is int8 [out, in]; got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    elif scale.dim() == 1:
        scale = scale[:, None]
    return IntTensor.from_values((weight.to(torch.int16) + 128).to(torch.uint8), scale, None, None, 8,
                                 k if group_size is None else group_size)

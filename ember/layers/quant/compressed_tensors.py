"""compressed-tensors `pack-quantized` weights (llm-compressor's W4A16 / W8A16 schemes),
read into int_weight.py's layout, which is theirs:

    weight_packed      int32 [N, ceil(K / per)]   per = 32 / bits values a word along K, value
                                                  k at bits (k % per) * bits, stored as the
                                                  signed value + 2^(bits - 1)
    weight_scale       [N, G]                     strategy group (G = ceil(K / group_size)) or
                                                  channel (G = 1), in the model's dtype
    weight_shape       int [2]                    [N, K]
    weight_g_idx       int32 [K]                  actorder "group": column k's group
    W[n, k] = (stored[n, k] - 2^(bits - 1)) * s[n, g(k)]   (symmetric: no zero point)

(compressed-tensors' pack_to_int32 / unpack_from_int32 pack and unpack so.)
"""

from __future__ import annotations

import torch

from ember.layers.quant.int_weight import IntTensor, act_order


def pack_quantized_tensor(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, g_idx: torch.Tensor | None,
                          bits: int, group_size: int | None) -> IntTensor:
    """One symmetric pack-quantized weight as an IntTensor [N, K]; group_size None: per channel."""
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
        return IntTensor(packed, scale.contiguous(), None, act_order(g_idx, k, group_size, scale.shape[1]), bits,
                         group_size, k)
    except ValueError as e:
        raise ValueError(f"a pack-quantized weight {[n, k]} of {bits} bits in groups of {group_size}: {e}") from None

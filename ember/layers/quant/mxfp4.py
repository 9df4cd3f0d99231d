"""MXFP4 (the OCP microscaling format gpt-oss ships its experts in): blocks of 32 FP4 (e2m1)
values sharing one power-of-two scale (E8M0: 2^(s - 127)).

    blocks  uint8 [..., rows, in / 32, 16]   two values a byte, the low nibble first
    scales  uint8 [..., rows, in / 32]       a block's exponent, biased by 127
    value   = E2M1[nibble] * 2^(scale - 127)

On CUDA the experts stay so (rows flattened: blocks [E, rows, in / 2], scales [E, rows,
in / 32]) and kernels/moe.py's fused kernels decode them in registers (MXFP4Experts);
elsewhere they are decoded to float32 [..., rows, in] on load, by dequantize_mxfp4.
"""

from __future__ import annotations

import torch

# e2m1: sign, two exponent bits, one mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks [..., rows, groups, 16] and scales [..., rows, groups] are a uint8 pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks "
                         "must be [..., rows, groups, 16] and scales [..., rows, groups]")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The reference decoder: [..., rows, in] float32."""
    check_mxfp4(blocks, scales)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [..., g, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)

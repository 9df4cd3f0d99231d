"""llama.cpp's stacked expert tensors -> the per-expert HF names that the weight loader fills
FusedMoE's stacked w13 / w2 from (loader/weights.py).

    GGUF tensor (PyTorch order; GGUF's ne is reversed)    HF name, for each expert e
    blk.N.ffn_gate_exps.weight     [E, I, H]   ne {H, I, E}   model.layers.N.mlp.experts.e.gate_proj.weight
    blk.N.ffn_up_exps.weight       [E, I, H]                  ... .up_proj.weight
    blk.N.ffn_down_exps.weight     [E, H, I]   ne {I, H, E}   ... .down_proj.weight
    blk.N.ffn_gate_up_exps.weight  [E, 2I, H]  (the converter's --fuse-gate-up-exps): gate rows, then up

Expert e's slice is the HF expert's weight as is: the converter stacks them unchanged. One
name serves every family: the loader maps Mixtral's block_sparse_moe.experts.e.w1/w3/w2 and
the Qwen MoEs' mlp.experts.e.*_proj to the same shards.

The stacked tensors come out dequantized (float32, cast to the run dtype as they are copied
in), whatever their type: FusedMoE holds dense [E, 2I, H] / [E, H, I] weights, and the
block-kept path (layers/quant/gguf_blocks.py) is for 2-D Linear weights only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_STACKED = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")


def is_stacked_experts(gguf_name: str) -> bool:
    return _STACKED.fullmatch(gguf_name) is not None


def split_experts(gguf_name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, weight) of each expert in a stacked tensor `w` ([E, rows, cols])."""
    m = _STACKED.fullmatch(gguf_name)
    if m is None or w.dim() != 3:
        raise ValueError(f"{gguf_name} {tuple(w.shape)} is not a stack of experts' weights [experts, rows, cols]")
    prefix = f"model.layers.{m[1]}.mlp.experts."
    if m[2] == "gate_up":
        if w.shape[1] % 2:
            raise ValueError(f"{gguf_name} {tuple(w.shape)}: gate|up rows must split in two equal halves")
        gate, up = w.chunk(2, dim=1)
        for e in range(w.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", gate[e]
            yield f"{prefix}{e}.up_proj.weight", up[e]
        return
    for e in range(w.shape[0]):
        yield f"{prefix}{e}.{m[2]}_proj.weight", w[e]

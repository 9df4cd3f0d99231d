"""The token embedding and the LM head. A GGUF embedding stays in its blocks (rows are
dequantized as they are looked up), and a head tied to it multiplies those blocks. A head
an FP8 checkpoint stores in FP8 keeps it (--quantization fp8 itself leaves the head and the
embedding in the model dtype)."""

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.quant import WeightFormat
from ember.layers.quant.fp8 import FP8Tensor, FP8Weight
from ember.layers.quant.gguf_blocks import BlockTensor, GGUFBlocks
from ember.layers.quant.unquantized import OneDNNPacked


def _to_meta(weight: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def _take_blocks(weight: nn.Parameter, tensor: BlockTensor) -> tuple[GGUFBlocks, nn.Parameter]:
    """GGUF blocks in place of a [vocab, hidden] weight: (the format, the parameter on meta)."""
    if tensor.shape != tuple(weight.shape):
        raise ValueError(f"parameter {tuple(weight.shape)}, checkpoint {tensor.shape}")
    return GGUFBlocks(tensor), _to_meta(weight)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.blocks: GGUFBlocks | None = None

    def load_blocks(self, tensor: BlockTensor, shard: None = None) -> None:
        self.blocks, self.weight = _take_blocks(self.weight, tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return self.blocks.rows(input_ids, self.weight.dtype)
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocab logits; shares the embedding's weight when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.format: WeightFormat | None = None

    def load_blocks(self, tensor: BlockTensor, shard: None = None) -> None:
        self.format, self.weight = _take_blocks(self.weight, tensor)

    def load_fp8(self, tensor: FP8Tensor, shard: None = None) -> None:
        if tensor.shape != tuple(self.weight.shape):
            raise ValueError(f"parameter {tuple(self.weight.shape)}, checkpoint {tensor.shape}")
        self.format = FP8Weight(tensor.to(self.weight.device))
        self.weight = _to_meta(self.weight)

    def pack_for_cpu(self) -> None:
        """A packed copy for the matmul (a tied embedding still needs its rows for lookups)."""
        if self.format is not None or (self.tied_to is not None and self.tied_to.blocks is not None):
            return
        self.format = OneDNNPacked(self.tied_to.weight if self.tied_to is not None else self.weight)
        if self.tied_to is None:
            self.weight = _to_meta(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.format is not None:
            return self.format.apply(hidden)
        if self.tied_to is not None and self.tied_to.blocks is not None:
            return self.tied_to.blocks.apply(hidden)
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        return F.linear(hidden, weight)

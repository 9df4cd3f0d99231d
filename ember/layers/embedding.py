"""The token embedding and the LM head. A GGUF embedding stays in its blocks (rows are
dequantized as they are looked up: the CPU kernels, or kernels/gguf.py's gather on CUDA),
and a head tied to it multiplies those blocks. A head
an FP8 checkpoint stores in FP8 keeps it (--quantization fp8 itself leaves the head and the
embedding in the model dtype).

Tensor parallelism splits the vocabulary (distributed/sharding.py: ceil(vocab / tp) rows a
rank; GGUF blocks and an FP8 head too): the embedding looks up the ids in its rows, zeros the
others' and all-reduces; the head's logits for its rows are gathered from every rank."""

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from ember.distributed.sharding import vocab_rows
from ember.layers.batch_invariant import invariant_linear
from ember.layers.quant import WeightFormat
from ember.layers.quant.fp8 import FP8Tensor, FP8Weight
from ember.layers.quant.gguf_blocks import BlockTensor, GGUFBlocks
from ember.layers.quant.gguf_cuda import GGUFCudaBlocks, gguf_format
from ember.layers.quant.unquantized import OneDNNPacked


def _to_meta(weight: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


def _take_blocks(weight: nn.Parameter, tensor: BlockTensor) -> tuple[GGUFBlocks | GGUFCudaBlocks, nn.Parameter]:
    """GGUF blocks in place of a [vocab, hidden] weight, on its device: (the format, the parameter on meta)."""
    if tensor.shape != tuple(weight.shape):
        raise ValueError(f"parameter {tuple(weight.shape)}, checkpoint {tensor.shape}")
    return gguf_format(tensor.to(weight.device)), _to_meta(weight)


class VocabRows(nn.Module):
    """A [vocab, hidden] weight of which this rank holds rows [start, start + rows)."""

    def __init__(self, vocab_size: int, hidden_size: int, own_weight: bool = True) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp_size()
        self.start, rows = vocab_rows(vocab_size, tp_rank(), self.tp)
        if own_weight:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size))
            self.weight.weight_loader = self.load_rows

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """This rank's rows of a [vocab, ...] tensor: the weight, or Phi-2's head bias."""
        expected = (self.vocab_size, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"parameter {expected}, checkpoint {tuple(loaded.shape)}")
        held = self._held(param.shape[0])
        param.data[:held].copy_(loaded.narrow(0, self.start, held))
        param.data[held:].zero_()  # the last rank's padding

    def _held(self, rows: int) -> int:
        """Rows of the vocabulary this rank holds; the rest of its `rows` are padding."""
        return max(0, min(rows, self.vocab_size - self.start))

    def _local_rows(self, tensor: BlockTensor | FP8Tensor, weight: nn.Parameter) -> BlockTensor | FP8Tensor:
        """This rank's rows of a [vocab, hidden] weight kept quantized, padded."""
        if self.tp == 1:
            return tensor
        if tensor.shape != (self.vocab_size, weight.shape[1]):
            raise ValueError(f"parameter {(self.vocab_size, weight.shape[1])}, checkpoint {tensor.shape}")
        return tensor.narrow(0, self.start, self._held(weight.shape[0])).pad_rows(weight.shape[0])


class VocabEmbedding(VocabRows):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.blocks: GGUFBlocks | GGUFCudaBlocks | None = None

    def load_blocks(self, tensor: BlockTensor, shard: None = None) -> None:
        self.blocks, self.weight = _take_blocks(self.weight, self._local_rows(tensor, self.weight))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            return self.blocks.rows(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = self._lookup(local.masked_fill(outside, 0))
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(VocabRows):
    """hidden -> vocab logits; shares the embedding's weight when the model ties them. With
    tensor parallelism every rank gets the logits of the whole vocabulary. `bias`: Phi-2's
    head adds one (this rank's rows of it)."""

    batch_invariant = False  # deterministic mode (layers/batch_invariant.py) sets it on the instance

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size, own_weight=tied_to is None)
        self.tied_to = tied_to
        self.format: WeightFormat | None = None
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(vocab_rows(vocab_size, tp_rank(), self.tp)[1]))
            self.bias.weight_loader = self.load_rows

    def load_blocks(self, tensor: BlockTensor, shard: None = None) -> None:
        self.format, self.weight = _take_blocks(self.weight, self._local_rows(tensor, self.weight))

    def load_fp8(self, tensor: FP8Tensor, shard: None = None) -> None:
        tensor = self._local_rows(tensor, self.weight)
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
        fmt = self.format if self.format is not None else self.tied_to.blocks if self.tied_to is not None else None
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        if self.batch_invariant:
            logits = invariant_linear(hidden, weight, fmt, self.bias)
        elif fmt is not None:
            logits = fmt.apply(hidden, self.bias)
        else:
            logits = F.linear(hidden, weight, self.bias)
        if self.tp == 1:
            return logits
        return all_gather_last_dim(logits)[..., : self.vocab_size]

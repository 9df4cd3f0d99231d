import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import pack_weight, packed_linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocab logits; shares the embedding's weight when the model ties them."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """A packed copy for the matmul (a tied embedding still needs its rows for lookups)."""
        self.packed = pack_weight(self.tied_to.weight if self.tied_to is not None else self.weight)
        if self.tied_to is None:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(hidden, self.packed, None)
        weight = self.tied_to.weight if self.tied_to is not None else self.weight
        return F.linear(hidden, weight)

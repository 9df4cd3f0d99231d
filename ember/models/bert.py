"""The encoder in one file: BERT and XLM-RoBERTa (the MiniLM, bge, e5 and bge-reranker
families), as embedding models and with their sequence-classification heads.

Each step's sequences are whole prompts (the scheduler never splits an encoder's prompt):
every token attends to every token of its own sequence, so no key or value outlives the
step and nothing is cached. The blocks are post-norm (x = LayerNorm(x + sublayer(x))),
positions are learned (RoBERTa's count from pad_token_id + 1), and the parameter names are
transformers' own, so a checkpoint loads one to one (loader/weights.py strips the `bert.` /
`roberta.` prefix of a *ForSequenceClassification file).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.attention import AttentionMetadata
from ember.models.config import ModelConfig


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size \
            else None
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.position_offset = cfg.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if self.token_type_embeddings is not None:  # type 0 where no request gave types
            x = x + (self.token_type_embeddings.weight[0] if token_type_ids is None
                     else self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        shape = (-1, self.num_heads, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(0, 1) for p in (self.query, self.key, self.value))  # [H, T, D]
        out = torch.empty_like(q)
        start = 0
        for n in meta.query_lens_cpu:  # each sequence attends to itself only, both ways
            s = slice(start, start + n)
            out[:, s] = F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s])
            start += n
        return out.transpose(0, 1).reshape(x.shape)


class BertDense(nn.Module):
    """A projection, then LayerNorm(residual + its output): transformers' BertSelfOutput
    and BertOutput."""

    def __init__(self, cfg: ModelConfig, size_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertDense(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(x, meta), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDense(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))


class BertPooler(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class RobertaClassificationHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class BertModel(nn.Module):
    """BERT or XLM-RoBERTa, with the classification head a *ForSequenceClassification
    checkpoint has (ModelConfig.classifier)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        if cfg.classifier == "bert":
            self.pooler = BertPooler(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        elif cfg.classifier == "roberta":
            self.classifier = RobertaClassificationHead(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A step's whole prompts, flattened (query_lens_cpu gives each one's length):
        their final hidden states."""
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """[N, hidden] first-token states -> [N, num_labels] logits."""
        if self.config.classifier == "bert":
            return self.classifier(self.pooler(first))
        return self.classifier(first)

    def attention_layers(self) -> list[nn.Module]:
        return []  # no layer reads a KV cache


def encoder_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this encoder holds (ember's names, the base model's), with its shape."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in BertModel(cfg).named_parameters()}

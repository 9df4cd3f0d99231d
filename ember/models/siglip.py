"""SigLIP's vision transformer (Gemma 3's tower: transformers' SiglipVisionModel less its pooling
head, which Gemma 3 does not read): patches of the image through a Conv2d with a bias, learned
positions (no CLS position), CLIP's pre-norm encoder layers of bidirectional attention
(models/clip.py) with a tanh-GELU MLP, then post_layernorm.

Math only, under transformers' names; the loader maps a checkpoint's names onto them."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.clip import CLIPEncoder
from ember.models.vision_config import VisionConfig


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] at the tower's image_size -> [B, patches, hidden], patches row-major."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """pixels [B, C, H, W] -> the last layer's hidden states after post_layernorm [B, patches, hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.encoder = CLIPEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

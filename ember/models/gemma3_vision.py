"""Gemma 3's image side (Gemma3ForConditionalGeneration less its language model, which is
models/llama.py's Gemma 3): the SigLIP tower (models/siglip.py) over an image at its fixed
image_size, then Gemma3MultiModalProjector:

    the tower's patch states [B, s * s, hidden] as a grid s x s
      -> average pool, kernel = stride = s / sqrt(mm_tokens_per_image)
      -> [B, mm_tokens_per_image, hidden], row-major
      -> RMSNorm (Gemma's, scaling by 1 + w: mm_soft_emb_norm)
      -> x @ mm_input_projection_weight [hidden, text hidden]

Each image becomes mm_tokens_per_image embeddings, which the runner places at that image's
image tokens (the processor's <start_of_image>, the image tokens, <end_of_image>: the first and
last keep their own embeddings). In the language model those image tokens attend to each other
both ways (VisionConfig.bidirectional_images; runner/model_runner.py's key_ends)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.norm import RMSNorm
from ember.models.llava import TOWER_PREFIXES, image_side_name
from ember.models.siglip import SiglipVisionTower
from ember.models.vision_config import VisionConfig


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patches_per_side = cfg.image_size // cfg.patch_size
        self.kernel = self.patches_per_side // round(cfg.mm_tokens_per_image ** 0.5)
        self.mm_soft_emb_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, unit_offset=True)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, patches, hidden] -> [B, mm_tokens_per_image, text hidden]."""
        b, _, d = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(b, d, side, side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2).contiguous()
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3Vision(nn.Module):
    """pixel_values [B, C, H, W] (Gemma3ImageProcessor's) -> [B, mm_tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = SiglipVisionTower(cfg)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))


def gemma3_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """Gemma3Vision's name for a checkpoint tensor of the image side; None for any other tensor
    (the language model's) and for a SigLIP pooling head (vision_use_head), which Gemma 3 does
    not read."""
    return image_side_name(name, TOWER_PREFIXES, "encoder.layers.", cfg.num_layers, unread=("head.",))

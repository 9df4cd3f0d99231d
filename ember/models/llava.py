"""LLaVA-1.5's image side (LlavaForConditionalGeneration less its language model, which is
models/llama.py's): the CLIP tower's feature layer (its CLS position dropped under the
"default" strategy), then the projector, linear-GELU-linear, into the language model's
hidden size. Each image becomes `VisionConfig.tokens_per_image` embeddings, which the runner
places at that image's placeholder tokens (runner/multimodal.py)."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.clip import CLIPVisionTower, vision_activation
from ember.models.vision_config import VisionConfig


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.projector_act
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(vision_activation(self.act, self.linear_1(x)))


class LlavaVision(nn.Module):
    """pixel_values [B, C, H, W] (the image processor's) -> [B, tokens_per_image, text hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = CLIPVisionTower(cfg)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.vision_tower(pixel_values)
        if self.config.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


# a checkpoint's names for the image side (transformers 5's, model.vision_tower.*; llava-hf's and
# Gemma 3's on the hub, vision_tower.vision_model.*) -> LlavaVision's (and Gemma3Vision's); for
# LLaVA the tower's layers past the feature layer and its post_layernorm are not read
TOWER_PREFIXES = (("model.vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
             ("vision_tower.vision_model.", "vision_tower."), ("vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("multi_modal_projector.", "multi_modal_projector."))


def llava_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """LlavaVision's name for a checkpoint tensor of the image side; None for any other tensor
    (the language model's) and for the tower's parts LLaVA does not read."""
    return image_side_name(name, TOWER_PREFIXES, "encoder.layers.", cfg.num_layers, unread=("post_layernorm.",))


def image_side_name(name: str, prefixes: tuple[tuple[str, str], ...], layers: str, num_layers: int,
                    unread: tuple[str, ...] = ()) -> str | None:
    """A tower's name for a checkpoint tensor of the image side: the first of `prefixes` (the
    checkpoint's, ours) it starts with, swapped; None for any other tensor, for the tower's
    layers (`layers` + index) from `num_layers` on (past the feature layer) and for `unread` parts."""
    for prefix, ours in prefixes:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith(unread) or (rest.startswith(layers) and int(rest[len(layers):].split(".")[0]) >= num_layers):
                return None
            return ours + rest
    return None

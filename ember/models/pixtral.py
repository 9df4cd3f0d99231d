"""Pixtral's vision tower and the projectors over it (the image side of pixtral-12b's
LlavaForConditionalGeneration and of Mistral3ForConditionalGeneration, less their language
model, which is models/llama.py's Mistral): variable resolution. The image processor resizes an
image to whole patches (at most image_size a side); the tower takes every image's patches at
once, each image attending only to itself (block-diagonal attention), q and k turned by a 2-D
RoPE of the patch's (row, column): a head's first quarter of frequencies (the even ones) by the
row, its second (the odd ones) by the column, rotate-half style.

    patches [N, C * p * p] -> patch_conv (one matmul) -> ln_pre (RMSNorm)
      -> layers: RMSNorm, attention (no biases), RMSNorm, gated MLP -> the feature layer's states
      -> "pixtral": linear-GELU-linear into the text model
         "mistral3": RMSNorm, each merge x merge block of patches side by side (unfold's order:
         channel-major) through merging_layer, then linear-GELU-linear
      -> an image of rows x cols tokens: [rows * (cols + 1), text hidden], laid out as its run of
         placeholder tokens: each row's embeddings then one slot for the row's [IMG_BREAK] (the
         last row's [IMG_END]), a zero row that the runner leaves to the token's own embedding

Math only, under transformers' names; the loader maps a checkpoint's (and an mmproj GGUF's)."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.norm import RMSNorm
from ember.layers.rotary import apply_rotary
from ember.layers.transfer import to_device
from ember.models.clip import vision_activation
from ember.models.llava import LlavaMultiModalProjector, image_side_name
from ember.models.qwen2_vl import Segments, segment_attention, segments_of
from ember.models.vision_config import VisionConfig

Grid = tuple[int, int, int]  # an image's (1, h, w) in patches
T = TypeVar("T")


class PixtralAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        size = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, size // cfg.num_heads
        self.q_proj, self.k_proj = nn.Linear(size, size, bias=False), nn.Linear(size, size, bias=False)
        self.v_proj, self.o_proj = nn.Linear(size, size, bias=False), nn.Linear(size, size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k, _ = apply_rotary(q, k, rope)
        return self.o_proj(segment_attention(q, k, v, segments, self.head_dim ** -0.5).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        size, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(size, inter, bias=False), nn.Linear(size, inter, bias=False)
        self.down_proj = nn.Linear(inter, size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(vision_activation(self.act, self.gate_proj(x)) * self.up_proj(x))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.attention = PixtralAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.feed_forward = PixtralMLP(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, segments)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralAttentionLayer(cfg) for _ in range(cfg.num_layers))


class PixtralVisionTower(nn.Module):
    """Every image's patches [sum N, C * p * p] and grids -> the feature layer's states [sum N, hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_conv = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.ln_pre = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.transformer = PixtralTransformer(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", torch.stack([inv_freq[0::2], inv_freq[1::2]]), persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        weight = self.patch_conv.weight  # the kernel covers the whole patch: the convolution is one matmul
        x = self.ln_pre(F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1)))
        rope = self._rope(grids, x.device).to(x.dtype)
        ends = torch.tensor([h * w for _, h, w in grids]).cumsum(0).tolist()
        segments = segments_of(list(zip([0] + ends[:-1], ends)), x.device)  # each image attends to itself
        for layer in self.transformer.layers:
            x = layer(x, rope, segments)
        return x

    def _rope(self, grids: list[Grid], device: torch.device) -> torch.Tensor:
        """[N, head_dim]: cos | sin of each patch's angles, its row's (even) frequencies then its column's (odd)."""
        pos = torch.cat([torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")).flatten(1).T
                         for _, h, w in grids])
        pos = to_device(pos, device)
        angles = (pos[..., None].float() * self.inv_freq.to(device)).flatten(1)  # [N, head_dim / 2]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


class Mistral3PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.merge_size
        self.merging_layer = nn.Linear(cfg.hidden_size * self.merge ** 2, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """One image's patch states [h * w, hidden] -> [(h / m) * (w / m), hidden]."""
        m, d = self.merge, x.shape[-1]
        blocks = x.view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3).reshape(-1, d * m * m)
        return self.merging_layer(blocks)


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.projector_act
        self.norm = RMSNorm(cfg.hidden_size, cfg.projector_norm_eps)
        self.patch_merger = Mistral3PatchMerger(cfg)
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = self.patch_merger(self.norm(x), h, w)
        return self.linear_2(vision_activation(self.act, self.linear_1(x)))


class PixtralVision(nn.Module):
    """Images of any sizes in one call: their patches concatenated [sum N, C * p * p] and their
    grids (1, h, w) -> each image's embeddings laid out as its placeholder run (module note)."""

    packed = True  # runner/multimodal.py: images of any size go in one call, not batched by shape

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = PixtralVisionTower(cfg)
        self.multi_modal_projector = (Mistral3MultiModalProjector(cfg) if cfg.kind == "mistral3"
                                      else LlavaMultiModalProjector(cfg))

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        states = self.vision_tower(patches, grids)
        m, out = self.config.merge_size, []
        for x, (_, h, w) in zip(states.split([h * w for _, h, w in grids]), grids):
            if self.config.kind == "mistral3":
                x = self.multi_modal_projector(x, h, w)
            else:
                x = self.multi_modal_projector(x)
            rows = x.view(h // m, w // m, -1)
            out.append(torch.cat([rows, rows.new_zeros(h // m, 1, rows.shape[-1])], dim=1).flatten(0, 1))
        return out


def row_tokens(rows: int, cols: int, image: T, row_break: T, end: T) -> list[T]:
    """An image's placeholder run as PixtralProcessor lays it out: each of `rows` rows `cols` image
    tokens then a break token, the last row's break an end token."""
    run = ([image] * cols + [row_break]) * rows
    run[-1] = end
    return run


# a checkpoint's names for the image side (transformers 5's model.vision_tower.*, the hub's
# vision_tower.*) -> PixtralVision's; the tower's layers past the feature layer are not read
_PREFIXES = (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."),
             ("multi_modal_projector.", "multi_modal_projector."))


def pixtral_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """PixtralVision's name for a checkpoint tensor of the image side; None for any other tensor
    (the language model's) and for the tower's layers past the feature layer."""
    return image_side_name(name, _PREFIXES, "transformer.layers.", cfg.num_layers)

"""Qwen3-VL's vision tower (the image side of Qwen3VLForConditionalGeneration less its language
model, which is models/llama.py's Qwen3 with interleaved M-RoPE). Qwen2-VL's tower
(models/qwen2_vl.py: the same patches, blocks and 2-D RoPE, attention within each frame) with:

    patches -> patch_embed (biased) + learned positions: the side x side table
               (num_position_embeddings) resized bilinearly (corners aligned) to the frame's h x w
      -> blocks; after each block deepstack_visual_indexes names, a deepstack merger
         (LayerNorm over the merge x merge patches side by side, then linear-GELU-linear)
      -> merger (LayerNorm per patch, then the same) -> one embedding an image token

The text model adds the k-th deepstack merger's output to its hidden states after its layer k,
at the image tokens' rows. The tower returns each image's [tokens, (1 + k) * text hidden]: its
embeddings, then its deepstack rows side by side (runner/multimodal.py splits them).

Math only, under transformers' names (model.visual.*), but for the blocks' MLP, which is
qwen2_vl.py's VisionMLP: the loader maps linear_fc1 / linear_fc2 to fc1 / fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.transfer import to_device
from ember.models.qwen2_vl import (
    Grid,
    PatchEmbed,
    TowerPlan,
    VisionBlock,
    axial_inv_freq,
    axial_rope,
    frame_segments,
    merge_order,
)
from ember.models.vision_config import VisionConfig


class Qwen3PatchMerger(nn.Module):
    """norm, then merge x merge patches side by side, linear-GELU-linear; a deepstack merger
    (`postshuffle`) normalizes the patches side by side instead of each patch."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.merged, self.postshuffle = cfg.hidden_size * cfg.merge_size ** 2, postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """Images of any sizes in one call: their patches concatenated [sum N, C * tps * p * p] and
    their grids -> each image's [N / merge^2, (1 + deepstack) * text hidden]."""

    packed = True  # runner/multimodal.py: images of any size go in one call, not batched by shape

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.deepstack_layers = len(cfg.deepstack_blocks)  # the text model's layers that take deepstack rows
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))
        self.merger = Qwen3PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_blocks)
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        return self.run(patches, self.plan(grids, patches.device))

    def plan(self, grids: list[Grid], device: torch.device) -> TowerPlan:
        """Every tensor the forward derives from the grids (the learned positions too), on `device`."""
        cfg = self.config
        return TowerPlan(axial_rope(grids, cfg.merge_size, self.inv_freq, device), frame_segments(grids, device),
                         [t * h * w // cfg.merge_size ** 2 for t, h, w in grids], positions=self._positions(grids))

    def run(self, patches: torch.Tensor, plan: TowerPlan) -> list[torch.Tensor]:
        """The forward over the patches of the images `plan` was made for (no host work: it
        replays as a CUDA graph)."""
        cfg = self.config
        x = self.patch_embed(patches)
        x = x + plan.positions.to(x.dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan.rope, plan.frames)
            if i in cfg.deepstack_blocks:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_blocks.index(i)](x))
        merged = torch.cat([self.merger(x), *deepstack], dim=-1)
        return list(merged.split(plan.sizes))

    def _positions(self, grids: list[Grid]) -> torch.Tensor:
        """[N, hidden]: each patch's learned position, the table resized to its frame's grid."""
        side = int(self.config.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
            rows, cols = (to_device(pos, grid.device) for pos in merge_order(h, w, self.config.merge_size))
            out.append(grid[:, rows, cols].t().repeat(t, 1))
        return torch.cat(out)


# a checkpoint's names for the tower (transformers 5's modules' model.visual.*, the hub's visual.*)
_PREFIXES = ("model.visual.", "visual.")


def qwen3_vl_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """Qwen3VisionTower's name for a checkpoint tensor of the image side; None for any other."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            return name.replace(".mlp.linear_fc", ".mlp.fc") if name.startswith("blocks.") else name
    return None

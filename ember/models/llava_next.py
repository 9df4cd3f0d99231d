"""LLaVA-NeXT's image side (LlavaNextForConditionalGeneration less its language model): "anyres".
The image processor gives an image as its base view (the whole image at the tower's size S)
and the S x S tiles of the image resized and padded to the best of image_grid_pinpoints;
models/llava.py's tower and projector run on every view. The tiles' patch features are put
back together as one grid, the rows (or columns) that only cover the padding cut off, and
`image_newline` appended after each grid row; the base view's features go first:

    an image 500 wide, 300 high; best pinpoint (336, 672): 1 x 2 tiles of 24 x 24 patches,
    a grid of 24 rows x 48 columns, of which the image (scaled to 24 rows) covers 40 columns:
    columns 4..43 kept
    embeddings: base view (576) | row 0 (40), newline | row 1 (40), newline | ... 24 rows: 1560

The counts follow the image's size alone (`feature_count`), as transformers'
LlavaNextProcessor expands the image token."""

from __future__ import annotations

import torch
from torch import nn

from ember.models.llava import LlavaVision, llava_tensor_name
from ember.models.vision_config import VisionConfig


def best_resolution(image_size: tuple[int, int], pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The pinpoint (height, width) an image of `image_size` (height, width) is tiled at: the one
    showing most of its pixels once scaled to fit, then the one wasting the fewest pixels."""
    height, width = image_size
    best, best_key = pinpoints[0], None
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        shown = min(int(width * scale) * int(height * scale), width * height)
        key = (shown, -(ph * pw - shown))
        if best_key is None or key > best_key:
            best, best_key = (ph, pw), key
    return best


def tile_grid(image_size: tuple[int, int], cfg: VisionConfig) -> tuple[int, int]:
    """(rows, columns) of tiles an image is cut into."""
    height, width = best_resolution(image_size, cfg.grid_pinpoints)
    return height // cfg.image_size, width // cfg.image_size


def kept_patches(image_size: tuple[int, int], rows: int, cols: int) -> tuple[slice, slice]:
    """Of a grid of rows x cols patches over the image padded to the grid's aspect ratio (centred),
    the rows and columns the image covers."""
    height, width = image_size
    if width / height > cols / rows:  # the padding is above and below
        covered = int(round(height * (cols / width), 7))
        pad = (rows - covered) // 2
        return slice(pad, rows - pad), slice(0, cols)
    covered = int(round(width * (rows / height), 7))
    pad = (cols - covered) // 2
    return slice(0, rows), slice(pad, cols - pad)


def feature_count(image_size: tuple[int, int], cfg: VisionConfig) -> int:
    """The embeddings (and placeholder tokens) of an image of `image_size` (height, width)."""
    side = cfg.image_size // cfg.patch_size
    tile_rows, tile_cols = tile_grid(image_size, cfg)
    rows, cols = kept_patches(image_size, tile_rows * side, tile_cols * side)
    return side * side + (rows.stop - rows.start) * (cols.stop - cols.start + 1)


def num_views(image_size: tuple[int, int], cfg: VisionConfig) -> int:
    """The views the tower sees of an image: its base view and its tiles."""
    rows, cols = tile_grid(image_size, cfg)
    return 1 + rows * cols


class LlavaNextVision(nn.Module):
    """Every image's views [sum of views, C, S, S] and the images' (height, width) -> each image's
    [feature_count, text hidden] embeddings."""

    tiled = True  # runner/multimodal.py: called on the images' views concatenated, with their sizes

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.views = LlavaVision(cfg)  # its parameters under LLaVA's names (vision_tower.*, multi_modal_projector.*)
        self.image_newline = nn.Parameter(torch.empty(cfg.text_hidden_size))

    def forward(self, pixel_values: torch.Tensor, image_sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        features = self.views(pixel_values)  # [views, side * side, hidden]
        counts = [num_views(size, self.config) for size in image_sizes]
        return [self._pack(f, size) for f, size in zip(features.split(counts), image_sizes)]

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        side = self.config.image_size // self.config.patch_size
        tile_rows, tile_cols = tile_grid(image_size, self.config)
        grid = (features[1:].view(tile_rows, tile_cols, side, side, -1).permute(0, 2, 1, 3, 4)
                .reshape(tile_rows * side, tile_cols * side, -1))
        rows, cols = kept_patches(image_size, tile_rows * side, tile_cols * side)
        grid = grid[rows, cols]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).flatten(0, 1)])


def llava_next_tensor_name(name: str, cfg: VisionConfig) -> str | None:
    """LlavaNextVision's name for a checkpoint tensor of the image side; None for any other."""
    if name in ("image_newline", "model.image_newline"):
        return "image_newline"
    ours = llava_tensor_name(name, cfg)
    return None if ours is None else "views." + ours

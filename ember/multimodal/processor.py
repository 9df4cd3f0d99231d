"""ImageProcessor: a prompt's text and images -> its token ids, each image's placeholder
tokens expanded, and one ImageFeature an image. The model's own processor from transformers
does the work (AutoProcessor on its PIL backend: resizing, cropping, normalizing, and the
placeholder expansion its family does; for Qwen2-VL its image processor and tokenizer, see
`_process_grids`); ember only finds where each image's tokens landed.
Slow (PIL and numpy): the server runs it on its input pool, off the event loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from ember.models.llava_next import feature_count, num_views
from ember.models.vision_config import VisionConfig
from ember.multimodal.inputs import ImageFeature, pixels_hash


class ImageProcessor:
    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        import transformers

        self.vision = vision
        self.processor = self.tokenizer = None
        try:
            if vision.dynamic_resolution:
                # transformers' Qwen2VLProcessor cannot be made without its video processor, which
                # needs torchvision: its image processor (the PIL one) and its tokenizer, and the
                # processor's expansion of each image token into grid t * h * w / merge^2 of them here
                self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
                self.image_token: str = self.tokenizer.convert_ids_to_tokens(vision.image_token_id)
            else:
                self.processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
                self.image_token = self.processor.image_token
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: the model's processor (processor_config.json / "
                             f"preprocessor_config.json) cannot be loaded: {str(e)[:300]}") from None
        if vision.kind == "llava_next":
            _check_tiling(self.processor.image_processor, vision, model_dir)
        self._lock = threading.Lock()  # a transformers processor is not known to be thread-safe

    def process(self, text: str, images: list[Any], add_special_tokens: bool) -> tuple[list[int], list[ImageFeature]]:
        """Token ids of `text` with its images' placeholders expanded, and the images' features.
        `text` has one image token (`image_token`) where each image goes, in order."""
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders ({self.image_token!r}) for {len(images)} "
                             f"images: put one {self.image_token!r} where each image goes")
        if self.vision.dynamic_resolution:
            return self._process_grids(text, images, add_special_tokens)
        with self._lock:
            enc = self.processor(text=[text], images=images, add_special_tokens=add_special_tokens,
                                 return_tensors="np")
        ids = [int(t) for t in enc["input_ids"][0]]
        pixels = np.asarray(enc["pixel_values"], dtype=np.float32)
        if self.vision.kind == "llava_next":  # each image's views (padded to the most views of the prompt's) and size
            sizes = [(int(h), int(w)) for h, w in enc["image_sizes"]]
            return ids, self._features(ids, [p[:num_views(s, self.vision)] for p, s in zip(pixels, sizes)], sizes)
        return ids, self._features(ids, list(pixels))

    def _process_grids(self, text: str, images: list[Any], add_special_tokens: bool
                       ) -> tuple[list[int], list[ImageFeature]]:
        """Qwen2-VL: each image's patches and grid (t, h, w); its image token repeated
        t * h * w / merge^2 times in the text, as Qwen2VLProcessor expands it."""
        with self._lock:
            enc = self.processor(images=images, return_tensors="np")
            grids = [tuple(int(x) for x in g) for g in enc["image_grid_thw"]]
            counts = [t * h * w // self.vision.merge_size ** 2 for t, h, w in grids]
            parts = text.split(self.image_token)
            text = parts[0] + "".join(self.image_token * n + part for n, part in zip(counts, parts[1:]))
            ids = [int(t) for t in self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
        pixels = np.split(np.asarray(enc["pixel_values"], dtype=np.float32),
                          np.cumsum([t * h * w for t, h, w in grids])[:-1])
        runs = _runs_of(ids, self.vision.image_token_id)
        if [n for _, n in runs] != counts:
            raise ValueError(f"the processor placed image tokens in runs of {[n for _, n in runs]} for images of "
                             f"{counts}: the image token {self.image_token!r} in the text itself is not allowed")
        # the hash sees the grid too (the patches' shape alone would not tell 2 x 8 from 8 x 2)
        return ids, [ImageFeature(start, n, pixels_hash(p.reshape(*g, -1)), p, g)
                     for (start, n), p, g in zip(runs, pixels, grids)]

    def _features(self, ids: list[int], pixels: list[np.ndarray], sizes: list[tuple[int, int]] | None = None
                  ) -> list[ImageFeature]:
        """Each image's run of placeholder tokens, in order: the image token's positions cut
        into runs of each image's embeddings (LLaVA-1.5: tokens_per_image; LLaVA-NeXT: as
        many as its size gives)."""
        token = self.vision.image_token_id
        positions = [i for i, t in enumerate(ids) if t == token]
        if sizes is None:
            counts = [self.vision.tokens_per_image] * len(pixels)
        else:
            counts = [feature_count(s, self.vision) for s in sizes]
        if len(positions) != sum(counts):
            raise ValueError(f"the processor placed {len(positions)} image tokens for {len(pixels)} images of "
                             f"{counts} embeddings: a token id {token} in the text itself is not allowed, and the "
                             "model's processor files must tile and count as its config.json does "
                             "(image_grid_pinpoints, patch_size, vision_feature_select_strategy)")
        features, cut = [], 0
        for p, count, size in zip(pixels, counts, sizes or [None] * len(pixels)):
            start = positions[cut]
            if positions[cut + count - 1] != start + count - 1:
                raise ValueError("an image's placeholder tokens are not one run: the image token appears in the "
                                 "text itself")
            cut += count
            features.append(ImageFeature(start, count, pixels_hash(p, size), p, image_size=size))
        return features


def _runs_of(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids, in order."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == token:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def _check_tiling(images: Any, vision: VisionConfig, model_dir: str | Path) -> None:
    """LLaVA-NeXT: the image processor cuts tiles as config.json's model puts them back together
    (its pinpoints, tiles of the tower's image_size), else the tower would get other views."""
    pinpoints = tuple(tuple(int(x) for x in p) for p in images.image_grid_pinpoints)
    tile = (images.crop_size.height, images.crop_size.width)
    if pinpoints != vision.grid_pinpoints or tile != (vision.image_size, vision.image_size):
        raise ValueError(f"{model_dir}: the image processor tiles at {[list(p) for p in pinpoints]} in tiles of "
                         f"{tile[0]} x {tile[1]}; config.json's model at {[list(p) for p in vision.grid_pinpoints]} "
                         f"in tiles of {vision.image_size}: make the processor's image_grid_pinpoints and crop_size "
                         "those of config.json")

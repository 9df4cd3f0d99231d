"""ImageProcessor: a prompt's text and images -> its token ids, each image's placeholder
tokens expanded, and one ImageFeature an image. The model's own processor from transformers
does the work (AutoProcessor on its PIL backend: resizing, cropping, normalizing, and the
placeholder expansion its family does); ember only finds where each image's tokens landed.
Slow (PIL and numpy): the server runs it on its input pool, off the event loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from ember.models.vision_config import VisionConfig
from ember.multimodal.inputs import ImageFeature, pixels_hash


class ImageProcessor:
    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        import transformers

        try:
            self.processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_dir}: the model's processor (processor_config.json / "
                             f"preprocessor_config.json) cannot be loaded: {str(e)[:300]}") from None
        self.vision = vision
        self.image_token: str = self.processor.image_token
        self._lock = threading.Lock()  # a transformers processor is not known to be thread-safe

    def process(self, text: str, images: list[Any], add_special_tokens: bool) -> tuple[list[int], list[ImageFeature]]:
        """Token ids of `text` with its images' placeholders expanded, and the images' features.
        `text` has one image token (`image_token`) where each image goes, in order."""
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders ({self.image_token!r}) for {len(images)} "
                             f"images: put one {self.image_token!r} where each image goes")
        with self._lock:
            enc = self.processor(text=[text], images=images, add_special_tokens=add_special_tokens,
                                 return_tensors="np")
        ids = [int(t) for t in enc["input_ids"][0]]
        pixels = np.asarray(enc["pixel_values"], dtype=np.float32)
        return ids, self._features(ids, list(pixels))

    def _features(self, ids: list[int], pixels: list[np.ndarray]) -> list[ImageFeature]:
        """Each image's run of placeholder tokens, in order: the image token's positions cut
        into len(pixels) equal runs (every LLaVA-1.5 image has tokens_per_image of them)."""
        token = self.vision.image_token_id
        positions = [i for i, t in enumerate(ids) if t == token]
        count = self.vision.tokens_per_image
        if len(positions) != count * len(pixels):
            raise ValueError(f"the processor placed {len(positions)} image tokens for {len(pixels)} images of "
                             f"{count}: a token id {token} in the text itself is not allowed")
        features = []
        for i, p in enumerate(pixels):
            start = positions[i * count]
            if positions[(i + 1) * count - 1] != start + count - 1:
                raise ValueError("an image's placeholder tokens are not one run: the image token appears in the "
                                 "text itself")
            features.append(ImageFeature(start, count, pixels_hash(p), p))
        return features

"""ImageFeature: one image of a request, as the engine carries it from the boundary to the
runner: its processed pixels, where its placeholder tokens sit in the prompt, and a hash of
its pixels, which keys the encoder-output cache and the prefix cache's blocks over it. Each view
of a Gemma 3 image under pan-and-scan (the whole image, each crop) is one. A video
is one too (Qwen2-VL, Qwen2.5-VL: its frames' patches, grid (T, h, w), one run of video tokens)
or one a temporal patch (Qwen3-VL, whose frames' runs of video tokens have their times between).
Plain data (numpy arrays): it crosses the engine core's process boundary by pickle."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class ImageFeature:
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens, each one of its embeddings, in order
    hash: str  # of the processed pixels (hex)
    pixel_values: np.ndarray  # what the model's image processor made of it ([C, H, W] for LLaVA)
    # Qwen2-VL: its (t, h, w) in patches (image_grid_thw); pixel_values are its patches [t * h * w, ...]
    grid_thw: tuple[int, int, int] | None = None
    # LLaVA-NeXT: the image's (height, width), which its tiling and unpadding follow;
    # pixel_values are its views [1 + tiles, C, H, W]
    image_size: tuple[int, int] | None = None
    # Qwen2.5-VL's video: the M-RoPE temporal position step of each patch in time (transformers'
    # tokens_per_second * second_per_grid_t); 1 for an image and every other family's video
    time_interval: float = 1.0

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def cache_key(self) -> int:
        """What the prefix cache keys each of its placeholder tokens by in place of the token id:
        a negative int from the hash, so no text token and no other image share it."""
        return -1 - int(self.hash[:15], 16)


def pixels_hash(pixel_values: np.ndarray, extra: object = None) -> str:
    """The hash of an image's processed pixels (their bytes, dtype and shape) and of `extra`,
    what else its embeddings or its tokens' positions follow (LLaVA-NeXT's image size, a video's
    time_interval)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{pixel_values.dtype}{pixel_values.shape}{'' if extra is None else extra}".encode())
    h.update(np.ascontiguousarray(pixel_values).tobytes())
    return h.hexdigest()


def content_hash(kind: str, digest: bytes, grid: tuple[int, int, int]) -> str:
    """The hash of an image a family's processor turns into patches by its content alone (no
    per-prompt settings: Qwen2-VL's family, Pixtral's): the family, the image's content digest
    (multimodal/cache.py image_digest) and its grid. In one engine its patches follow from these,
    so this keys them as pixels_hash would, without copying and hashing the ~8x larger float32
    patches (20-28 ms of CPU of a 1024 x 768 image's 100-140 ms of preparation on a 2-vCPU EPYC)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}{grid}".encode())
    h.update(digest)
    return h.hexdigest()


def cache_keys(token_ids: Sequence[int], features: Sequence[ImageFeature]) -> list[int]:
    """The prompt as the prefix cache keys it: each image's placeholder tokens replaced by its
    cache key, so the same image in two prompts shares blocks and two images never do."""
    keys = list(token_ids)
    for f in features:
        keys[f.offset:f.end] = [f.cache_key] * f.length
    return keys

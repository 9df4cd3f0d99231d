"""Videos for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a video's frames -> its patches and grid, as the
families' video processors make them. transformers' video processors need torchvision, which
ember does not install, so this is their math on the PIL image processor's (Qwen2VLImageProcessor):

    frames (one size; the sampled frames: ember samples none)
      -> one (h, w) for all: the family's smart_resize (Qwen3-VL's counts every frame's pixels)
      -> each frame resized (PIL, the config's resample), rescaled and normalized by the image
         processor, which patchifies it (merge blocks in order) as a frame repeated in time
      -> frames padded to whole temporal patches with the last, each temporal_patch_size of them
         one patch in time: [T * h * w, C * tps * p * p], grid (T, h, w)

The settings are video_preprocessor_config.json's (else preprocessor_config.json's, as
transformers falls back), over the family's video processor defaults. Where a frame's time goes:
Qwen2.5-VL's temporal positions step by tokens_per_second * tps / fps; Qwen3-VL writes each
temporal patch's time as text ("<0.1 seconds>") before its own run of video tokens. fps: the
caller's, else 24, transformers' for frames without metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ember.models.vision_config import VisionConfig

DEFAULT_FPS = 24.0  # transformers' for frames given without their video's metadata
# the families' video processors' class defaults (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor)
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
_DEFAULTS = {
    "qwen2_vl": {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
                 "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "max_frames": 768},
    "qwen3_vl": {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "max_frames": 768},
}
_DEFAULTS["qwen2_5_vl"] = _DEFAULTS["qwen2_vl"]
_COMMON = {"temporal_patch_size": 2, "merge_size": 2, "resample": 3, "do_resize": True, "do_rescale": True,
           "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}


@dataclass(frozen=True)
class VideoPatches:
    patches: np.ndarray  # [T * h * w, C * tps * p * p] float32, in the tower's order
    grid: tuple[int, int, int]  # (T, h, w) in patches
    fps: float  # the frames' rate


class VideoProcessor:
    def __init__(self, model_dir: Path, vision: VisionConfig, images: Any) -> None:
        """`images`: the model's PIL image processor (Qwen2VLImageProcessorPil)."""
        self.vision, self.images = vision, images
        file = model_dir / "video_preprocessor_config.json"
        if not file.is_file():
            file = model_dir / "preprocessor_config.json"
        given = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        s = _COMMON | _DEFAULTS[vision.kind] | given
        size = s["size"] if "size" in given or not {"min_pixels", "max_pixels"} & set(given) else \
            {"shortest_edge": s.get("min_pixels"), "longest_edge": s.get("max_pixels")}
        self.min_pixels, self.max_pixels = size.get("shortest_edge"), size.get("longest_edge")
        if not self.min_pixels or not self.max_pixels:
            raise ValueError(f"{file}: the video size needs shortest_edge and longest_edge (min / max pixels)")
        layout = (s["patch_size"], s["temporal_patch_size"], s["merge_size"])
        if layout != (vision.patch_size, vision.temporal_patch_size, vision.merge_size):
            raise ValueError(f"{file}: videos in patches of {layout[0]} x {layout[1]} frames merged {layout[2]} x "
                             f"{layout[2]}; config.json's tower takes {vision.patch_size} x "
                             f"{vision.temporal_patch_size} merged {vision.merge_size} x {vision.merge_size}")
        refused = {"cap_pixels_per_frame": True, "do_resize": False, "do_convert_rgb": False}
        for key, value in refused.items():
            if s.get(key) == value:
                raise ValueError(f"{file}: {key} {value} is not supported for videos: ember resizes every frame "
                                 "to the family's smart_resize size, in RGB, with no cap a frame")
        self.settings = {key: s[key] for key in ("image_mean", "image_std", "rescale_factor", "do_rescale",
                                                   "do_normalize")}
        self.resample, self.max_frames = s["resample"], int(s["max_frames"])

    def process(self, frames: list[Any], fps: float | None) -> VideoPatches:
        """One video's patches and grid from its frames (PIL images of one size)."""
        from PIL import Image

        if not frames:
            raise ValueError("a video has no frames: give its frames as a list of images")
        if len(frames) > self.max_frames:
            raise ValueError(f"a video of {len(frames)} frames is over the model's max_frames {self.max_frames}: "
                             "sample fewer frames")
        if len({f.size for f in frames}) > 1:
            raise ValueError(f"a video's frames differ in size ({sorted({f.size for f in frames})[:3]}): give frames "
                             "of one size")
        width, height = frames[0].size
        h, w = self._size(len(frames), height, width)
        tps, p = self.vision.temporal_patch_size, self.vision.patch_size
        resized = [f.convert("RGB").resize((w, h), Image.Resampling(self.resample)) for f in frames]
        enc = self.images(images=resized, do_resize=False, patch_size=p, temporal_patch_size=tps,
                          merge_size=self.vision.merge_size, return_tensors="np", **self.settings)
        per_frame = np.asarray(enc["pixel_values"], dtype=np.float32).reshape(len(frames), (h // p) * (w // p),
                                                                               -1, tps, p * p)[:, :, :, 0]
        per_frame = np.concatenate([per_frame, per_frame[-1:].repeat(-len(frames) % tps, axis=0)])
        t = len(per_frame) // tps  # [t, tps, h * w, C, p * p] -> [t, h * w, C, tps, p * p]
        patches = per_frame.reshape(t, tps, *per_frame.shape[1:]).transpose(0, 2, 3, 1, 4)
        return VideoPatches(np.ascontiguousarray(patches.reshape(t * (h // p) * (w // p), -1)),
                            (t, h // p, w // p), float(fps or DEFAULT_FPS))

    def _size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Every frame's (height, width) in pixels: the family's video smart_resize."""
        factor = self.vision.patch_size * self.vision.merge_size
        if self.vision.kind == "qwen3_vl":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

            return smart_resize(num_frames, height, width, self.vision.temporal_patch_size, factor,
                                self.min_pixels, self.max_pixels)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)


def frame_times(num_frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL: each temporal patch's time in seconds (its frames' mean), as Qwen3VLProcessor
    computes it for frames 0 .. num_frames - 1."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return Qwen3VLProcessor._calculate_timestamps(None, list(range(num_frames)), fps, temporal_patch_size)

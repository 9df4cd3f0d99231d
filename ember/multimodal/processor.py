"""ImageProcessor: a prompt's text and images -> its token ids, each image's placeholder
tokens expanded, and one ImageFeature an image (Gemma 3 with pan-and-scan: one a view, the
image and each of its crops). The model's own processor from transformers does the work
(AutoProcessor on its PIL backend: resizing, cropping, normalizing, and the placeholder
expansion its family does (Gemma 3's <start_of_image> into its image tokens between
<start_of_image> and <end_of_image>, and pan-and-scan's crops and text); for Qwen2-VL its
image processor and tokenizer, see `_process_grids`; for Pixtral and Mistral 3 its image
processor and PixtralProcessor's layout, see `_process_rows`); ember only finds where each
image's tokens landed.
Slow (PIL and numpy): the server runs it on its input pool, off the event loop, on as many
images at once as the pool has threads: each thread works with its own copy of the processor
(and tokenizer), as transformers does not say its processors are thread-safe. An image's
patches, grid and hash (Qwen2-VL's family, Pixtral's) are kept by its content (cache.py's
image_digest) in a cache of PROCESSED_CACHE_BYTES, so the same image again skips the processor:
its prompt comes out the same, ids, features and hashes."""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ember.models.llava_next import feature_count, num_views
from ember.models.pixtral import row_tokens
from ember.models.vision_config import VisionConfig
from ember.multimodal.cache import BytesLRU, image_digest
from ember.multimodal.inputs import ImageFeature, content_hash, pixels_hash
from ember.multimodal.video import VideoPatches, VideoProcessor, frame_times

if TYPE_CHECKING:
    from ember.loader.tokenizer import Tokenizer

PROCESSED_CACHE_BYTES = 256 << 20  # processed images' patches kept for the same image sent again


class Processed(NamedTuple):
    """One image as its prompt's features take it: its patches [h * w, ...] (read-only: every
    prompt of the image shares them), its grid (t, h, w) in patches, and its hash."""
    patches: np.ndarray
    grid: tuple[int, int, int]
    hash: str


class _Parts(NamedTuple):
    """One thread's copies of the model's processor, tokenizer and video processor."""
    processor: Any
    tokenizer: Any
    videos: VideoProcessor | None


class ImageProcessor:
    def __init__(self, model_dir: str | Path, vision: VisionConfig, tokenizer: Tokenizer | None = None,
                 cache_bytes: int = PROCESSED_CACHE_BYTES) -> None:
        """`tokenizer`: the engine's, which Pixtral's and the GGUFs' expanded prompts are
        tokenized with (the other families' processors carry their own). `cache_bytes`: the
        processed images kept (0: none). `processor`, `tokenizer` and `videos` are the loaded
        ones, which each thread copies (`_own`) before it processes anything."""
        import transformers

        self.vision = vision
        self.processor = self.tokenizer = self.videos = None
        self.from_gguf = Path(model_dir).suffix == ".gguf"
        self.expanded: str | None = None  # Gemma 3 from a GGUF: what each <start_of_image> becomes
        # Gemma 3 from its HF directory: whether its processor config has pan-and-scan on (a
        # request's mm_processor_kwargs may turn it on or off); None: the processor has none
        self.pan_and_scan: bool | None = None
        self.cache: BytesLRU[Processed] = BytesLRU(cache_bytes, lambda p: p.patches.nbytes)
        self._local = threading.local()
        self._copying = threading.Lock()  # the loaded parts are read by one copy at a time
        if vision.row_tokens:
            self._init_rows(Path(model_dir), tokenizer)
            return
        if self.from_gguf:
            self._init_gguf(tokenizer)
            return
        try:
            if vision.dynamic_resolution:
                # transformers' Qwen2VLProcessor cannot be made without its video processor, which
                # needs torchvision: its image processor (the PIL one) and its tokenizer, and the
                # processor's expansion of each image token into grid t * h * w / merge^2 of them here
                self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
                self.encode = lambda text, special: self._own().tokenizer(text, add_special_tokens=special)["input_ids"]
                self.image_token: str = self.tokenizer.convert_ids_to_tokens(vision.image_token_id)
                self.video_token: str = self.tokenizer.convert_ids_to_tokens(vision.video_token_id)
                self.vision_marks = tuple(getattr(self.tokenizer, name, default) for name, default in (
                    ("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>")))
                self.videos = VideoProcessor(Path(model_dir), vision, self.processor)
            else:
                self.processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
                self.image_token = self.processor.image_token
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: a tokenizer without a token it names
            raise ValueError(f"{model_dir}: the model's processor (processor_config.json / "
                             f"preprocessor_config.json, the tokenizer's special tokens) cannot be loaded: "
                             f"{str(e)[:300]}") from None
        if vision.kind == "llava_next":
            _check_tiling(self.processor.image_processor, vision, model_dir)
        if vision.kind == "gemma3":
            _check_gemma3(self.processor, vision, model_dir)
            self.pan_and_scan = bool(self.processor.image_processor.do_pan_and_scan)

    def process(self, text: str, images: list[Any], add_special_tokens: bool,
                videos: Sequence[tuple[list[Any], float | None]] = (), pan_and_scan: bool | None = None
                ) -> tuple[list[int], list[ImageFeature]]:
        """Token ids of `text` with its images' (and videos') placeholders expanded, and their
        features in prompt order. `text` has one image token (`image_token`) where each image goes
        and one video token where each video (its frames, and their fps or None) goes, in order.
        `pan_and_scan`: Gemma 3's do_pan_and_scan for this prompt (None: the processor config's);
        with it on, each view of an image (the whole image, then each crop the processor cut)
        is a feature of its own (see `_pan_and_scan`)."""
        found = text.count(self.image_token)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholders ({self.image_token!r}) for {len(images)} "
                             f"images: put one {self.image_token!r} where each image goes")
        if videos and self.videos is None:
            raise ValueError(f"this model ({self.vision.kind}) takes no video: give its frames as images")
        if self.vision.dynamic_resolution:
            if text.count(self.video_token) != len(videos):
                raise ValueError(f"the prompt has {text.count(self.video_token)} video placeholders "
                                 f"({self.video_token!r}) for {len(videos)} videos: put one {self.video_token!r} "
                                 "where each video goes")
            return self._process_grids(text, images, videos, add_special_tokens)
        if self.vision.row_tokens:
            return self._process_rows(text, images, add_special_tokens)
        if self.expanded is not None:  # Gemma 3 from a GGUF
            pixels = np.asarray(self._own().processor(images=images, return_tensors="np")["pixel_values"], np.float32)
            ids = self.encode(text.replace(self.image_token, self.expanded), add_special_tokens)
            return ids, self._features(ids, list(pixels))
        if self.pan_and_scan is not None:
            return self._pan_and_scan(text, images, add_special_tokens,
                                      self.pan_and_scan if pan_and_scan is None else pan_and_scan)
        enc = self._own().processor(text=[text], images=images, add_special_tokens=add_special_tokens,
                                    return_tensors="np")
        ids = [int(t) for t in enc["input_ids"][0]]
        pixels = np.asarray(enc["pixel_values"], dtype=np.float32)
        if self.vision.kind == "llava_next":  # each image's views (padded to the most views of the prompt's) and size
            sizes = [(int(h), int(w)) for h, w in enc["image_sizes"]]
            return ids, self._features(ids, [p[:num_views(s, self.vision)] for p, s in zip(pixels, sizes)], sizes)
        return ids, self._features(ids, list(pixels))

    def _own(self) -> _Parts:
        """This thread's processor, tokenizer and video processor: copies of the loaded ones,
        made on its first image."""
        own = getattr(self._local, "parts", None)
        if own is None:
            with self._copying:
                own = self._local.parts = _Parts(*copy.deepcopy((self.processor, self.tokenizer, self.videos)))
        return own

    def _cached(self, image: Any, process: Callable[[Any], tuple[np.ndarray, tuple[int, int, int]]]) -> Processed:
        """`process(image)`'s patches and grid, hashed by the image's content (inputs.py
        content_hash), or what it gave for an image of the same content before. The key is the
        family and the content: the families that use it take no per-prompt processor settings,
        and each ImageProcessor (one model's processor files) has its own cache."""
        key = (self.vision.kind, image_digest(image))
        done = self.cache.get(key)
        if done is None:
            patches, grid = process(image)
            patches.flags.writeable = False
            done = Processed(patches, grid, content_hash(*key, grid))
            self.cache.put(key, done)
        return done

    def _pan_and_scan(self, text: str, images: list[Any], add_special_tokens: bool, on: bool
                      ) -> tuple[list[int], list[ImageFeature]]:
        """Gemma 3 through its Gemma3Processor with do_pan_and_scan `on` or off. On, the processor
        cuts each image too elongated (pan_and_scan_min_ratio_to_activate) into crops and writes
        "Here is the original image <the image's run> and here are some crops to help you see
        better <a run a crop>"; every run is its own feature (its own pixels, its own
        bidirectional block, as transformers' token_type_ids groups them, its own encoder-budget
        cost), the prompt-level image count (limit_mm_per_prompt) still one an image. The hash
        of every view made with pan-and-scan on carries the setting, so the same image with and
        without never shares the encoder cache or prefix-cache blocks."""
        enc = self._own().processor(text=[text], images=images, add_special_tokens=add_special_tokens,
                                    do_pan_and_scan=on, return_tensors="np")
        ids = [int(t) for t in enc["input_ids"][0]]
        pixels = list(np.asarray(enc["pixel_values"], dtype=np.float32))
        return ids, self._features(ids, pixels, tag=PAN_AND_SCAN if on else None)

    def _process_grids(self, text: str, images: list[Any], videos: Sequence[tuple[list[Any], float | None]],
                       add_special_tokens: bool) -> tuple[list[int], list[ImageFeature]]:
        """Qwen2-VL's family: each image's patches and grid (t, h, w), its image token repeated
        t * h * w / merge^2 times in the text, as Qwen2VLProcessor expands it; each video's
        (multimodal/video.py) likewise in video tokens, and Qwen3-VL's laid out as
        Qwen3VLProcessor does: each temporal patch its time, then its own run between
        <|vision_start|> and <|vision_end|> (the template's wrapper around the video token dropped)."""
        unit, qwen3 = self.vision.merge_size ** 2, self.vision.kind == "qwen3_vl"
        own = self._own()
        done = [self._cached(image, lambda image: _grid_patches(own.processor, image)) for image in images]
        clips = [own.videos.process(frames, fps) for frames, fps in videos]
        counts = [t * h * w // unit for _, (t, h, w), _ in done]
        vstart, vend = self.vision_marks
        video = re.escape(self.video_token)
        wrapped = f"{re.escape(vstart)}{video}{re.escape(vend)}|" if qwen3 else ""
        parts = re.split(f"({re.escape(self.image_token)}|{wrapped}{video})", text)
        expanded, next_image, next_video = [parts[0]], iter(counts), iter(clips)
        for placeholder, after in zip(parts[1::2], parts[2::2]):
            if placeholder == self.image_token:
                expanded.append(self.image_token * next(next_image))
            else:
                expanded.append(self._video_text(next(next_video), vstart, vend))
            expanded.append(after)
        ids = [int(t) for t in self.encode("".join(expanded), add_special_tokens)]
        image_runs = _runs_of(ids, self.vision.image_token_id)
        if [n for _, n in image_runs] != counts:
            raise ValueError(f"the processor placed image tokens in runs of {[n for _, n in image_runs]} for images "
                             f"of {counts}: the image token {self.image_token!r} in the text itself is not allowed")
        features = [ImageFeature(start, n, d.hash, d.patches, d.grid) for (start, n), d in zip(image_runs, done)]
        video_runs = iter(_runs_of(ids, self.vision.video_token_id))
        for clip in clips:
            features += self._video_features(clip, video_runs)
        if next(video_runs, None) is not None:
            raise ValueError(f"the prompt has video tokens ({self.video_token!r}) of no video: the video token in the "
                             "text itself is not allowed")
        return ids, sorted(features, key=lambda f: f.offset)

    def _video_text(self, clip: VideoPatches, start: str, end: str) -> str:
        """A video's placeholder, expanded as its family's processor expands it."""
        t, h, w = clip.grid
        if self.vision.kind != "qwen3_vl":
            return self.video_token * (t * h * w // self.vision.merge_size ** 2)
        run = start + self.video_token * (h * w // self.vision.merge_size ** 2) + end
        times = frame_times(t * self.vision.temporal_patch_size, clip.fps, self.vision.temporal_patch_size)
        return "".join(f"<{time:.1f} seconds>" + run for time in times)

    def _video_features(self, clip: VideoPatches, runs: Iterator[tuple[int, int]]) -> list[ImageFeature]:
        """A video's features: Qwen2-VL's one over its run of video tokens, Qwen2.5-VL's with its
        temporal positions' step; Qwen3-VL's one a temporal patch (the tower attends within each
        frame, so a temporal patch is an image of grid (1, h, w))."""
        t, h, w = clip.grid
        if self.vision.kind == "qwen3_vl":
            pieces = [(p, (1, h, w), 1.0) for p in np.split(clip.patches, t)]
        else:
            interval = 1.0  # Qwen2.5-VL: tokens_per_second * second_per_grid_t, as its get_rope_index
            if self.vision.kind == "qwen2_5_vl":
                interval = self.vision.tokens_per_second * self.vision.temporal_patch_size / clip.fps
            pieces = [(clip.patches, clip.grid, interval)]
        features = []
        for patches, grid, interval in pieces:
            run = next(runs, None)
            want = grid[0] * grid[1] * grid[2] // self.vision.merge_size ** 2
            if run is None or run[1] != want:
                raise ValueError(f"the processor placed a video's tokens in a run of {run and run[1]} for {want}: the "
                                 f"video token {self.video_token!r} in the text itself is not allowed")
            extra = interval if interval != 1.0 else None
            features.append(ImageFeature(run[0], run[1], pixels_hash(patches.reshape(*grid, -1), extra), patches,
                                         grid, time_interval=interval))
        return features

    def _init_gguf(self, tokenizer: Tokenizer | None) -> None:
        """Gemma 3 and the Qwen-VL families from a GGUF and its mmproj (loader/mmproj.py): the
        family's PIL image processor made from the mmproj's metadata as llama.cpp's mtmd
        preprocesses (Gemma 3: resized to image_size square, bilinear; Qwen: smart_resize to between
        8 and 4096 merged patches, llama-server's --image-min-tokens / --image-max-tokens defaults,
        bicubic; image_mean / image_std), each image's placeholder expanded as the family's
        transformers processor expands it, the text tokenized by the engine's tokenizer. No video:
        mtmd takes none."""
        import transformers

        if tokenizer is None:
            raise ValueError(f"{self.vision.kind} images need the model's tokenizer")
        vision, self.encode = self.vision, tokenizer.encode
        mean, std = list(vision.image_mean), list(vision.image_std)
        if vision.kind == "gemma3":  # Gemma3Processor's expansion of <start_of_image>
            self.processor = transformers.Gemma3ImageProcessorPil(
                size={"height": vision.image_size, "width": vision.image_size}, image_mean=mean, image_std=std)
            self.image_token = "<start_of_image>"
            self.expanded = f"\n\n<start_of_image>{'<image_soft_token>' * vision.mm_tokens_per_image}<end_of_image>\n\n"
            return
        unit = (vision.patch_size * vision.merge_size) ** 2
        self.processor = transformers.Qwen2VLImageProcessorPil(
            size={"shortest_edge": 8 * unit, "longest_edge": 4096 * unit}, patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size, merge_size=vision.merge_size, image_mean=mean,
            image_std=std)
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.vision_marks = ("<|vision_start|>", "<|vision_end|>")

    def _init_rows(self, model_dir: Path, tokenizer: Tokenizer | None) -> None:
        """Pixtral / Mistral 3: the image processor (PixtralImageProcessorPil) and the placeholder
        layout PixtralProcessor would use (transformers' PixtralProcessor needs torchvision):
        from the model directory's processor files, or for a GGUF model from its mmproj's
        metadata (VisionConfig.image_mean / image_std) and its vocabulary's [IMG] tokens."""
        import transformers

        if tokenizer is None:
            raise ValueError(f"{self.vision.kind} images need the model's tokenizer")
        vision, self.encode = self.vision, tokenizer.encode
        if model_dir.suffix == ".gguf":
            layout = {"patch_size": vision.patch_size, "spatial_merge_size": vision.merge_size}
            self.processor = transformers.PixtralImageProcessorPil(
                size={"longest_edge": vision.image_size}, patch_size={"height": vision.patch_size,
                                                                      "width": vision.patch_size},
                image_mean=list(vision.image_mean), image_std=list(vision.image_std))
        else:
            file = model_dir / "processor_config.json"
            try:
                layout = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
                self.processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")
            except (OSError, ValueError) as e:
                raise ValueError(f"{model_dir}: the model's image processor (preprocessor_config.json) cannot be "
                                 f"loaded: {str(e)[:300]}") from None
        # PixtralProcessor's defaults, where processor_config.json leaves them out
        patch, merge = layout.get("patch_size", 16), layout.get("spatial_merge_size", 1)
        names = [layout.get(key, default) for key, default in (("image_token", "[IMG]"),
                                                               ("image_break_token", "[IMG_BREAK]"),
                                                               ("image_end_token", "[IMG_END]"))]
        ids = [tokenizer.backend.token_to_id(name) for name in names]
        if None in ids:
            raise ValueError(f"{model_dir}: the tokenizer has no {names[ids.index(None)]!r} token, which the "
                             "processor lays images out with")
        if (patch, merge, ids[0]) != (vision.patch_size, vision.merge_size, vision.image_token_id):
            raise ValueError(f"{model_dir}: the processor lays images out in patches of {patch} merged {merge} x "
                             f"{merge} with image token {ids[0]}; config.json's model in patches of "
                             f"{vision.patch_size} merged {vision.merge_size} x {vision.merge_size} with image token "
                             f"{vision.image_token_id}: make processor_config.json's patch_size, spatial_merge_size "
                             "and image_token those of config.json")
        self.image_token, self.row_names, self.row_ids = names[0], names, ids

    def _process_rows(self, text: str, images: list[Any], add_special_tokens: bool
                      ) -> tuple[list[int], list[ImageFeature]]:
        """Pixtral / Mistral 3: each image resized to whole tokens (patch x merge pixels) and its
        image token expanded into rows of tokens, as PixtralProcessor does; its pixels as
        patches [h * w, C * p * p] and its grid (1, h, w) in patches."""
        p, unit = self.vision.patch_size, self.vision.patch_size * self.vision.merge_size
        processor = self._own().processor
        done = [self._cached(image, lambda image: _row_patches(processor, image, p, unit)) for image in images]
        sizes = [(g[1] * p, g[2] * p) for _, g, _ in done]
        token, (image, row_break, end) = self.vision.image_token_id, self.row_names
        runs = [row_tokens(h // unit, w // unit, *self.row_ids) for h, w in sizes]
        parts = text.split(image)
        text = parts[0] + "".join("".join(row_tokens(h // unit, w // unit, image, row_break, end)) + part
                                  for (h, w), part in zip(sizes, parts[1:]))
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        positions = [i for i, t in enumerate(ids) if t == token]
        features, cut = [], 0
        for run, d in zip(runs, done):
            start = positions[cut] if cut < len(positions) else len(ids)
            if ids[start:start + len(run)] != run:
                raise ValueError(f"the prompt's image tokens are not each image's rows: the image tokens "
                                 f"({self.image_token!r} and its break and end tokens) in the text itself are not "
                                 "allowed")
            cut += run.count(token)
            features.append(ImageFeature(start, len(run), d.hash, d.patches, d.grid))
        if cut != len(positions):
            raise ValueError(f"the prompt has {len(positions) - cut} image tokens ({self.image_token!r}) of no image: "
                             "the image token in the text itself is not allowed")
        return ids, features

    def _features(self, ids: list[int], pixels: list[np.ndarray], sizes: list[tuple[int, int]] | None = None,
                  tag: str | None = None) -> list[ImageFeature]:
        """Each image's run of placeholder tokens, in order: the image token's positions cut
        into runs of each image's embeddings (LLaVA-1.5: tokens_per_image; LLaVA-NeXT: as
        many as its size gives). `tag`: what else every image's hash carries (pan-and-scan)."""
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
            features.append(ImageFeature(start, count, pixels_hash(p, size or tag), p, image_size=size))
        return features


PAN_AND_SCAN = "pan-and-scan"  # in the hash of every view of an image processed with pan-and-scan on


def _grid_patches(processor: Any, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Qwen2-VL's family: one image's patches [t * h * w, C * tps * p * p] and grid (t, h, w), as
    its image processor makes them (each image of a batch on its own)."""
    enc = processor(images=[image], return_tensors="np")
    grid = tuple(int(x) for x in enc["image_grid_thw"][0])
    return np.asarray(enc["pixel_values"], dtype=np.float32), grid


def _row_patches(processor: Any, image: Any, p: int, unit: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Pixtral / Mistral 3: one image resized to whole tokens (`unit` pixels), its pixels as
    patches [h * w, C * p * p] and its grid (1, h, w) in patches."""
    enc = processor(images=[image], patch_size={"height": unit, "width": unit}, return_tensors="np")
    h, w = (int(x) for x in enc["image_sizes"][0])
    grid = (1, h // p, w // p)
    patches = (np.asarray(enc["pixel_values"][0][:, :h, :w], dtype=np.float32).reshape(-1, grid[1], p, grid[2], p)
               .transpose(1, 3, 0, 2, 4).reshape(grid[1] * grid[2], -1))
    return patches, grid


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


def _check_gemma3(processor: Any, vision: VisionConfig, model_dir: str | Path) -> None:
    """Gemma 3: the processor expands each <start_of_image> (and with pan-and-scan, each crop's)
    into as many image tokens (of the id) as config.json's projector makes embeddings, at the
    tower's image size."""
    images = processor.image_processor
    size = (images.size["height"], images.size["width"])
    token = processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token)
    if (processor.image_seq_length, token, size) != (vision.mm_tokens_per_image, vision.image_token_id,
                                                     (vision.image_size, vision.image_size)):
        raise ValueError(f"{model_dir}: the processor expands an image into {processor.image_seq_length} tokens of id "
                         f"{token} at {size[0]} x {size[1]} pixels; config.json's model into mm_tokens_per_image="
                         f"{vision.mm_tokens_per_image} of image_token_index {vision.image_token_id} at "
                         f"{vision.image_size} x {vision.image_size}: make processor_config.json's image_seq_length, "
                         "the tokenizer's image_token and preprocessor_config.json's size those of config.json")


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

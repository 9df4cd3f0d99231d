"""The boundary: every check a request passes before it reaches the engine loop.

Both fronts use it, the offline `LLM` and the server's `AsyncEngine`: a prompt (text,
token ids, or chat messages) becomes a `Request` with its token ids, EOS ids and
SamplingParams, or a ValueError whose message says what to change. Nothing here touches
the engine's running state, so any thread may call it (the server runs it on a small pool
off the event loop). Work is bounded by the prompt's length: text that cannot fit in
max_model_len tokens is refused by its length before it is tokenized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

from ember.config import EngineConfig
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import has_hf_tokenizer, load_tokenizer
from ember.multimodal.inputs import ImageFeature
from ember.multimodal.media import MediaLimits, load_image
from ember.request import Request
from ember.sampling_params import BeamSearchParams, SamplingParams
from ember.scheduler.scheduler import check_prompt_length

# "text" or {"prompt_token_ids": [...]} (+ optional "prompt"), or {"prompt": "text"}; a dict may
# carry a "cache_salt" (the prefix cache then shares blocks only among prompts of that salt),
# for an encoder with token types, "token_type_ids", and for a vision-language model
# {"prompt": "text", "multi_modal_data": {"image": a PIL image or a list}} (vLLM's shape: one
# image token in the text where each image goes; Qwen2-VL's family takes "video" too: a video's
# frames as a list of PIL images, or (frames, {"fps": ...}), or a list of those), with vLLM's
# "mm_processor_kwargs" ({"do_pan_and_scan": bool}, Gemma 3's only: see `pan_and_scan`) or, as
# chat_prompt makes it, its processed form {"prompt_token_ids": [...], "mm_features": [ImageFeature, ...]}
PromptType = Union[str, dict[str, Any]]
Conversation = list[dict[str, Any]]

logger = logging.getLogger(__name__)


def load_engine_tokenizer(config: EngineConfig) -> Tokenizer | None:
    """The resolved config's tokenizer (its `tokenizer` override, else the model's) with its
    `chat_template` override; None for a model directory without a tokenizer."""
    if config.tokenizer is not None:
        return load_tokenizer(config.tokenizer, config.chat_template)
    path = Path(config.model)
    if path.is_dir() and not has_hf_tokenizer(path):
        logger.warning("%s has no tokenizer.json: ember takes {'prompt_token_ids': [...]} prompts only", path)
        return None
    return load_tokenizer(path, config.chat_template)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None,
                 check_request: Callable[[Request], None] | None = None) -> None:
        """`check_request`: the engine's own admission check (n, KV pool size), called last."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model_config.vocab_size
        self._check_request = check_request
        eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        if not eos and config.model_config.eos_token_id is not None:
            eos = frozenset([config.model_config.eos_token_id])
        self.eos_token_ids: frozenset[int] = eos
        self.vision = config.model_config.vision
        self.media_limits = MediaLimits(config.max_image_pixels, config.allowed_local_media_path)
        self.images = None  # the model's image processor (multimodal/processor.py)
        if self.vision is not None and tokenizer is not None:
            self.image_processor()  # at start: a model directory without a processor fails here, by name

    def image_processor(self):
        """The model's image processor; ValueError for a model that takes no images."""
        if self.vision is None:
            arch = self.config.model_config.architecture
            served = " (ember serves its language model on text only)" if self.config.model_config.multimodal else ""
            raise ValueError(f"this model ({arch}{served}) takes no images: send text content only, or serve a "
                             "vision-language model ember runs images through (Gemma3ForConditionalGeneration, "
                             "LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, "
                             "Mistral3ForConditionalGeneration, Qwen2VLForConditionalGeneration, "
                             "Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration)")
        if self.images is None:
            from ember.multimodal.processor import ImageProcessor

            self.images = ImageProcessor(self.config.model, self.vision, self.require_tokenizer())
        return self.images

    def load_images(self, images: list[Any]) -> list[Any]:
        """Check a prompt's images against the model and the limits; each as a PIL image."""
        self.image_processor()
        if len(images) > self.config.images_per_prompt:
            raise ValueError(f"{len(images)} images in one prompt is over the limit of {self.config.images_per_prompt} "
                             "(--limit-mm-per-prompt '{\"image\": N}')")
        return [load_image(image, self.media_limits) for image in images]

    def load_videos(self, videos: list[Any]) -> list[tuple[list[Any], float | None]]:
        """Check a prompt's videos against the model and the limits; each as (its frames as PIL
        images, their fps or None)."""
        if self.image_processor().videos is None:
            if self.image_processor().from_gguf:  # llama.cpp's mtmd takes no video either
                raise ValueError(f"this model ({self.config.model_config.architecture} from a GGUF and its mmproj) "
                                 "takes no video: give a video's frames as images, or serve the model's HF directory")
            raise ValueError(f"this model ({self.config.model_config.architecture}) takes no video: give a video's "
                             "frames as images, or serve Qwen2-VL, Qwen2.5-VL or Qwen3-VL")
        if len(videos) > self.config.videos_per_prompt:
            raise ValueError(f"{len(videos)} videos in one prompt is over the limit of {self.config.videos_per_prompt} "
                             "(--limit-mm-per-prompt '{\"video\": N}')")
        return [([load_image(f, self.media_limits) for f in frames], fps) for frames, fps in map(_video, videos)]

    def pan_and_scan(self, mm_processor_kwargs: Any) -> bool | None:
        """vLLM's mm_processor_kwargs (the model processor's arguments for one prompt), of which
        ember takes do_pan_and_scan alone, for a model whose processor has it (Gemma 3 from its
        HF directory): that choice, or None (none made: the processor config's holds). Every
        other key, and do_pan_and_scan for another model, is refused by name."""
        if mm_processor_kwargs is None or mm_processor_kwargs == {}:
            return None
        if not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be an object such as {{'do_pan_and_scan': true}}; got "
                             f"{type(mm_processor_kwargs).__name__}")
        other = sorted(map(str, set(mm_processor_kwargs) - {"do_pan_and_scan"}))
        if other:
            raise ValueError(f"mm_processor_kwargs {other[0]!r} is not supported: ember passes the model's processor "
                             "do_pan_and_scan alone (Gemma 3's); leave the others out")
        value = mm_processor_kwargs["do_pan_and_scan"]
        if not isinstance(value, bool):
            raise ValueError(f"mm_processor_kwargs do_pan_and_scan must be true or false; got {value!r:.40}")
        images = self.image_processor() if self.vision is not None else None
        if images is None or images.pan_and_scan is None:
            if images is None:
                what = f"this model ({self.config.model_config.architecture}, which takes no images)"
            elif images.from_gguf:
                what = f"a {self.vision.kind} GGUF and its mmproj (preprocessed as llama.cpp's mtmd)"
            else:
                what = f"this model ({self.vision.kind})"
            raise ValueError(f"mm_processor_kwargs do_pan_and_scan is not supported by {what}: its processor has no "
                             "pan-and-scan (Gemma 3's from its HF directory has); leave it out")
        return value

    def image_prompt(self, text: str, images: list[Any], add_special_tokens: bool = True, videos: list[Any] = (),
                     pan_and_scan: bool | None = None) -> tuple[list[int], list[ImageFeature]]:
        """A text prompt with one image token where each image goes (and one video token where
        each video goes) -> its token ids (each placeholder expanded by the model's processor)
        and the images' and videos' features, in prompt order. `pan_and_scan`: Gemma 3's
        do_pan_and_scan for this prompt (None: its processor config's); limit_mm_per_prompt
        counts an image once however many crops it is cut into."""
        tok = self.require_tokenizer()
        if len(text) > self.config.max_model_len * tok.max_chars_per_token:
            raise ValueError(f"the prompt has {len(text)} characters, more than {self.config.max_model_len} tokens "
                             f"(max_model_len) of at most {tok.max_chars_per_token} characters can hold: shorten it")
        loaded = self.load_images(images) if images or not videos else []
        clips = self.load_videos(list(videos)) if videos else []
        return self.image_processor().process(text, loaded, add_special_tokens, clips, pan_and_scan)

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                     priority: int = 0, beam: BeamSearchParams | None = None) -> Request:
        """Tokenize and check one prompt; ValueError if anything in it is invalid. `beam`: the
        request is that beam search (`params`: its step_params())."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams; got {type(params).__name__}")
        text, ids, features = self.tokenize_prompt(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not (isinstance(salt, str) and salt):
            raise ValueError("cache_salt must be a non-empty string")
        self.check_prompt(ids)
        self.check_image_tokens(ids, features)
        types = self.token_type_ids(prompt, len(ids))
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self.check_params(params)
        if beam is not None and self.config.speculative_config is not None:
            raise ValueError("beam search with speculative decoding is not supported: use an engine without "
                             "speculative_config")
        req = Request(request_id, ids, params, prompt=text, eos_token_ids=self.eos_token_ids, priority=priority,
                      cache_salt=salt, token_type_ids=types, mm_features=features or None, beam=beam)
        if self._check_request is not None:
            self._check_request(req)
        return req

    def token_type_ids(self, prompt: PromptType, num_tokens: int) -> list[int] | None:
        """A prompt dict's "token_type_ids" (vLLM's TokensPrompt field: an encoder's segment of
        each token), checked against the prompt and the model's token types."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        kinds = self.config.model_config.type_vocab_size
        if not self.config.model_config.bidirectional or kinds < 2:
            raise ValueError("token_type_ids are read by encoder models with token types (BERT) only; this model "
                             "has none: leave them out")
        if not isinstance(types, (list, tuple)) or len(types) != num_tokens \
                or not all(isinstance(t, int) and 0 <= t < kinds for t in types):
            raise ValueError(f"token_type_ids must be {num_tokens} ints (one a prompt token) in [0, {kinds})")
        return list(types)

    def pair_prompt(self, first: str, second: str) -> dict[str, Any]:
        """Two texts as one cross-encoder prompt (Tokenizer.encode_pair), with their segments
        where the model reads token types."""
        if not (isinstance(first, str) and isinstance(second, str)):
            raise ValueError("a scored pair is two texts")
        tok = self.require_tokenizer()
        longest = self.config.max_model_len * tok.max_chars_per_token
        if len(first) + len(second) > longest:
            raise ValueError(f"the pair has {len(first) + len(second)} characters, more than {self.config.max_model_len} "
                             "tokens (max_model_len) can hold: shorten it")
        ids, types = tok.encode_pair(first, second)
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": f"{first}\n{second}"}
        if self.config.model_config.type_vocab_size > 1:
            prompt["token_type_ids"] = types
        return prompt

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int], list[ImageFeature]]:
        """(text, token ids, image features) of a prompt."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt), []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            return self._multi_modal_prompt(prompt)
        if isinstance(prompt, dict):
            self.pan_and_scan(prompt.get("mm_processor_kwargs"))  # checked on a prompt without images too
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompt_token_ids must be a list of token ids; got {type(ids).__name__}")
            features = prompt.get("mm_features") or []
            if not (isinstance(features, list) and all(isinstance(f, ImageFeature) for f in features)):
                raise ValueError("mm_features must be a list of ImageFeature (as chat_prompt makes them)")
            return prompt.get("prompt"), list(ids), features
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.encode(prompt["prompt"]), []
        raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")

    def _multi_modal_prompt(self, prompt: dict[str, Any]) -> tuple[str, list[int], list[ImageFeature]]:
        """vLLM's {"prompt": text, "multi_modal_data": {"image": image or [images]}}, and its
        "mm_processor_kwargs"."""
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image", "video"}:
            kinds = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data takes {{'image': a PIL image or a list of them, 'video': a video's "
                             f"frames (Qwen2-VL's family)}}; got {kinds}")
        if "prompt_token_ids" in prompt or not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data is text ({'prompt': '... <image> ...'}): the model's "
                             "processor expands each image's placeholder in it")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        ids, features = self.image_prompt(prompt["prompt"], images, videos=_videos(data.get("video")),
                                          pan_and_scan=self.pan_and_scan(prompt.get("mm_processor_kwargs")))
        return prompt["prompt"], ids, features

    def check_image_tokens(self, ids: list[int], features: list[ImageFeature]) -> None:
        """Every image token of a vision-language model's prompt is one of its images' (a token id
        prompt cannot bring the placeholder alone, nor truncation cut an image)."""
        if self.vision is None:
            return
        tokens = {self.vision.image_token_id, self.vision.video_token_id} - {0}

        def count(ids: list[int]) -> int:
            return sum(t in tokens for t in ids)

        placed = sum(count(ids[f.offset:f.end]) for f in features)  # Pixtral's runs hold break tokens too
        if count(ids) != placed or any(f.end > len(ids) for f in features):
            raise ValueError(f"the prompt holds image token {self.vision.image_token_id} where no image goes (or an "
                             "image is cut): give images as multi_modal_data with a text prompt, or as chat image "
                             "parts, and do not truncate a prompt with images")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids; ValueError, before tokenizing, for text too long to fit in
        max_model_len tokens even at this vocabulary's longest token."""
        tok = self.require_tokenizer()
        if len(text) > self.config.max_model_len * tok.max_chars_per_token:
            raise ValueError(f"the prompt has {len(text)} characters, more than {self.config.max_model_len} tokens "
                             f"(max_model_len) of at most {tok.max_chars_per_token} characters can hold: shorten it")
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: Conversation, add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    add_special_tokens: bool = False, mm_processor_kwargs: dict[str, Any] | None = None,
                    **template_kwargs: Any) -> dict[str, Any]:
        """Render one conversation with the chat template (or `chat_template`, a template's
        source): {"prompt", "prompt_token_ids"}. `continue_final_message`: the last message is
        left open, for the answer to continue; `add_special_tokens`: a BOS (and the like) on top
        of what the template wrote; `mm_processor_kwargs`: vLLM's, see `pan_and_scan`."""
        if not messages:
            raise ValueError("messages is empty: pass a list of {'role', 'content'} dicts")
        pan_and_scan = self.pan_and_scan(mm_processor_kwargs)
        tok = self.require_tokenizer()
        messages, images, videos = image_parts(messages)
        if images:  # refused (no images here, too many, undecodable) before the template runs
            images = self.load_images(images)
        if videos:
            self.load_videos(videos)
        text = tok.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, chat_template=chat_template,
                                       **template_kwargs)
        if not images and not videos:
            return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=add_special_tokens)}
        ids, features = self.image_prompt(text, images, add_special_tokens, videos, pan_and_scan)
        return {"prompt": text, "prompt_token_ids": ids, "mm_features": features}

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        check_prompt_length(len(ids), self.config.max_model_len)
        if set(map(type, ids)) <= {int} and 0 <= min(ids) and max(ids) < self.vocab_size:
            return
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)]
        raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids and logprob counts against this
        model's vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.vocab_size:
                raise ValueError(f"{name}={value} is more than the vocabulary ({self.vocab_size} tokens)")
        if params.logit_bias and any(not 0 <= int(t) < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {self.vocab_size})")
        if any(not 0 <= int(t) < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {self.vocab_size})")
        if params.allowed_token_ids is not None and any(not 0 <= t < self.vocab_size for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be token ids in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for ids in params.bad_words_token_ids or () for t in ids):
            raise ValueError(f"bad_words_token_ids must be token ids in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.thinking_end_token_ids or ()):
            raise ValueError(f"thinking_end_token_ids must be token ids in [0, {self.vocab_size})")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would start the text and as it would follow a space (a
        byte-level BPE spells the two differently), each form once."""
        tok = self.require_tokenizer()
        forms: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tok.encode(text, add_special_tokens=False)
                if ids and ids not in forms:
                    forms.append(ids)
        return forms

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model} has no tokenizer: pass {{'prompt_token_ids': [...]}} prompts")
        return self.tokenizer


IMAGE_PART_TYPES = ("image_url", "image_pil")
MEDIA_PART_TYPES = (*IMAGE_PART_TYPES, "video", "video_url")


def image_parts(messages: Conversation) -> tuple[Conversation, list[Any], list[Any]]:
    """The messages with each image part ({"type": "image_url", "image_url": {"url": ...}} as
    OpenAI's API sends it, or vLLM's {"type": "image_pil", "image_pil": a PIL image}) as
    {"type": "image"}, the part chat templates write the image token for, and each video part
    ({"type": "video", "video": its frames as PIL images, or (frames, {"fps": ...})}) as
    {"type": "video"}; the images (URLs or PIL images) and the videos, each in order."""
    images: list[Any] = []
    videos: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PART_TYPES
                                             for p in content):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise ValueError("an image_url part is {'type': 'image_url', 'image_url': {'url': ...}}")
                    images.append(url)
                    parts.append({"type": "image"})
                elif kind == "image_pil":
                    images.append(part.get("image_pil"))
                    parts.append({"type": "image"})
                elif kind == "video":
                    videos.append(part.get("video"))
                    parts.append({"type": "video"})
                elif kind == "video_url":
                    raise ValueError("video_url parts are not supported: ember decodes no video files; give a video's "
                                     "frames offline as {'type': 'video', 'video': [PIL images]}")
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images, videos


def _videos(value: Any) -> list[Any]:
    """multi_modal_data's "video" as a list of videos: one video (its frames, or (frames,
    metadata)) or a list of them."""
    if value is None:
        return []
    if _is_video(value):
        return [value]
    if isinstance(value, (list, tuple)) and all(_is_video(v) for v in value):
        return list(value)
    raise ValueError("multi_modal_data 'video' is a video's frames (a list of PIL images), (frames, {'fps': ...}), "
                     "or a list of those")


def _is_video(value: Any) -> bool:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and not isinstance(value[0], (list, tuple, dict))


def _video(video: Any) -> tuple[list[Any], float | None]:
    """(frames, fps or None) of one video; its metadata may give fps alone (the frames are the
    sampled ones: ember samples none)."""
    frames, meta = (video if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict)
                    else (video, {}))
    if not isinstance(frames, (list, tuple)) or not frames:
        raise ValueError("a video is its frames: a non-empty list of images")
    if set(meta) - {"fps"}:
        raise ValueError(f"a video's metadata {sorted(set(meta) - {'fps'})} is not supported: ember takes the frames "
                         "as sampled, and their fps")
    fps = meta.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"a video's fps must be a number > 0; got {fps!r:.40}")
    return list(frames), None if fps is None else float(fps)


def template_messages(messages: Conversation) -> Conversation:
    """The messages as chat templates take them: no content (an assistant's message that
    only calls tools) is empty text, and an assistant's tool call arguments, which OpenAI's
    API gives as JSON text, become their value (templates write them with tojson, as
    transformers expects); arguments that are not JSON stay text."""
    out = []
    for message in messages:
        if isinstance(message, dict) and "content" in message and message["content"] is None:
            message = {**message, "content": ""}
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls and isinstance(calls, list):
            message = {**message, "tool_calls": [_parsed_arguments(call) for call in calls]}
        out.append(message)
    return out


def _parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}

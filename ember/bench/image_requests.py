"""The image workload of `ember bench serve` (`--dataset images`): chat requests of one image
of random pixels (a data: URL) followed by random text, as vLLM's random-mm dataset draws them
(iid RGB pixels, JPEG by default), so any OpenAI-compatible vision server gets the same bytes
for the same seed. The image comes first, so with `shared_image` every request starts with the
same image (a shared prefix a server can cache); the text is `text_len` tokens of the client's
tokenizer (random ids decoded, re-encoded and cut or topped up to the length, as vLLM does)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.bench.throughput import random_requests

IMAGE_FORMATS = {"jpeg": "JPEG", "png": "PNG"}


@dataclass(frozen=True)
class ChatRequest:
    """One chat request: its messages, its text's token count (the client's tokenizer) and
    how many tokens to generate."""
    messages: list[dict[str, Any]]
    prompt_len: int
    output_len: int


def random_image_url(rng: np.random.Generator, width: int, height: int, fmt: str = "jpeg") -> str:
    """A width x height image of iid random RGB pixels as a base64 data: URL (PIL's encoder at
    its defaults: JPEG quality 75, as vLLM's client sends)."""
    from PIL import Image

    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"--image-format {fmt!r}: give one of {', '.join(IMAGE_FORMATS)}")
    if width < 1 or height < 1:
        raise ValueError(f"--image-width / --image-height must be >= 1; got {width} x {height}")
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    with io.BytesIO() as buf:
        Image.fromarray(pixels).save(buf, format=IMAGE_FORMATS[fmt])
        payload = base64.b64encode(buf.getvalue()).decode()
    return f"data:image/{fmt};base64,{payload}"


def text_of_length(tok, ids: list[int], length: int, rng: np.random.Generator, tries: int = 10) -> tuple[str, int]:
    """Text that `tok` encodes to `length` tokens (or, after `tries` rounds, close to it): `ids`
    decoded, re-encoded, cut or topped up with random allowed ids, again; the text and its
    token count."""
    allowed = np.setdiff1d(np.arange(tok.vocab_size), np.asarray(tok.all_special_ids, dtype=np.int64))
    for _ in range(tries):
        text = tok.decode(ids)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text, length
        ids = ids[:length] + allowed[rng.integers(0, len(allowed), size=max(0, length - len(ids)))].tolist()
    text = tok.decode(ids)
    return text, len(tok.encode(text, add_special_tokens=False))


def image_requests(num_prompts: int, text_len: int, output_len: int, width: int, height: int, tok, seed: int,
                   shared_image: bool = False, fmt: str = "jpeg") -> list[ChatRequest]:
    """`num_prompts` chat requests, each one user message of an image (request i's drawn from
    seed and i; with `shared_image`, request 0's in all) then `text_len` tokens of text."""
    texts = random_requests(num_prompts, text_len, output_len, 0.0, tok.vocab_size, tok.all_special_ids, seed)
    text_rng = np.random.default_rng([seed, 1])
    shared = random_image_url(np.random.default_rng([seed, 0, 0]), width, height, fmt) if shared_image else None
    requests = []
    for i, r in enumerate(texts):
        url = shared or random_image_url(np.random.default_rng([seed, 0, i]), width, height, fmt)
        text, n = text_of_length(tok, r.prompt_token_ids, text_len, text_rng)
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
        requests.append(ChatRequest([{"role": "user", "content": content}], n, r.output_len))
    return requests

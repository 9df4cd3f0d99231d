"""The input side's image caches and its threads: ImageProcessor keeps each image's patches,
grid and hash by its content (Qwen2-VL's family and Pixtral's), and a prompt of a cached image
comes out exactly as transformers' processor makes it (ids, patches, grids, hashes); the cache
is bounded in bytes, least recently used out first; threads process images at once, each on
its own processor copies, with the results of one thread; media.py decodes the same data: URL
or file once."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

import pixtral_model  # noqa: E402
import qwen_vl_model  # noqa: E402
from llava_model import image  # noqa: E402

from ember.loader.tokenizer_files import load_tokenizer  # noqa: E402
from ember.models.config import ModelConfig  # noqa: E402
from ember.multimodal import media  # noqa: E402
from ember.multimodal.cache import BytesLRU, image_digest  # noqa: E402
from ember.multimodal.inputs import content_hash  # noqa: E402
from ember.multimodal.processor import ImageProcessor  # noqa: E402

RED, BLUE = image((200, 30, 30), (84, 56)), image((20, 40, 220), (100, 60))
FAMILIES = {"qwen2_vl": qwen_vl_model, "qwen2_5_vl": qwen_vl_model, "qwen3_vl": qwen_vl_model,
            "pixtral": pixtral_model, "mistral3": pixtral_model}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    if FAMILIES[family] is qwen_vl_model:
        return qwen_vl_model.save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)
    return pixtral_model.save_tiny_pixtral(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)


# Each model directory's tokenizer loads in ~0.5 s (a 49k vocabulary); ember's tokenizer is only
# read (encode), so a fresh ImageProcessor (its own cache, its own transformers parts) shares it
TOKENIZERS: dict = {}
# transformers' processors are deterministic: one reference per (directory, images' contents, by
# their bytes, not by the image_digest under test)
REFERENCES: dict = {}


def processor(model_dir, cache_bytes: int | None = None) -> ImageProcessor:
    kw = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    if model_dir not in TOKENIZERS:
        TOKENIZERS[model_dir] = load_tokenizer(model_dir)
    return ImageProcessor(model_dir, ModelConfig.from_hf_dir(model_dir).vision, TOKENIZERS[model_dir], **kw)


def reference(model_dir, family: str, images: list) -> tuple[list[int], list[tuple]]:
    """transformers' processor on the prompt's images at once: the ids, and each image's
    patches (as the tower takes them), grid and hash (of its content and grid)."""
    key = (model_dir, family, tuple((i.mode, i.size, i.tobytes(), repr(i.info), tuple(i.getpalette() or ())) for i in images))
    if key not in REFERENCES:
        REFERENCES[key] = _reference(model_dir, family, images)
    return REFERENCES[key]


def _reference(model_dir, family: str, images: list) -> tuple[list[int], list[tuple]]:
    enc = FAMILIES[family].hf_inputs(model_dir, FAMILIES[family].TWO, images)
    ids = enc["input_ids"][0].tolist()
    if FAMILIES[family] is qwen_vl_model:
        grids = [tuple(g) for g in enc["image_grid_thw"].tolist()]
        patches = np.split(enc["pixel_values"].numpy(), np.cumsum([t * h * w for t, h, w in grids])[:-1])
    else:  # Pixtral's pixels [B, C, H, W] padded to the batch's largest, as patches [h * w, C * p * p]
        p = ModelConfig.from_hf_dir(model_dir).vision.patch_size
        grids, patches = [], []
        for pixels, (h, w) in zip(enc["pixel_values"].numpy(), enc["image_sizes"].tolist()):
            grids.append((1, h // p, w // p))
            patches.append(pixels[:, :h, :w].reshape(-1, h // p, p, w // p, p).transpose(1, 3, 0, 2, 4)
                           .reshape((h // p) * (w // p), -1))
    kind = ModelConfig.from_hf_dir(model_dir).vision.kind  # the hash: the family, the image's content, its grid
    return ids, [(x, g, content_hash(kind, image_digest(i), g)) for x, g, i in zip(patches, grids, images)]


def check(got, want) -> None:
    ids, features = got
    assert ids == want[0]
    assert [(f.hash, f.grid_thw) for f in features] == [(h, g) for _, g, h in want[1]]
    for f, (patches, _, _) in zip(features, want[1]):
        np.testing.assert_array_equal(f.pixel_values, patches)


def test_a_cached_image_gives_the_prompt_transformers_gives(model_dir, family):
    want = reference(model_dir, family, [RED, BLUE])
    ip, text = processor(model_dir), FAMILIES[family].TWO
    first = ip.process(text, [RED, BLUE], True)
    assert (ip.cache.hits, ip.cache.misses, len(ip.cache)) == (0, 2, 2)
    again = ip.process(text, [BLUE.copy(), RED.copy()], True)  # other objects of the same content, swapped
    assert (ip.cache.hits, ip.cache.misses) == (2, 2)
    check(first, want)
    check(again, reference(model_dir, family, [BLUE, RED]))
    uncached = processor(model_dir, cache_bytes=0).process(text, [RED, BLUE], True)
    check(uncached, want)
    assert [(f.offset, f.length) for f in first[1]] == [(f.offset, f.length) for f in uncached[1]]
    assert not first[1][0].pixel_values.flags.writeable  # shared by every prompt of the image


def test_a_changed_pixel_or_palette_is_another_image(model_dir, family):
    ip, text = processor(model_dir), FAMILIES[family].TWO
    other = RED.copy()
    other.putpixel((0, 0), (201, 30, 30))
    ip.process(text, [RED, BLUE], True)
    got = ip.process(text, [other, BLUE], True)
    assert (ip.cache.hits, ip.cache.misses) == (1, 3)
    check(got, reference(model_dir, family, [other, BLUE]))
    red_p, blue_p = RED.convert("P"), RED.convert("P")
    blue_p.putpalette([255 - c for c in red_p.getpalette()])
    assert red_p.tobytes() == blue_p.tobytes() and image_digest(red_p) != image_digest(blue_p)


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(model_dir, family):
    one = processor(model_dir).process(FAMILIES[family].TWO, [RED, BLUE], True)[1]
    bound = one[0].pixel_values.nbytes + one[1].pixel_values.nbytes - 1  # both do not fit
    ip = processor(model_dir, cache_bytes=bound)
    ip.process(FAMILIES[family].TWO, [RED, BLUE], True)  # RED in, then BLUE: RED out
    assert (len(ip.cache), ip.cache.nbytes) == (1, one[1].pixel_values.nbytes)
    got = ip.process(FAMILIES[family].TWO, [BLUE, RED], True)  # BLUE hits, RED misses (and evicts BLUE)
    assert (ip.cache.hits, ip.cache.misses, ip.cache.nbytes) == (1, 3, one[0].pixel_values.nbytes)
    check(got, reference(model_dir, family, [BLUE, RED]))


def test_threads_process_images_at_once_on_their_own_processors(model_dir, family):
    ip, text = processor(model_dir, cache_bytes=0), FAMILIES[family].TWO  # every image processed, no hits
    prompts = {"a": [RED, BLUE], "b": [BLUE, image((10, 200, 10), (70, 84))]}
    alone = {k: ip.process(text, images, True) for k, images in prompts.items()}
    start, got, parts = threading.Barrier(2), {}, {}

    def work(key: str) -> None:
        start.wait()
        got[key] = [ip.process(text, prompts[key], True) for _ in range(3)]
        parts[key] = ip._own()

    threads = [threading.Thread(target=work, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, runs in got.items():
        for ids, features in runs:
            assert ids == alone[key][0]
            assert [f.hash for f in features] == [f.hash for f in alone[key][1]]
            for f, g in zip(features, alone[key][1]):
                np.testing.assert_array_equal(f.pixel_values, g.pixel_values)
    assert parts["a"].processor is not parts["b"].processor and ip.processor not in (parts["a"].processor,
                                                                                     parts["b"].processor)


def test_bytes_lru_evicts_by_bytes_least_recently_used_first():
    cache = BytesLRU(100, len)
    cache.put("a", b"x" * 40)
    cache.put("b", b"y" * 40)
    assert cache.get("a") == b"x" * 40  # a is now the most recently used
    cache.put("c", b"z" * 40)
    assert (cache.get("b"), len(cache), cache.nbytes) == (None, 2, 80)
    cache.put("a", b"w" * 10)  # a replaced: its old bytes no longer count
    assert (cache.get("a"), cache.nbytes) == (b"w" * 10, 50)
    cache.put("big", b"q" * 101)  # over the bound by itself: not kept, nothing evicted
    assert (cache.get("big"), len(cache), cache.nbytes) == (None, 2, 50)
    assert (cache.hits, cache.misses) == (2, 2)
    nothing = BytesLRU(0, len)
    nothing.put("a", b"x")
    assert len(nothing) == 0


def _data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def test_the_same_data_url_or_file_is_decoded_once(tmp_path):
    media.DECODED.clear()
    limits = media.MediaLimits(max_pixels=100 * 100, allowed_local_media_path=str(tmp_path))
    url = _data_url(RED)
    first = media.load_image(url, limits)
    assert media.load_image(url, limits) is first and len(media.DECODED) == 1
    assert first.tobytes() == RED.tobytes()
    other = media.load_image(_data_url(BLUE), limits)
    assert other is not first and other.tobytes() == BLUE.tobytes()
    with pytest.raises(ValueError, match="over the limit of 100"):  # a hit is checked against the limits too
        media.load_image(url, media.MediaLimits(max_pixels=100))
    path = tmp_path / "a.png"
    RED.save(path)
    assert media.load_image(f"file://{path}", limits).tobytes() == RED.tobytes()
    BLUE.save(path)  # the same name, other bytes: decoded anew
    assert media.load_image(f"file://{path}", limits).tobytes() == BLUE.tobytes()
    with pytest.raises(ValueError, match="cannot be decoded"):  # a bad payload is refused every time
        media.load_image("data:image/png;base64," + base64.b64encode(b"not an image").decode(), limits)

"""On CUDA (`-m gpu`): Gemma 3 at a small real shape (gemma3_vision_model.py's SMALL: Gemma 3 4B's
SigLIP widths, 896-pixel images pooled to 256 tokens, its attention heads of 256 dims, a sliding
window shorter than an image) through the whole engine in float32 against transformers on the
GPU: greedy tokens of prompts with one image, two, and none, in one batch (decode steps replay the
CUDA graphs; the image tokens' bidirectional rows in the Triton prefill kernel), with chunks that
stop before each image, and with a prefix-cache hit over an image; and with pan-and-scan on (in
preprocessor_config.json), 768 x 512 images of 2 crops each, every crop its own 256 tokens."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from gemma3_vision_model import SMALL, hf_inputs, save_tiny_gemma3, with_processor_settings  # noqa: E402
from llava_model import assert_engine_matches_on_cuda, hf_greedy, image, word_tokenizer_dir  # noqa: E402

WIDE, TALL = image((200, 30, 30), (448, 336)), image((20, 40, 220), (200, 300))
PROMPTS = [("What is in the picture ? <start_of_image>", [WIDE]),
           ("<start_of_image> and <start_of_image> Which is red ?", [TALL, WIDE]),
           ("What is in the picture ?", [])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    words = word_tokenizer_dir(tmp_path_factory.mktemp("words"))
    return save_tiny_gemma3(words, tmp_path_factory.mktemp("gemma3"), SMALL)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[tuple[list[int], list[float]]]:
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = [hf_inputs(model_dir, text, images) if images else tok(text, return_tensors="pt") for text, images in PROMPTS]
    return hf_greedy(hf.cuda().eval(), inputs, 12)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 300}], ids=["graphs", "chunks-stop-before-images"])
def test_greedy_tokens_match_transformers_on_cuda(model_dir, expected, kw):
    assert_engine_matches_on_cuda(model_dir, PROMPTS, expected, 256, 5e-3, **kw)


# pan-and-scan at transformers' defaults: a 768 x 512 image (ratio 1.5) is cut into 2 crops of 384 x 512
PAN_AND_SCAN = [("What is in the picture ? <start_of_image>", [image((200, 30, 30), (768, 512))]),
                ("<start_of_image> Which is red ?", [image((20, 40, 220), (768, 512))])]


@pytest.fixture(scope="module")
def pan_and_scan_dir(model_dir, tmp_path_factory):
    """The model with do_pan_and_scan on in its processor config."""
    return with_processor_settings(model_dir, tmp_path_factory.mktemp("pan-and-scan") / "model", "image_processor",
                                   {"do_pan_and_scan": True})


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 300}], ids=["graphs", "chunks-stop-before-images"])
def test_pan_and_scan_greedy_tokens_match_transformers_on_cuda(pan_and_scan_dir, kw):
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(pan_and_scan_dir), dtype=torch.float32)
    inputs = [hf_inputs(pan_and_scan_dir, text, images, do_pan_and_scan=True) for text, images in PAN_AND_SCAN]
    assert [len(i["pixel_values"]) for i in inputs] == [3, 3]
    expected = hf_greedy(hf.cuda().eval(), inputs, 12)
    del hf
    assert_engine_matches_on_cuda(pan_and_scan_dir, PAN_AND_SCAN, expected, 3 * 256, 5e-3, **kw)

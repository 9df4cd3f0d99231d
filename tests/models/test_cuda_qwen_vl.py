"""On CUDA (`-m gpu`): Qwen2.5-VL at a small real shape (models/qwen_vl_model.py's SMALL:
3B's widths, head_dim 128 with M-RoPE sections [16, 24, 24], a tower of 16 heads of 80 dims
with window and full attention) through the whole engine in float32 against transformers on the
GPU: greedy tokens of prompts with images of different sizes (up to 256 image tokens) and one
without, in one batch (decode steps replay the CUDA graphs at 1-D positions + delta), with
chunks that cut the images and with a prefix-cache hit over an image."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import assert_engine_matches_on_cuda, hf_greedy, image, word_tokenizer_dir  # noqa: E402
from qwen_vl_model import SMALL, hf_inputs, save_tiny_qwen_vl  # noqa: E402

V = "<|vision_start|><|image_pad|><|vision_end|>"
WIDE, TALL = image((200, 30, 30), (448, 336)), image((20, 40, 220), (200, 300))
PROMPTS = [(f"USER What is in the picture ? {V} ASSISTANT", [WIDE]),
           (f"USER {V} and {V} Which is red ? ASSISTANT", [TALL, WIDE]),
           ("USER What is in the picture ? ASSISTANT", [])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    words = word_tokenizer_dir(tmp_path_factory.mktemp("words"))
    return save_tiny_qwen_vl(words, tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl", SMALL)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[tuple[list[int], list[float]]]:
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = [hf_inputs(model_dir, text, images) if images else tok(text, return_tensors="pt") for text, images in PROMPTS]
    return hf_greedy(hf.cuda().eval(), inputs, 12)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 64}], ids=["graphs", "chunks-cut-images"])
def test_greedy_tokens_match_transformers_on_cuda(model_dir, expected, kw):
    assert_engine_matches_on_cuda(model_dir, PROMPTS, expected, 256, 2e-3, **kw)

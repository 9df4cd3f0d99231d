"""On CUDA (`-m gpu`): Mistral 3 at a small real shape (pixtral_model.py's SMALL: Mistral-Small-3.1's
tower widths, 16 heads of 64 dims, 14-pixel patches merged 2 x 2; a language model of 16 heads of
128 dims) through the whole engine in float32 against transformers on the GPU: greedy tokens of
prompts with images of different sizes (up to 16 x 16 merged tokens, [IMG_BREAK]s among them) and
one without, in one batch (decode steps replay the CUDA graphs), with chunks that cut the images'
rows and with a prefix-cache hit over an image."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import assert_engine_matches_on_cuda, hf_greedy, image, word_tokenizer_dir  # noqa: E402
from pixtral_model import SMALL, hf_inputs, save_tiny_pixtral  # noqa: E402

WIDE, TALL = image((200, 30, 30), (448, 336)), image((20, 40, 220), (200, 300))
PROMPTS = [("[INST] What is in the picture ? [IMG] [/INST]", [WIDE]),
           ("[INST] [IMG] and [IMG] Which is red ? [/INST]", [TALL, WIDE]),
           ("[INST] What is in the picture ? [/INST]", [])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    words = word_tokenizer_dir(tmp_path_factory.mktemp("words"))
    return save_tiny_pixtral(words, tmp_path_factory.mktemp("mistral3"), "mistral3", SMALL)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[tuple[list[int], list[float]]]:
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = [hf_inputs(model_dir, text, images) if images else tok(text, return_tensors="pt") for text, images in PROMPTS]
    return hf_greedy(hf.cuda().eval(), inputs, 12)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 64}], ids=["graphs", "chunks-cut-images"])
def test_greedy_tokens_match_transformers_on_cuda(model_dir, expected, kw):
    # 3.2e-3 at most on the H200 (the Triton kernels' float32 dots run in TF32 over up to ~300 tokens)
    assert_engine_matches_on_cuda(model_dir, PROMPTS, expected, 128, 5e-3, **kw)

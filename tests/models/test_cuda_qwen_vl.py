"""On CUDA (`-m gpu`): Qwen2.5-VL and Qwen3-VL at small real shapes (qwen_vl_model.py's SMALL:
3B's widths, head_dim 128 with M-RoPE sections [16, 24, 24], a tower of 16 heads of 80 dims
with window and full attention; SMALL_QWEN3: 2B's widths, interleaved M-RoPE, learned positions
and deepstack) through the whole engine in float32 against transformers on the GPU: greedy tokens of prompts with images of different sizes (up to 256 image tokens) and one
without, in one batch (decode steps replay the CUDA graphs at 1-D positions + delta), with
chunks that cut the images and with a prefix-cache hit over an image; the same at two ranks
(tensor parallelism over NCCL)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import assert_engine_matches_on_cuda, hf_greedy, image, word_tokenizer_dir  # noqa: E402
from qwen_vl_model import HF_CLASSES, SMALL, SMALL_QWEN3, hf_inputs, save_tiny_qwen_vl  # noqa: E402

V = "<|vision_start|><|image_pad|><|vision_end|>"
WIDE, TALL = image((200, 30, 30), (448, 336)), image((20, 40, 220), (200, 300))
PROMPTS = [(f"USER What is in the picture ? {V} ASSISTANT", [WIDE]),
           (f"USER {V} and {V} Which is red ? ASSISTANT", [TALL, WIDE]),
           ("USER What is in the picture ? ASSISTANT", [])]


# the second prompt's image tokens (Qwen2.5-VL: 77 + 192, Qwen3-VL's 16-pixel patches: 54 + 140), which its
# repeat hits at least
IMAGE_TOKENS = {"qwen2_5_vl": 256, "qwen3_vl": 192}


@pytest.fixture(scope="module", params=[("qwen2_5_vl", SMALL), ("qwen3_vl", SMALL_QWEN3)], ids=lambda p: p[0])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, family):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    words = word_tokenizer_dir(tmp_path_factory.mktemp("words"))
    return save_tiny_qwen_vl(words, tmp_path_factory.mktemp(family[0]), *family)


@pytest.fixture(scope="module")
def expected(model_dir, family) -> list[tuple[list[int], list[float]]]:
    hf = getattr(transformers, HF_CLASSES[family[0]]).from_pretrained(str(model_dir), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    inputs = [hf_inputs(model_dir, text, images) if images else tok(text, return_tensors="pt") for text, images in PROMPTS]
    return hf_greedy(hf.cuda().eval(), inputs, 12)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 64},
                                {"tensor_parallel_size": 2, "max_num_batched_tokens": 64}],
                         ids=["graphs", "chunks-cut-images", "two-ranks"])
def test_greedy_tokens_match_transformers_on_cuda(model_dir, expected, family, kw):
    """two-ranks (two GPUs, NCCL): each rank's replicated tower, its shard of the LM, its decode
    graphs; check_idle gathers every rank's encoder cache over NCCL against the engine's mirror."""
    if kw.get("tensor_parallel_size", 1) > torch.cuda.device_count():
        pytest.skip(f"needs {kw['tensor_parallel_size']} GPUs (nvidia-h100-x2)")
    assert_engine_matches_on_cuda(model_dir, PROMPTS, expected, IMAGE_TOKENS[family[0]], 2e-3, **kw)

"""On CUDA (`-m gpu`): the tiny LLaVA-1.5 and LLaVA-NeXT through the whole engine (CUDA graphs
for the steps without image tokens, eager with image embeddings; the CLIP tower in plain torch)
in float32, against transformers on the GPU: greedy tokens of prompts with one and two images,
in one batch, with chunks that cut the images and with a prefix-cache hit over an image."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import image, save_tiny_llava, word_tokenizer_dir  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402

RED, BLUE = image((200, 30, 30)), image((20, 40, 220), (24, 36))
PROMPTS = [("USER : <image>\nWhat is in the picture ? ASSISTANT :", [RED]),
           ("USER : <image>\nand <image>\nWhich is red ? ASSISTANT :", [RED, BLUE]),
           ("USER : <image>\nWhat is in the picture ? ASSISTANT :", [BLUE])]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["llava", "llava-next"])
def model_dir(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return save_tiny_llava(word_tokenizer_dir(tmp_path_factory.mktemp("words")), tmp_path_factory.mktemp("llava"),
                           anyres=request.param)


@pytest.fixture(scope="module")
def expected(model_dir):
    processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    out = []
    for text, images in PROMPTS:
        enc = processor(text=[text], images=images, return_tensors="pt").to("cuda")
        with torch.no_grad():
            tokens = hf.generate(**enc, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out.append(tokens[0, enc["input_ids"].shape[1]:].tolist())
    return out


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}], ids=["graphs", "chunks-cut-images"])
def test_greedy_tokens_match_transformers_on_cuda(model_dir, expected, kw):
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256, block_size=16, **kw)
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} for t, i in PROMPTS]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    again = llm.generate(prompts[0], GREEDY)[0]  # its image's blocks from the batch: a hit
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == expected[0]
    llm.engine.check_idle()

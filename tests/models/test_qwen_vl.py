"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)
on tiny random checkpoints saved by transformers, against transformers on the same inputs:
images of different sizes (so different token counts), M-RoPE positions as get_rope_index makes
them, logits of prompts with one and two images, greedy tokens (decode turns by position +
delta), a chunk boundary inside an image, the prefix cache over a repeated image."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import ember_logits, image, prompt  # noqa: E402
from qwen_vl_model import FAMILIES, hf_inputs, save_tiny_qwen_vl  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402

# 84 x 56 pixels: 4 x 6 patches, 6 tokens; 100 x 60: resized to 4 x 8 patches, 8 tokens
RED, BLUE = image((200, 30, 30), (84, 56)), image((20, 40, 220), (100, 60))
V = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"<|im_start|>user\n{V}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{V}and {V}Which is red?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    return save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def hf(model_dir, family):
    return getattr(transformers, HF_CLASSES[family]).from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", quantization="none", num_kv_blocks=96, block_size=4,
               max_model_len=256, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.mark.parametrize("text,images", [(ONE, [RED]), (TWO, [RED, BLUE])], ids=["one-image", "two-images"])
def test_positions_logits_and_greedy_tokens_match_transformers(llm, hf, model_dir, text, images):
    inputs = hf_inputs(model_dir, text, images)
    ids, positions, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    pad = llm.config.model_config.vision.image_token_id
    assert [ids.count(pad)] == [[6], [6 + 8]][len(images) - 1]
    with torch.no_grad():
        want_positions, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   inputs["image_grid_thw"])
        want = hf(**inputs).logits[0]
        expected = hf.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert torch.equal(positions, want_positions[:, 0])
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


def test_a_text_prompt_turns_by_plain_positions(llm, hf):
    ids = llm.inputs.encode("<|im_start|>user\nWhat is in the picture?<|im_end|>\n")
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids == expected.tolist()


def test_chat_with_image_parts_is_the_template_and_the_processor(llm):
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": RED},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt == ONE
    assert out.outputs[0].token_ids == llm.generate(prompt(ONE, [RED]), GREEDY)[0].outputs[0].token_ids


def test_a_repeated_image_hits_the_prefix_cache_and_changes_nothing(llm):
    """The same image after the same text hits past its tokens (its positions resume there); a
    different image of the same size shares no block over its tokens."""
    green, yellow = image((30, 160, 40), (84, 56)), image((220, 200, 20), (84, 56))
    purple = image((120, 20, 160), (100, 60))
    llm.engine.reset_prefix_cache()
    encoded = llm.engine.runner.images.num_encoded
    first = llm.generate(prompt(TWO, [green, purple]), GREEDY)[0]
    again = llm.generate(prompt(TWO, [green, purple]), GREEDY)[0]
    other = llm.generate(prompt(TWO, [yellow, purple]), GREEDY)[0]
    start = first.prompt_token_ids.index(llm.config.model_config.vision.image_token_id)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 4 * 4  # every whole block before the last
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == start // 4 * 4  # the text's whole blocks before the image, no more
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.engine.runner.images.num_encoded == encoded + 3  # green, purple, yellow: the tower ran once for each
    llm.engine.check_idle()


def test_chunk_boundaries_inside_images_change_nothing(model_dir, llm):
    """A budget of 4 tokens a step cuts the 6- and 8-token images across chunks."""
    chunked = make_llm(model_dir, max_num_batched_tokens=4, enable_prefix_caching=False)
    want = llm.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids
    assert chunked.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids == want
    assert chunked.engine.runner.images.num_encoded == 2
    chunked.engine.check_idle()

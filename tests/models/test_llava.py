"""LLaVA-1.5 (LlavaForConditionalGeneration) on a tiny random checkpoint saved by transformers,
against transformers on the same processor inputs: logits of prompts with one and two images,
greedy tokens, a chunk boundary inside an image, the prefix cache over a repeated image, and
the encoder cache's bound."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import TOKENS_PER_IMAGE, ember_logits, image, make_llm, prompt, save_tiny_llava  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.runner.multimodal import EncoderCache  # noqa: E402

RED, BLUE = image((200, 30, 30)), image((20, 40, 220), (24, 36))
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich is red? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_llava(bpe_tokenizer_dir, tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def hf(model_dir):
    processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    model = transformers.LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return processor, model


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def hf_inputs(hf, text: str, images: list):
    return hf[0](text=[text], images=images, return_tensors="pt")


@pytest.mark.parametrize("text,images", [(ONE, [RED]), (TWO, [RED, BLUE])], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_match_transformers(llm, hf, text, images):
    inputs = hf_inputs(hf, text, images)
    ids, _, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    assert ids.count(llm.config.model_config.vision.image_token_id) == TOKENS_PER_IMAGE * len(images)
    with torch.no_grad():
        want = hf[1](**inputs).logits[0]
        expected = hf[1].generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


def test_chat_with_image_parts_is_the_template_and_the_processor(llm, hf):
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": RED},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    text = hf[0].apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}], add_generation_prompt=True)
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt == text
    assert out.outputs[0].token_ids == llm.generate(prompt(text, [RED]), GREEDY)[0].outputs[0].token_ids


def test_a_repeated_image_hits_the_prefix_cache_and_changes_nothing(llm):
    """The same image after the same text hits past its tokens; a different image with the same
    placeholder ids never shares a block with it."""
    green, yellow = image((30, 160, 40)), image((220, 200, 20))
    llm.engine.reset_prefix_cache()
    encoded = llm.engine.runner.images.num_encoded
    first = llm.generate(prompt(ONE, [green]), GREEDY)[0]
    again = llm.generate(prompt(ONE, [green]), GREEDY)[0]
    other = llm.generate(prompt(ONE, [yellow]), GREEDY)[0]
    start = first.prompt_token_ids.index(llm.config.model_config.vision.image_token_id)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= start + TOKENS_PER_IMAGE  # its blocks over the image, from the first
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == start  # the text before the image, to the token, and none of the image
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.engine.runner.images.num_encoded == encoded + 2  # the tower ran once for each image
    llm.engine.check_idle()


def test_chunk_boundaries_inside_images_change_nothing(model_dir, llm):
    """A budget of 8 tokens a step cuts each 16-token image in three chunks."""
    chunked = make_llm(model_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    want = llm.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids
    assert chunked.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids == want
    assert chunked.engine.runner.images.num_encoded == 2  # each image's tower ran once for its three chunks
    chunked.engine.check_idle()


def test_an_encoder_budget_of_one_image_spreads_a_four_image_prompt_over_four_steps(model_dir, llm):
    """--max-num-encoder-input-tokens 16 (one image): the tower runs once for each image, in four
    steps (the prompt's chunks cut before each image), where the default budget runs it once for
    all four; the greedy tokens are the same."""
    images = [image(c) for c in ((250, 120, 0), (0, 200, 200), (120, 0, 160), (90, 90, 90))]
    text = "USER: " + "<image>\n" * 4 + "Which is red? ASSISTANT:"
    steps, encoded = llm.engine.runner.images.num_encoder_steps, llm.engine.runner.images.num_encoded
    want = llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids
    assert (llm.engine.runner.images.num_encoder_steps - steps, llm.engine.runner.images.num_encoded - encoded) \
        == (1, 4)
    budgeted = make_llm(model_dir, max_num_encoder_input_tokens=TOKENS_PER_IMAGE)
    assert budgeted.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids == want
    assert (budgeted.engine.runner.images.num_encoder_steps, budgeted.engine.runner.images.num_encoded) == (4, 4)
    budgeted.engine.check_idle()


def test_the_encoder_cache_keeps_held_images_and_drops_the_rest_within_its_bytes():
    cache = EncoderCache(max_bytes=2 * 64)
    tensor = torch.zeros(16)  # 64 bytes
    for key in "abc":
        cache.hold("r1", key)
        cache.put(key, tensor.clone())
    assert list(cache.entries) == ["a", "b", "c"]  # held: over the bound, kept
    cache.done("r1", "a")
    assert list(cache.entries) == ["b", "c"] and cache.nbytes == 128
    cache.release("r1")
    assert list(cache.entries) == ["b", "c"] and not cache.held and not cache.holders
    cache.put("d", tensor.clone())
    assert list(cache.entries) == ["c", "d"]  # least recently used first


def test_preempted_requests_with_images_recompute_the_same_tokens(model_dir, llm):
    """A pool of 16 blocks (64 tokens) holds both prompts, not both answers: one is preempted and
    recomputes its prompt, image embeddings included."""
    prompts = [prompt(ONE, [RED]), prompt(ONE, [BLUE])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(str(model_dir), dtype="float32", quantization="none", num_kv_blocks=16, block_size=4,
                max_model_len=64, enable_prefix_caching=False)
    got = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert small.engine.stats().num_preemptions > 0
    small.engine.check_idle()

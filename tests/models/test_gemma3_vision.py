"""Gemma 3 (Gemma3ForConditionalGeneration) on a tiny random checkpoint saved by transformers,
against transformers on the same inputs: one image and two in a prompt, each expanded into
<start_of_image>, its image tokens, <end_of_image>; prompt logits (the image tokens attending to
each other both ways, the sliding layers' window shorter than an image), greedy tokens, a
repeated image in the prefix cache, chunked prefill that never ends inside an image, and what
ember does not run refused by name. Pan-and-scan (an elongated image and its crops, each a view
of its own): transformers' logits and tokens, the caches keyed by the setting, the encoder budget
counting every crop, and mm_processor_kwargs other than do_pan_and_scan refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from gemma3_vision_model import (  # noqa: E402
    ONE,
    TOKENS_PER_IMAGE,
    TWO,
    hf_inputs,
    load_hf,
    save_tiny_gemma3,
    with_processor_settings,
)
from llava_model import assert_a_repeated_image_hits, ember_logits, image, make_llm, prompt  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.models.vision_config import vision_config  # noqa: E402

RED, BLUE = image((200, 30, 30), (40, 30)), image((20, 40, 220), (100, 50))
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)  # where the prompt is what is checked


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_gemma3(bpe_tokenizer_dir, tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


def hf_logits(hf, inputs: dict, more: list[int] = ()) -> torch.Tensor:
    """transformers' logits of the prompt followed by `more` tokens (text: token type 0)."""
    inputs = dict(inputs)
    if more:
        extra = torch.tensor([list(more)])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.zeros_like(extra)], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        return hf(**inputs).logits[0]


@pytest.mark.parametrize("text,images", [(ONE, [RED]), (TWO, [RED, BLUE])], ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_match_transformers(llm, hf, model_dir, text, images):
    """Greedy tokens: transformers' logits over the prompt and ember's tokens pick each of them."""
    inputs = hf_inputs(model_dir, text, images)
    ids, _, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    tokens = llm.get_tokenizer().convert_ids_to_tokens(ids)
    run = ["<start_of_image>"] + ["<image_soft_token>"] * TOKENS_PER_IMAGE + ["<end_of_image>"]
    starts = [i for i, t in enumerate(tokens) if t == "<start_of_image>"]
    assert len(starts) == len(images) and all(tokens[i:i + len(run)] == run for i in starts)
    torch.testing.assert_close(logits, hf_logits(hf, inputs), rtol=0, atol=1e-4)
    out = llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids
    want = hf_logits(hf, inputs, out[:-1])[len(ids) - 1:].argmax(-1)
    assert out == want.tolist()
    llm.engine.check_idle()


def test_image_tokens_see_their_whole_image(llm, hf, model_dir):
    """Without the image mask (no token_type_ids: causal everywhere) transformers' logits differ:
    what the test above matches is the bidirectional one."""
    inputs = hf_inputs(model_dir, ONE, [RED])
    causal = hf(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0].detach()
    assert (causal - ember_logits(llm, ONE, [RED])[2]).abs().max() > 0.1


def test_a_repeated_image_hits_the_prefix_cache_and_changes_nothing(llm):
    assert_a_repeated_image_hits(llm, ONE, BLUE.size, TOKENS_PER_IMAGE, GREEDY)


def test_chunked_prefill_computes_each_image_in_one_step(model_dir, llm):
    """A budget of 20 tokens a step would cut both images' 18-token runs: each chunk stops before
    an image instead, which then runs whole (the runner refuses a chunk that ends inside one)."""
    chunked = make_llm(model_dir, max_num_batched_tokens=20, enable_prefix_caching=False)
    want = llm.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids
    assert chunked.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids == want
    assert chunked.engine.runner.images.num_encoder_steps == 2
    chunked.engine.check_idle()
    with pytest.raises(ValueError, match="image's 16 tokens attend to each other both ways.*max_num_batched_tokens=8"):
        make_llm(model_dir, max_num_batched_tokens=8)


def _config(vision: dict | None = None, **kw) -> dict:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 16,
            "vision_config": {"image_size": 64, "patch_size": 8} | (vision or {}), **kw}


@pytest.mark.parametrize("config,message", [
    (_config(mm_tokens_per_image=12), "mm_tokens_per_image 12 must be a square"),
    (_config(mm_tokens_per_image=9), "mm_tokens_per_image 9 must be a square whose side divides"),
    (_config(vision={"hidden_act": "relu"}), "the tower's hidden_act 'relu'"),
    (_config(vision={"model_type": "clip_vision_model"}), "'clip_vision_model' vision tower is not supported"),
])
def test_configs_ember_does_not_run_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        vision_config(config, 64)
    gemma3 = vision_config(_config(), 64)
    assert (gemma3.kind, gemma3.tokens_per_image, gemma3.image_token_id, gemma3.bidirectional_images) == \
        ("gemma3", 16, 262144, True)  # Gemma3Config's image_token_index


def test_processor_settings_ember_does_not_run_are_refused_at_load(model_dir, tmp_path):
    with pytest.raises(ValueError, match="expands an image into 4 tokens of id"):
        make_llm(with_processor_settings(model_dir, tmp_path / "other", None, {"image_seq_length": 4}))


# pan-and-scan (transformers' defaults: crops of at least 256 pixels, at most 4, for an aspect
# ratio of 1.2 or more): a 768 x 256 image is cut into 3 crops of 256 x 256, each its own view
WIDE = image((200, 30, 30), (768, 256))
PAN_AND_SCAN = {"do_pan_and_scan": True}


def test_pan_and_scan_matches_transformers(llm, hf, model_dir):
    """The image and its 3 crops, each a run of image tokens after transformers' text, each
    encoded and attending within itself: transformers' logits and greedy tokens."""
    inputs = hf_inputs(model_dir, ONE, [WIDE], do_pan_and_scan=True)
    ids, _, logits = ember_logits(llm, ONE, [WIDE], mm_processor_kwargs=PAN_AND_SCAN)
    assert ids == inputs["input_ids"][0].tolist() and inputs["pixel_values"].shape[0] == 4
    text = llm.get_tokenizer().decode(ids)
    assert text.count("<start_of_image>") == 4 and "Here is the original image" in text \
        and "and here are some crops to help you see better" in text
    torch.testing.assert_close(logits, hf_logits(hf, inputs), rtol=0, atol=1e-4)
    out = llm.generate(prompt(ONE, [WIDE], mm_processor_kwargs=PAN_AND_SCAN), GREEDY)[0].outputs[0].token_ids
    assert out == hf_logits(hf, inputs, out[:-1])[len(ids) - 1:].argmax(-1).tolist()
    llm.engine.check_idle()


def test_pan_and_scan_keys_the_caches_and_a_repeat_hits(llm):
    """Off, then on: the image's whole view has the same pixels both ways but not the same hash,
    so the tower runs for all 4 views and no block is shared past the common text; on again:
    a prefix hit past the last crop, the same answer, the tower not run. (An image no other test
    sends: the encoder cache outlives a prefix-cache reset.)"""
    wide = image((30, 160, 40), WIDE.size)
    llm.engine.reset_prefix_cache()
    images = llm.engine.runner.images
    off = llm.generate(prompt(ONE, [wide]), SHORT)[0]
    encoded = images.num_encoded
    on = llm.generate(prompt(ONE, [wide], mm_processor_kwargs=PAN_AND_SCAN), SHORT)[0]
    again = llm.generate(prompt(ONE, [wide], mm_processor_kwargs=PAN_AND_SCAN), SHORT)[0]
    assert images.num_encoded == encoded + 4
    image_token = llm.config.model_config.vision.image_token_id
    common = next(i for i, (a, b) in enumerate(zip(off.prompt_token_ids, on.prompt_token_ids)) if a != b)
    assert on.num_cached_tokens <= common < on.prompt_token_ids.index(image_token)
    last_image = len(on.prompt_token_ids) - on.prompt_token_ids[::-1].index(image_token)
    assert again.num_cached_tokens >= last_image and again.outputs[0].token_ids == on.outputs[0].token_ids
    views = [llm.inputs.make_request(str(i), p, SHORT).mm_features for i, p in
             enumerate([prompt(ONE, [wide]), prompt(ONE, [wide], mm_processor_kwargs=PAN_AND_SCAN)])]
    assert [len(v) for v in views] == [1, 4]
    assert (views[0][0].pixel_values == views[1][0].pixel_values).all() and views[0][0].hash != views[1][0].hash
    llm.engine.check_idle()


def test_pan_and_scan_from_the_processor_config_counts_each_crop_in_the_encoder_budget(llm, model_dir, tmp_path):
    """do_pan_and_scan on in preprocessor_config.json; a request's mm_processor_kwargs turns it
    off. --limit-mm-per-prompt counts the image once (as vLLM); the encoder budget every crop's
    tokens: at 32 tokens a step, the 4 views of 16 are encoded over 2 steps, the answer the same."""
    on = with_processor_settings(model_dir, tmp_path / "on", "image_processor", PAN_AND_SCAN)
    budget = make_llm(on, max_num_encoder_input_tokens=32, limit_mm_per_prompt={"image": 1})
    want = llm.generate(prompt(ONE, [WIDE], mm_processor_kwargs=PAN_AND_SCAN), GREEDY)[0].outputs[0].token_ids
    assert budget.generate(prompt(ONE, [WIDE]), GREEDY)[0].outputs[0].token_ids == want
    assert budget.engine.runner.images.num_encoder_steps == 2
    off = budget.inputs.make_request("off", prompt(ONE, [WIDE], mm_processor_kwargs={"do_pan_and_scan": False}), SHORT)
    assert off.prompt_token_ids == llm.inputs.make_request("off", prompt(ONE, [WIDE]), SHORT).prompt_token_ids
    assert len(off.mm_features) == 1
    with pytest.raises(ValueError, match="2 images in one prompt is over the limit of 1"):
        budget.generate(prompt(TWO, [WIDE, WIDE]), GREEDY)
    budget.engine.check_idle()


@pytest.mark.parametrize("kwargs,message", [
    ({"do_pan_and_scan": True, "num_crops": 2}, "mm_processor_kwargs 'num_crops' is not supported"),
    ({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true or false"),
    ([True], "mm_processor_kwargs must be an object"),
])
def test_other_mm_processor_kwargs_are_refused_by_name(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt(ONE, [WIDE], mm_processor_kwargs=kwargs), GREEDY)
    with pytest.raises(ValueError, match=message):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, mm_processor_kwargs=kwargs)

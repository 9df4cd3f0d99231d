"""Gemma 3 (Gemma3ForConditionalGeneration) on a tiny random checkpoint saved by transformers,
against transformers on the same inputs: one image and two in a prompt, each expanded into
<start_of_image>, its image tokens, <end_of_image>; prompt logits (the image tokens attending to
each other both ways, the sliding layers' window shorter than an image), greedy tokens, a
repeated image in the prefix cache, chunked prefill that never ends inside an image, and what
ember does not run refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from gemma3_vision_model import ONE, TOKENS_PER_IMAGE, TWO, hf_inputs, load_hf, save_tiny_gemma3  # noqa: E402
from llava_model import assert_a_repeated_image_hits, ember_logits, image, make_llm, prompt  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.models.vision_config import vision_config  # noqa: E402

RED, BLUE = image((200, 30, 30), (40, 30)), image((20, 40, 220), (100, 50))
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


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


@pytest.mark.parametrize("part,change,message", [
    ("image_processor", {"do_pan_and_scan": True}, "do_pan_and_scan on, which ember does not run"),
    (None, {"image_seq_length": 4}, "expands an image into 4 tokens of id"),
])
def test_processor_settings_ember_does_not_run_are_refused_at_load(model_dir, tmp_path, part, change, message):
    """processor_config.json as transformers 5 writes it: the image processor's settings inside."""
    other = shutil.copytree(model_dir, tmp_path / "other")
    settings = json.loads((other / "processor_config.json").read_text())
    (settings[part] if part else settings).update(change)
    (other / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=message):
        make_llm(other)

"""Pixtral (LlavaForConditionalGeneration over a pixtral tower) and Mistral 3
(Mistral3ForConditionalGeneration) on tiny random checkpoints saved by transformers, against
transformers on the same inputs: a small image and one resized down (different token grids),
alone and together in one prompt; each image's rows of [IMG] / [IMG_BREAK] / [IMG_END], logits,
greedy tokens, a chunk boundary inside an image's rows, the prefix cache over a repeated image,
and the configs and processor files refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import assert_a_repeated_image_hits, ember_logits, image, make_llm, prompt  # noqa: E402
from pixtral_model import FAMILIES, ONE, TWO, hf_inputs, load_hf, row_layout, save_tiny_pixtral  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.models.vision_config import vision_config  # noqa: E402

# 40 x 30 pixels: 4 x 5 patches of 8 (Mistral 3: 2 x 3 tokens of 16); 100 x 50 resized to 64 x 32:
# 4 x 8 patches (2 x 4 tokens)
RED, BLUE = image((200, 30, 30), (40, 30)), image((20, 40, 220), (100, 50))
GRIDS = {"pixtral": [(4, 5), (4, 8)], "mistral3": [(2, 3), (2, 4)]}  # each image's (rows, cols) of tokens
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ONE_FAMILY = pytest.mark.parametrize("family", ["mistral3"], indirect=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    return save_tiny_pixtral(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def hf(model_dir, family):
    return load_hf(model_dir, family)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.mark.parametrize("text,images", [(ONE, [RED]), (TWO, [RED, BLUE])], ids=["one-image", "two-images"])
def test_rows_logits_and_greedy_tokens_match_transformers(llm, hf, model_dir, family, text, images):
    inputs = hf_inputs(model_dir, text, images)
    ids, _, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    tokens = llm.get_tokenizer().convert_ids_to_tokens(ids)
    runs = [row_layout(r, c) for r, c in GRIDS[family][:len(images)]]
    first = tokens.index("[IMG]")
    assert tokens[first:first + len(runs[0])] == runs[0]
    if len(images) == 2:
        second = tokens.index("[IMG]", first + len(runs[0]))
        assert tokens[second:second + len(runs[1])] == runs[1]
    with torch.no_grad():
        want = hf(**inputs).logits[0]
        expected = hf.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


@ONE_FAMILY
def test_a_repeated_image_hits_the_prefix_cache_and_changes_nothing(llm):
    assert_a_repeated_image_hits(llm, ONE, BLUE.size, len(row_layout(*GRIDS["mistral3"][1])), GREEDY)


@ONE_FAMILY
def test_chunk_boundaries_inside_an_images_rows_change_nothing(model_dir, llm):
    """A budget of 4 tokens a step cuts the images' 8- and 10-token runs (break tokens among them)."""
    chunked = make_llm(model_dir, max_num_batched_tokens=4, enable_prefix_caching=False)
    want = llm.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids
    assert chunked.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids == want
    assert chunked.engine.runner.images.num_encoded == 2
    chunked.engine.check_idle()


def _config(arch: str = "LlavaForConditionalGeneration", vision: dict | None = None, **kw) -> dict:
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "patch_size": 8} | (vision or {})
    return {"architectures": [arch], "vision_config": vision, "vision_feature_select_strategy": "full", **kw}


@pytest.mark.parametrize("config,message", [
    (_config(vision_feature_select_strategy="default"), "vision_feature_select_strategy 'default' is not supported"),
    (_config("Mistral3ForConditionalGeneration", vision_feature_layer=[-1, -2]), r"vision_feature_layer \[-1, -2\]"),
    (_config(vision={"rope_parameters": {"rope_type": "yarn"}}), "vision rope_type 'yarn' is not supported"),
    (_config(vision={"hidden_act": "relu"}), "the tower's hidden_act 'relu'"),
])
def test_configs_ember_does_not_run_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        vision_config(config, 64)
    mistral3 = vision_config(_config("Mistral3ForConditionalGeneration"), 64)
    assert (mistral3.kind, mistral3.merge_size, mistral3.image_token_id, mistral3.projector_bias) == \
        ("mistral3", 2, 10, False)  # Mistral3Config's defaults


@ONE_FAMILY
def test_a_processor_that_lays_out_otherwise_than_the_model_is_refused_at_load(model_dir, tmp_path):
    other = shutil.copytree(model_dir, tmp_path / "other")
    layout = json.loads((other / "processor_config.json").read_text())
    (other / "processor_config.json").write_text(json.dumps(layout | {"spatial_merge_size": 1}))
    with pytest.raises(ValueError, match="the processor lays images out in patches of 8 merged 1 x 1 with image token"):
        make_llm(other)

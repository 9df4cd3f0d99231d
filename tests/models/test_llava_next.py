"""LLaVA-NeXT (LlavaNextForConditionalGeneration) on a tiny random checkpoint saved by
transformers, against transformers on the same processor inputs: a wide and a tall image
(tiled 1 x 3 and 2 x 1, unpadded above-below and left-right), alone and together in one
prompt; logits, greedy tokens, each image's token count, the prefix cache over a repeated
image, and the configs refused. The image path past the tower (chunks, encoder cache, preemption) is LLaVA-1.5's, tested
in test_llava.py."""

from __future__ import annotations

import json
import shutil
from itertools import groupby

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import assert_a_repeated_image_hits, ember_logits, image, make_llm, prompt, save_tiny_llava  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.models.vision_config import vision_config  # noqa: E402

WIDE, TALL = image((200, 30, 30), (200, 40)), image((20, 40, 220), (30, 90))
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich is red? ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 16 of the base view, then the kept grid rows, each its columns and a newline: the wide image's
# 1 x 3 tiles are 4 x 12 patches, of which rows 1..2 hold the image (2 x 13); the tall one's
# 2 x 1 are 8 x 4, of which columns 1..2 do (8 x 3)
WIDE_TOKENS, TALL_TOKENS = 16 + 2 * 13, 16 + 8 * 3


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory):
    return save_tiny_llava(bpe_tokenizer_dir, tmp_path_factory.mktemp("llava-next"), anyres=True)


@pytest.fixture(scope="module")
def hf(model_dir):
    processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    return processor, model.eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.mark.parametrize("text,images,counts", [(ONE, [WIDE], [WIDE_TOKENS]),
                                                (TWO, [WIDE, TALL], [WIDE_TOKENS, TALL_TOKENS])],
                         ids=["one-image", "two-images"])
def test_logits_and_greedy_tokens_match_transformers(llm, hf, text, images, counts):
    inputs = hf[0](text=[text], images=images, return_tensors="pt")
    ids, _, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    token = llm.config.model_config.vision.image_token_id
    assert [len(list(run)) for t, run in groupby(ids) if t == token] == counts
    with torch.no_grad():
        want = hf[1](**inputs).logits[0]
        expected = hf[1].generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(text, images), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


def test_a_repeated_image_hits_the_prefix_cache_and_changes_nothing(llm):
    """The same image after the same text hits past its tokens, the tower run once for both."""
    assert_a_repeated_image_hits(llm, ONE, TALL.size, TALL_TOKENS, GREEDY)


def _config(**kw) -> dict:
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
    return {"architectures": ["LlavaNextForConditionalGeneration"], "vision_config": vision, **kw}


@pytest.mark.parametrize("kw,message", [
    ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full' is not supported"),
    ({"image_grid_pinpoints": [[56, 100]]}, "must each be (height, width) multiples of the tower's image_size 56"),
])
def test_configs_ember_does_not_run_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        vision_config(_config(**kw), 64)
    assert vision_config(_config(), 64).grid_pinpoints[0] == (336, 672)  # LlavaNextConfig's default pinpoints


def test_a_processor_that_tiles_otherwise_than_the_model_is_refused_at_load(model_dir, tmp_path):
    other = shutil.copytree(model_dir, tmp_path / "other")
    processor = json.loads((other / "processor_config.json").read_text())
    processor["image_processor"]["image_grid_pinpoints"] = [[56, 112], [112, 56]]
    (other / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ValueError, match=r"the image processor tiles at \[\[56, 112\], \[112, 56\]\] in tiles of 56 x "
                                         r"56; config.json's model at \[\[56, 112\], \[112, 56\], \[112, 112\]"):
        make_llm(other)

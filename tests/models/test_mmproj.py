"""A GGUF model with llama.cpp's mmproj file beside it (`mmproj=`, the server's --mmproj): the
text GGUF and the mmproj that llama.cpp's convert_hf_to_gguf.py writes for tiny random Pixtral
and Mistral 3 checkpoints (f32), against transformers on the checkpoint they came from: the same
tokens, logits within 1e-4, greedy tokens equal; the image side read from the mmproj's metadata
is config.json's. And what is refused, by name: an mmproj beside an HF directory or a model with
no [IMG] token, a projector type or a key ember does not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("PIL")

from gguf_convert import rewrite_metadata  # noqa: E402
from llava_model import ember_logits, image, make_llm, prompt  # noqa: E402
from pixtral_model import FAMILIES, TWO, hf_inputs, load_hf, save_tiny_pixtral  # noqa: E402
from transformers.utils.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.loader.default_model import fetch_default_model  # noqa: E402

RED, BLUE = image((200, 30, 30), (40, 30)), image((20, 40, 220), (100, 50))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    return save_tiny_pixtral(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def pair(model_dir, gguf_convert):
    """(text GGUF, mmproj GGUF), as llama.cpp's converter writes them."""
    return gguf_convert(model_dir), gguf_convert(model_dir, mmproj=True)


def test_the_gguf_pair_answers_as_the_checkpoint_it_came_from(model_dir, pair, family):
    llm = make_llm(pair[0], mmproj=str(pair[1]))
    from_dir = make_llm(model_dir).config.model_config.vision
    # the mmproj's metadata gives config.json's image side, and the normalization of preprocessor_config.json
    assert llm.config.model_config.vision == dataclasses.replace(
        from_dir, image_mean=pytest.approx(OPENAI_CLIP_MEAN), image_std=pytest.approx(OPENAI_CLIP_STD))
    inputs = hf_inputs(model_dir, TWO, [RED, BLUE])
    ids, _, logits = ember_logits(llm, TWO, [RED, BLUE])
    assert ids == inputs["input_ids"][0].tolist()
    hf = load_hf(model_dir, family)
    with torch.no_grad():
        want = hf(**inputs).logits[0]
        expected = hf.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(TWO, [RED, BLUE]), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


@pytest.mark.parametrize("family", ["pixtral"], indirect=True)
def test_what_ember_does_not_run_is_refused_by_name(model_dir, pair, tmp_path):
    with pytest.raises(ValueError, match="--mmproj goes with a GGUF model; .* is an HF directory"):
        make_llm(model_dir, mmproj=str(pair[1]))
    with pytest.raises(ValueError, match=r"has no \[IMG\] token in its vocabulary: it takes no images"):
        make_llm(fetch_default_model(), mmproj=str(pair[1]))
    other = rewrite_metadata(pair[1], tmp_path / "llama4.gguf", **{"clip.projector_type": "llama4"})
    with pytest.raises(ValueError, match="projector type 'llama4' is not supported"):
        make_llm(pair[0], mmproj=str(other))
    unread = rewrite_metadata(pair[1], tmp_path / "layer.gguf", **{"clip.vision.feature_layer": "-2"})
    with pytest.raises(ValueError, match="ember does not honour clip.vision.feature_layer"):
        make_llm(pair[0], mmproj=str(unread))



@pytest.mark.parametrize("family", ["mistral3"], indirect=True)
def test_a_mistral3_text_gguf_with_query_temperature_scaling_is_refused(pair):
    """Ministral 3's text GGUFs (also "mistral3") scale queries by position: refused, not run as Mistral 3's."""
    from ember.loader.gguf import open_gguf
    from ember.models.config import ModelConfig

    f = open_gguf(pair[0])
    assert ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names).architecture == "mistral3"
    with pytest.raises(ValueError, match="mistral3.attention.temperature_scale .* is not supported"):
        ModelConfig.from_gguf_metadata(dict(f.metadata) | {"mistral3.attention.temperature_scale": 0.1},
                                       f.tensor_names)

"""Gemma 3, Qwen2-VL, Qwen2.5-VL and Qwen3-VL from llama.cpp's GGUF pair (`mmproj=`, the server's
--mmproj): the text GGUF and the mmproj that llama.cpp's convert_hf_to_gguf.py writes (f32) for
the tiny random checkpoints of the families' own tests, against ember on the HF directory they
came from: the image side read from the mmproj's metadata is config.json's, the same tokens, prompt
logits within 1e-4 and the same greedy tokens for one image and two. And what is refused, by name.

What the checkpoints change for the converter: Gemma 3's tensors under google's names
(vision_tower.vision_model.*, which gguf-py's table maps; transformers saves vision_tower.*) and
its input projection rounded to float16 (the converter stores it so whatever the outtype); the
Qwen towers 3 blocks deep (gguf-py maps merger.mlp.{0,2} only below the tower's depth), Qwen2.5-VL's
windows of 112 pixels (clip.cpp's size: the converter writes none), and images of 8 to 32 merged
patches, sized alike by the directory's processor and by llama.cpp's limits (8 to 4096)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("PIL")

import gemma3_vision_model  # noqa: E402
import qwen_vl_model  # noqa: E402
from gguf_convert import rewrite_metadata  # noqa: E402
from llava_model import ember_logits, image, make_llm, prompt  # noqa: E402

from ember import SamplingParams  # noqa: E402
from ember.loader.default_model import fetch_default_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# 130 x 70 and 250 x 60 pixels: 5 x 2 and 9 x 2 merged patches of Qwen2-VL's 28 pixels (4 x 2 and 8 x 2
# of Qwen3-VL's 32); Gemma 3 resizes both to its 64-pixel square
RED, BLUE = image((200, 30, 30), (130, 70)), image((20, 40, 220), (250, 60))
PROMPTS = {"gemma3": (gemma3_vision_model.ONE, gemma3_vision_model.TWO),
           "qwen": (qwen_vl_model.ONE, qwen_vl_model.TWO)}
# what llama.cpp's Gemma 3 GGUF cannot say, as llama.cpp reads it: each 6th layer global (so 3 layers
# all slide) and queries scaled by head_dim
GEMMA3_SHAPE = {"text": {"layer_types": ["sliding_attention"] * 3, "query_pre_attn_scalar": 16}}
QWEN_SHAPE = {"vision": {"depth": 3}, "max_pixels": 32 * 32 * 32}


@pytest.fixture(scope="module", params=["gemma3", *qwen_vl_model.FAMILIES])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    out = tmp_path_factory.mktemp(family)
    if family == "gemma3":
        return _as_google_saves_it(gemma3_vision_model.save_tiny_gemma3(bpe_tokenizer_dir, out, GEMMA3_SHAPE))
    shape = QWEN_SHAPE | ({"vision": {"depth": 3, "window_size": 112}} if family == "qwen2_5_vl" else {})
    return qwen_vl_model.save_tiny_qwen_vl(bpe_tokenizer_dir, out, family, shape)


def _as_google_saves_it(model_dir: Path) -> Path:
    """The checkpoint under google/gemma-3-*'s tensor names, its input projection float16's values."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    tensors = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in load_file(file).items()}
    w = "multi_modal_projector.mm_input_projection_weight"
    tensors[w] = tensors[w].half().float()
    save_file(tensors, file, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def pair(model_dir, gguf_convert):
    """(text GGUF, mmproj GGUF), as llama.cpp's converter writes them."""
    return gguf_convert(model_dir), gguf_convert(model_dir, mmproj=True)


def test_the_gguf_pair_answers_as_the_checkpoint_it_came_from(model_dir, pair, family):
    gguf_llm, hf_llm = make_llm(pair[0], mmproj=str(pair[1])), make_llm(model_dir)
    vision = gguf_llm.config.model_config.vision
    # config.json's image side; the normalization is the processor's (Qwen3-VL's tiny one: 0.5), and
    # Qwen2.5-VL's tokens_per_second times videos, which a GGUF pair takes none of
    mean = (0.5,) * 3 if family in ("gemma3", "qwen3_vl") else transformers.utils.constants.OPENAI_CLIP_MEAN
    std = (0.5,) * 3 if family in ("gemma3", "qwen3_vl") else transformers.utils.constants.OPENAI_CLIP_STD
    assert vision == dataclasses.replace(hf_llm.config.model_config.vision, image_mean=pytest.approx(mean),
                                         image_std=pytest.approx(std), tokens_per_second=0.0)
    prompts = [prompt(text, images) for text, images in
               zip(PROMPTS["gemma3" if family == "gemma3" else "qwen"], ([RED], [RED, BLUE]))]
    for p in prompts:
        ids, positions, logits = ember_logits(gguf_llm, p["prompt"], p["multi_modal_data"]["image"])
        want_ids, want_positions, want = ember_logits(hf_llm, p["prompt"], p["multi_modal_data"]["image"])
        assert ids == want_ids and torch.equal(positions, want_positions)
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert [o.outputs[0].token_ids for o in gguf_llm.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in hf_llm.generate(prompts, GREEDY)]
    if family == "gemma3":  # llama.cpp's mtmd cuts no pan-and-scan crops
        with pytest.raises(ValueError, match=r"do_pan_and_scan is not supported by a gemma3 GGUF and its mmproj"):
            gguf_llm.generate(prompt(PROMPTS["gemma3"][0], [RED], mm_processor_kwargs={"do_pan_and_scan": True}),
                              GREEDY)
    else:  # images of 8 and 18 merged patches (Qwen3-VL's 16-pixel patches: 8 and 16)
        assert [f.length for f in gguf_llm.inputs.make_request("r", prompt(PROMPTS["qwen"][1], [RED, BLUE]),
                                                               GREEDY).mm_features] == \
            ([8, 16] if family == "qwen3_vl" else [10, 18])
    gguf_llm.engine.check_idle()


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_what_ember_does_not_run_is_refused_by_name(model_dir, pair, tmp_path):
    with pytest.raises(ValueError, match="a qwen2.5vl_merger tower goes with llama.cpp's qwen2vl language model"):
        make_llm(fetch_default_model(), mmproj=str(pair[1]))
    unread = rewrite_metadata(pair[1], tmp_path / "pixels.gguf", **{"clip.vision.image_max_pixels": "1000"})
    with pytest.raises(ValueError, match="ember does not honour clip.vision.image_max_pixels"):
        make_llm(pair[0], mmproj=str(unread))
    omni = rewrite_metadata(pair[1], tmp_path / "omni.gguf", **{"clip.projector_type": "qwen2.5o"})
    with pytest.raises(ValueError, match="projector type 'qwen2.5o' is not supported"):
        make_llm(pair[0], mmproj=str(omni))
    llm = make_llm(pair[0], mmproj=str(pair[1]))
    with pytest.raises(ValueError, match=r"\(qwen2 from a GGUF and its mmproj\) takes no video"):
        llm.generate(prompt("<|vision_start|><|video_pad|><|vision_end|>", [], [RED, BLUE]), GREEDY)
    llm.engine.check_idle()


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_a_qwen_vl_text_gguf_without_its_mmproj_answers_text(model_dir, pair):
    """Text alone: its three M-RoPE positions are equal, plain RoPE (no images to place)."""
    text = "<|im_start|>user\nWhich is red?<|im_end|>\n<|im_start|>assistant\n"
    llm = make_llm(pair[0])
    assert llm.config.model_config.vision is None and llm.config.model_config.mrope_interleaved
    assert llm.generate(text, GREEDY)[0].outputs[0].token_ids == \
        make_llm(model_dir).generate(text, GREEDY)[0].outputs[0].token_ids
    llm.engine.check_idle()

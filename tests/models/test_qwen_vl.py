"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration) on tiny random checkpoints
saved by transformers, against transformers on the same inputs: images of different sizes (so
different token counts), M-RoPE positions as get_rope_index makes them (Qwen3-VL's interleaved),
logits of prompts with one and two images (Qwen3-VL's deepstack rows added in its first layers),
greedy tokens (decode turns by position + delta), a chunk boundary inside an image, the prefix
cache over a repeated image; a video's frames (Qwen2.5-VL's temporal positions by fps, Qwen3-VL's
times as text between its temporal patches' runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from llava_model import ember_logits, image, make_llm, prompt, tokens_and_logprobs  # noqa: E402
from qwen_vl_model import FAMILIES, HF_CLASSES, ONE, TWO, V, hf_inputs, hf_media_inputs, save_tiny_qwen_vl  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.models.qwen2_vl import MLP_PAD  # noqa: E402

# 84 x 56 pixels: 4 x 6 patches, 6 tokens; 100 x 60: resized to 4 x 8 patches, 8 tokens (Qwen3-VL's
# 16-pixel patches: both 4 x 6, 6 tokens)
TOKENS = {"qwen2_vl": (6, 8), "qwen2_5_vl": (6, 8), "qwen3_vl": (6, 6)}
RED, BLUE = image((200, 30, 30), (84, 56)), image((20, 40, 220), (100, 60))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GREEDY_TOKENS = {"qwen2_vl": 8, "qwen2_5_vl": 8, "qwen3_vl": 16}  # transformers' generate takes ~0.2 s a token here
# the engine's handling (the prefix cache, chunks, preemption) is the families' one path: tested on
# one, and on Qwen3-VL's deepstack rows, which a chunk or a hit cuts as it cuts the embeddings
ONE_FAMILY = pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
QWEN25_AND_QWEN3 = pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"], indirect=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(bpe_tokenizer_dir, tmp_path_factory, family):
    return save_tiny_qwen_vl(bpe_tokenizer_dir, tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def hf(model_dir, family):
    return getattr(transformers, HF_CLASSES[family]).from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.mark.parametrize("text,images", [(ONE, [RED]), (TWO, [RED, BLUE])], ids=["one-image", "two-images"])
def test_positions_logits_and_greedy_tokens_match_transformers(llm, hf, model_dir, family, text, images):
    inputs = hf_inputs(model_dir, text, images)
    ids, positions, logits = ember_logits(llm, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    pad = llm.config.model_config.vision.image_token_id
    assert ids.count(pad) == sum(TOKENS[family][:len(images)])
    with torch.no_grad():
        want_positions, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                   inputs["image_grid_thw"])
        want = hf(**inputs).logits[0]
        n = GREEDY_TOKENS[family]
        expected = hf.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, len(ids):]
    assert torch.equal(positions, want_positions[:, 0])
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert llm.generate(prompt(text, images), greedy)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()
    mlp = llm.engine.runner.images.vision.blocks[0].mlp
    if family == "qwen2_5_vl":  # the loaded MLP (VisionMLP.finish_loading): gate and up one matmul, padded
        assert mlp.gate_up.weight.shape == (2 * MLP_PAD, mlp.down_proj.weight.shape[0])
        assert mlp.down_proj.weight.shape[1] == MLP_PAD
    else:
        assert mlp.gate_up is None


@torch.inference_mode()
def test_qwen2_5_vl_mlp_padded_to_whole_tiles_gives_the_unfused_sums():
    """VisionMLP.finish_loading: [gate | up] in one matmul, each half 45 -> 64 columns (zeros), down's
    inputs likewise: the unfused MLP's output, in float64 to the last bits' rounding."""
    from ember.models.qwen2_vl import VisionMLP
    from ember.models.vision_config import VisionConfig

    cfg = VisionConfig(kind="qwen2_5_vl", image_token_id=0, hidden_size=24, intermediate_size=45, num_layers=1,
                       num_heads=2, patch_size=14, num_channels=3, layer_norm_eps=1e-6, hidden_act="silu",
                       text_hidden_size=32)
    torch.manual_seed(0)
    mlp = VisionMLP(cfg).double()
    for p in mlp.parameters():
        p.normal_()
    x = torch.randn(7, 24, dtype=torch.float64)
    want = mlp(x)
    mlp.finish_loading()
    assert mlp.gate_up.weight.shape == (128, 24) and mlp.down_proj.weight.shape == (24, 64)
    assert not hasattr(mlp, "gate_proj") and mlp.gate_up.weight[45:64].abs().sum() == 0
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


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


@QWEN25_AND_QWEN3
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
    assert again.num_cached_tokens == len(first.prompt_token_ids) - 1  # all but the last token
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == start // 4 * 4  # the text's whole blocks before the image, no more
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.engine.runner.images.num_encoded == encoded + 3  # green, purple, yellow: the tower ran once for each
    llm.engine.check_idle()


@QWEN25_AND_QWEN3
def test_chunk_boundaries_inside_images_change_nothing(model_dir, llm):
    """A budget of 8 tokens a step cuts the 6- and 8-token (Qwen3-VL: 6-token) images across chunks,
    and gives the second prompt one-token chunks of its prompt beside the first's (at their
    positions in the prompt, not decode's p + delta)."""
    asks = [prompt(TWO, [RED, BLUE]), prompt(ONE, [BLUE])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    chunked = make_llm(model_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    want = [tokens_and_logprobs(o) for o in llm.generate(asks, params)]
    got = [tokens_and_logprobs(o) for o in chunked.generate(asks, params)]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in want], rtol=0, atol=1e-5)
    assert chunked.engine.runner.images.num_encoded == 2
    chunked.engine.check_idle()


@ONE_FAMILY
def test_preempted_requests_recompute_their_prompt_and_answer_at_the_same_positions(model_dir, llm):
    """A pool of 16 blocks (64 tokens) holds both prompts, not both answers: one is preempted and
    recomputes its prompt and its tokens so far in one chunk (image rows 3-D, rows past the
    prompt at position + delta)."""
    prompts = [prompt(ONE, [BLUE]), prompt(ONE, [RED])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)

    def answers(engine: LLM) -> list[tuple[list[int], list[float]]]:
        return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                for c in (o.outputs[0] for o in engine.generate(prompts, params))]

    want = answers(llm)
    small = LLM(str(model_dir), dtype="float32", quantization="none", num_kv_blocks=16, block_size=4,
                max_model_len=64, enable_prefix_caching=False)
    got = answers(small)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in want], rtol=0, atol=1e-5)
    assert small.engine.stats().num_preemptions > 0
    small.engine.check_idle()


# Qwen2-VL-7B-Instruct's config.json as the hub has it: the language model's keys at the top level,
# M-RoPE as rope_scaling type "mrope"
HUB_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}


def test_the_hubs_flat_config_reads_as_qwen2_with_m_rope():
    from ember.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(HUB_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias) == \
        ("qwen2", 3584, 4, 128, True)
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6 and cfg.mrope_section == (16, 24, 24)
    v = cfg.vision
    assert (v.kind, v.hidden_size, v.intermediate_size, v.num_layers, v.num_heads, v.text_hidden_size,
            v.merge_size, v.temporal_patch_size, v.hidden_act) == \
        ("qwen2_vl", 1280, 5120, 32, 16, 3584, 2, 2, "quick_gelu")


# Qwen3-VL-4B-Instruct's config.json as the hub has it (transformers 4.57's spelling: rope_scaling)
QWEN3_VL_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": True,
    "text_config": {"model_type": "qwen3_vl_text", "attention_bias": False, "bos_token_id": 151643,
                    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
                    "intermediate_size": 9728, "max_position_embeddings": 262144, "num_attention_heads": 32,
                    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "tie_word_embeddings": True, "vocab_size": 151936},
    "vision_config": {"model_type": "qwen3_vl", "deepstack_visual_indexes": [5, 11, 17], "depth": 24,
                      "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024, "in_channels": 3,
                      "intermediate_size": 4096, "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def test_the_hubs_qwen3_vl_config_reads_as_qwen3_with_interleaved_m_rope_and_deepstack():
    from ember.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(QWEN3_VL_CONFIG)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm, cfg.tie_word_embeddings) \
        == ("qwen3", 2560, 8, 128, True, True)
    assert (cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved) == (5e6, (24, 20, 20), True)
    v = cfg.vision
    assert (v.kind, v.hidden_size, v.intermediate_size, v.num_layers, v.text_hidden_size, v.patch_size,
            v.num_position_embeddings, v.deepstack_blocks, v.hidden_act, v.video_token_id) == \
        ("qwen3_vl", 1024, 4096, 24, 2560, 16, 2304, (5, 11, 17), "gelu_pytorch_tanh", 151656)


@pytest.mark.parametrize("section", [(2, 3, 3), (24, 20, 20)])
def test_interleaved_m_rope_turns_each_frequency_by_its_axis(section):
    """Qwen3-VL's layout (t h w t h w ... while h's and w's sections last, then t), as
    transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies picks each frequency's axis."""
    from types import SimpleNamespace

    from ember.layers.rotary import mrope_rows

    axes = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, sum(section)).clone()
    picked = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding.recomposition_frequencies(
        SimpleNamespace(mrope_section=list(section)), axes)  # [1, 1, 2 * n]: the n axes, twice
    assert mrope_rows(section, True).tolist() == picked[0, 0, :sum(section)].long().tolist()
    assert mrope_rows((2, 3, 3), False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("change,words", [
    ({"architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe"},
     ["Qwen3VLMoeForConditionalGeneration", "unsupported architecture"]),
    ({"vision_config": QWEN3_VL_CONFIG["vision_config"] | {"deepstack_visual_indexes": [5, 30]}},
     ["deepstack_visual_indexes [5, 30]", "24"]),
    ({"vision_config": QWEN3_VL_CONFIG["vision_config"] | {"num_position_embeddings": 2300}},
     ["num_position_embeddings 2300", "square"]),
    ({"text_config": QWEN3_VL_CONFIG["text_config"] | {"rope_scaling": {"mrope_interleaved": False,
                                                                         "mrope_section": [24, 20, 20]}}},
     ["mrope_interleaved False", "qwen3_vl", "interleaved"]),
], ids=["moe", "deepstack-outside-tower", "position-grid", "not-interleaved"])
def test_qwen3_vl_configs_ember_does_not_run_are_refused_by_name(change, words):
    from ember.models.config import ModelConfig

    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_config(QWEN3_VL_CONFIG | change)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("change,words", [
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 16]}}, ["mrope_section", "covers 56"]),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "mrope_interleaved": True}},
     ["mrope_interleaved", "not supported"]),
    ({"vision_config": HUB_CONFIG["vision_config"] | {"hidden_act": "relu"}}, ["hidden_act 'relu'"]),
], ids=["sections-do-not-fit", "interleaved", "tower-activation"])
def test_configs_ember_does_not_run_are_refused_by_name(change, words):
    from ember.models.config import ModelConfig

    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_config(HUB_CONFIG | change)
    assert all(w in str(e.value) for w in words), str(e.value)


# four frames of 84 x 56 pixels, reddening: two patches in time of 4 x 6 patches (Qwen3-VL: 4 x 6 of 16 pixels)
FRAMES = [image((200 - 30 * i, 30 + 30 * i, 40), (84, 56)) for i in range(4)]
VIDEO = f"<|im_start|>user\n{V}then <|vision_start|><|video_pad|><|vision_end|>What happens?<|im_end|>\n" \
        "<|im_start|>assistant\n"


@QWEN25_AND_QWEN3
def test_a_video_matches_transformers(llm, hf, family):
    """An image, then a 4-frame video: Qwen2.5-VL's at 1 fps (its temporal positions 8 apart:
    tokens_per_second 4 x 2 frames a patch), Qwen3-VL's at transformers' default 24 fps (each
    temporal patch's time, its frames' mean, as text before its own run)."""
    video = (FRAMES, {"fps": 1.0}) if family == "qwen2_5_vl" else FRAMES
    ids, positions, logits = ember_logits(llm, VIDEO, [BLUE], video)
    features = llm.inputs.make_request("v", prompt(VIDEO, [BLUE], video), GREEDY).mm_features
    vision = llm.config.model_config.vision
    assert [(f.length, f.grid_thw) for f in features] == \
        {"qwen2_5_vl": [(8, (1, 4, 8)), (12, (2, 4, 6))], "qwen3_vl": [(6, (1, 4, 6)), (6, (1, 4, 6)), (6, (1, 4, 6))]}[family]
    if family == "qwen3_vl":
        run = "<|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
        assert llm.inputs.tokenizer.decode(ids).endswith(f"then <0.0 seconds>{run}<0.1 seconds>{run}What happens?"
                                                         "<|im_end|>\n<|im_start|>assistant\n")
    inputs = hf_media_inputs(ids, features, vision, 2.0 if family == "qwen2_5_vl" else None)
    with torch.no_grad():
        rope_args = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
        want_positions, _ = hf.model.get_rope_index(**{k: inputs[k] for k in rope_args if k in inputs})
        want = hf(**inputs).logits[0]
        expected = hf.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert torch.equal(positions, want_positions[:, 0])
    if family == "qwen2_5_vl":  # the video's two patches in time at t + 0 and t + 8
        start = features[1].offset
        assert positions[0, start + 11] - positions[0, start] == 8
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    assert llm.generate(prompt(VIDEO, [BLUE], video), GREEDY)[0].outputs[0].token_ids == expected.tolist()
    llm.engine.check_idle()


@pytest.mark.parametrize("family", ["qwen3_vl"], indirect=True)
def test_video_patches_are_the_video_processors_layout(llm):
    """Three frames (padded with the last to two patches in time), resized, rescaled and normalized
    here by hand, patchified by transformers' Qwen3VLVideoProcessor.patchify: ember's patches."""
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    clip = llm.inputs.image_processor().videos.process(FRAMES[:3], None)
    t, h, w = clip.grid
    frames = np.stack([np.asarray(f.resize((w * 16, h * 16), Image.Resampling.BICUBIC), dtype=np.float32)
                       for f in FRAMES[:3]]) / 255
    frames = torch.from_numpy(((frames - 0.5) / 0.5).transpose(0, 3, 1, 2))[None]  # [1, F, C, H, W]
    want, *grid = Qwen3VLVideoProcessor.patchify(None, frames, 16, 2, 2)
    assert tuple(grid) == clip.grid == (2, 4, 6)
    torch.testing.assert_close(torch.from_numpy(clip.patches), want[0], rtol=0, atol=1e-6)


@ONE_FAMILY
@pytest.mark.parametrize("ask,words", [
    ({"prompt": "What happens?", "multi_modal_data": {"video": FRAMES}}, ["0 video placeholders", "for 1 videos"]),
    ({"prompt": VIDEO, "multi_modal_data": {"image": [BLUE], "video": (FRAMES, {"fps": 2, "duration": 2})}},
     ["metadata ['duration']", "as sampled"]),
    ({"prompt": VIDEO, "multi_modal_data": {"image": [BLUE], "video": [FRAMES[0], BLUE]}}, ["differ in size"]),
    ({"prompt": VIDEO, "multi_modal_data": {"image": [BLUE], "video": [FRAMES, FRAMES]}},
     ["2 videos in one prompt", "limit of 1"]),
], ids=["no-placeholder", "metadata", "frame-sizes", "too-many"])
def test_videos_ember_cannot_take_are_refused_by_name(llm, ask, words):
    with pytest.raises(ValueError) as e:
        llm.generate(ask, GREEDY)
    assert all(w in str(e.value) for w in words), str(e.value)


@ONE_FAMILY
def test_chat_takes_video_parts_and_refuses_video_urls(llm):
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": BLUE}, {"type": "text", "text": "then "},
                                             {"type": "video", "video": FRAMES},
                                             {"type": "text", "text": "What happens?"}]}]
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt == VIDEO
    assert out.outputs[0].token_ids == llm.generate(prompt(VIDEO, [BLUE], FRAMES), GREEDY)[0].outputs[0].token_ids
    messages[0]["content"][2] = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(ValueError, match="video_url parts are not supported"):
        llm.chat(messages, GREEDY)

"""Tiny random Qwen2-VL and Qwen2.5-VL saved by transformers (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration: a 2-block vision tower of 14-pixel patches merged 2 x 2, a
2-layer Qwen2 language model with M-RoPE sections [2, 3, 3] of its 16-dim heads), with
SmolLM2's tokenizer plus Qwen's vision tokens, the Qwen2VLProcessor on the PIL image processor
(images resized to multiples of 28 pixels between MIN_PIXELS and MAX_PIXELS) and a Qwen2-VL chat
template. Qwen2.5-VL's tower attends in windows of 2 x 2 merged patches in block 0 and over the
whole image in block 1 (fullatt_block_indexes [1]). Qwen3-VL (Qwen3VLForConditionalGeneration):
a 3-block tower of 16-pixel patches with learned positions on a 3 x 3 grid (interpolated to each
image's), deepstack mergers after blocks 0 and 1 (added to the text model's first two layers'
outputs), and a 3-layer Qwen3 language model with interleaved M-RoPE."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Qwen2-VL's template, reduced: each image of a message is <|vision_start|><|image_pad|><|vision_end|>,
# each video <|vision_start|><|video_pad|><|vision_end|>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
V = "<|vision_start|><|image_pad|><|vision_end|>"  # an image in a prompt, as the template writes it
ONE = f"<|im_start|>user\n{V}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"  # the tests' prompts
TWO = f"<|im_start|>user\n{V}and {V}Which is red?<|im_end|>\n<|im_start|>assistant\n"
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 12  # at most 12 image tokens an image
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration"}


# Qwen2.5-VL-3B's shapes but for the depths (2 decoder layers, 2 tower blocks, the second of full
# attention), the MLPs' widths, and images of at most 16 x 16 merged patches: the -m gpu test's
SMALL = {"text": dict(hidden_size=2048, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                       "mrope_section": [16, 24, 24]}),
         "vision": dict(hidden_size=1280, out_hidden_size=2048, num_heads=16, intermediate_size=1024,
                        window_size=112, fullatt_block_indexes=[1]),
         "max_pixels": 448 * 448, "std": 0.1}
# Qwen3-VL-2B's widths likewise (head_dim 128 with interleaved M-RoPE [24, 20, 20], a tower of 16
# heads of 64 dims on a 48 x 48 grid of learned positions), 3 tower blocks, 2 deepstack mergers
SMALL_QWEN3 = {"text": dict(hidden_size=2048, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, rope_parameters={"rope_theta": 5000000.0, "mrope_section": [24, 20, 20]}),
               "vision": dict(hidden_size=1024, out_hidden_size=2048, num_heads=16, intermediate_size=1024,
                              num_position_embeddings=2304),
               "max_pixels": 448 * 448, "std": 0.1}


def save_tiny_qwen_vl(tokenizer_dir: Path, out: Path, family: str = "qwen2_vl", shape: dict | None = None) -> Path:
    """The model directory, as transformers writes it (model, processor, tokenizer, template);
    `shape` (SMALL) overrides the tiny sizes."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    shape = shape or {}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id) | shape.get("text", {})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    patch = 14
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2) | shape.get("vision", {})
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
    elif family == "qwen3_vl":
        patch = 16
        text |= dict(num_hidden_layers=3, head_dim=16, tie_word_embeddings=False) | shape.get("text", {})
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True} | shape.get("text", {}).get("rope_parameters", {})
        vision = dict(depth=3, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=48,
                      num_position_embeddings=9, deepstack_visual_indexes=[0, 1]) | shape.get("vision", {})
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    else:
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=48,
                      window_size=56, fullatt_block_indexes=[1]) | shape.get("vision", {})
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
    torch.manual_seed(0)
    model = getattr(transformers, HF_CLASSES[family])(config)
    with torch.no_grad():  # transformers' init leaves the tiny model's logits nearly flat: spread them
        for p in model.parameters():
            p.normal_(0, shape.get("std", 0.2))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    # the image processor and the tokenizer apart: transformers' Qwen2VLProcessor cannot be made
    # without its video processor, which needs torchvision
    unit = (2 * patch) ** 2  # a merged token's pixels
    images = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit, "longest_edge": shape.get("max_pixels", MAX_PIXELS // 28 ** 2 * unit)},
        patch_size=patch, **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family == "qwen3_vl" else {}))
    images.save_pretrained(str(out))
    if family == "qwen3_vl":  # Qwen3VLVideoProcessor's file (it cannot be made without torchvision): its
        # pixels are every frame's, so 4 frames of 4 x 6 merged patches fit
        video = {"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": unit,
                                                                           "longest_edge": 4 * 24 * unit},
                 "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
                 "image_std": [0.5] * 3, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                 "do_normalize": True, "do_convert_rgb": True, "resample": 3, "do_sample_frames": True, "fps": 2,
                 "min_frames": 4, "max_frames": 768}
        (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return out


def hf_media_inputs(ids: list[int], features: list, vision, second_per_grid: float | None = None) -> dict:
    """transformers' model inputs for a prompt as ember processed it (its token ids and its images'
    and videos' features, in prompt order): each token's modality (mm_token_type_ids: 1 image, 2
    video), the images' patches and grids, the videos' (Qwen3-VL's one a temporal patch, rejoined
    into its video's grid) and Qwen2.5-VL's second_per_grid_ts."""
    import numpy as np

    t = torch.tensor([ids])
    out = {"input_ids": t, "mm_token_type_ids": (t == vision.image_token_id).int() + 2 * (t == vision.video_token_id).int()}
    for token, pixels, grids in ((vision.image_token_id, "pixel_values", "image_grid_thw"),
                                 (vision.video_token_id, "pixel_values_videos", "video_grid_thw")):
        mine = [f for f in features if ids[f.offset] == token]
        if mine:
            out[pixels] = torch.from_numpy(np.concatenate([f.pixel_values for f in mine]))
            out[grids] = torch.tensor([f.grid_thw for f in mine])
    if vision.kind == "qwen3_vl" and "video_grid_thw" in out:  # one video: its temporal patches
        grid = out["video_grid_thw"]
        out["video_grid_thw"] = torch.tensor([[int(grid[:, 0].sum()), int(grid[0, 1]), int(grid[0, 2])]])
    if second_per_grid is not None:
        out["second_per_grid_ts"] = torch.tensor([second_per_grid])
    return out


def hf_inputs(model_dir: Path, text: str, images: list) -> dict:
    """transformers' model inputs for a prompt with one <|image_pad|> where each image goes, as
    Qwen2VLProcessor makes them: its image processor's patches and grids, each image token
    repeated t * h * w / 4 times, the tokens, and each token's modality (mm_token_type_ids)."""
    import transformers

    enc = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")(images=images,
                                                                                         return_tensors="pt")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    parts = text.split("<|image_pad|>")
    counts = (enc["image_grid_thw"].prod(-1) // 4).tolist()
    inputs = tok(parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:])), return_tensors="pt")
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    return {**inputs, **enc, "mm_token_type_ids": (inputs["input_ids"] == pad).int()}

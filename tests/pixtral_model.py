"""Tiny random Pixtral and Mistral 3 saved by transformers: Pixtral as mistral-community/pixtral-12b
is on the hub (LlavaForConditionalGeneration over a `pixtral` tower), Mistral 3 as
Mistral-Small-3.1 (Mistral3ForConditionalGeneration: the same tower, its projector's RMSNorm
and 2 x 2 patch merger). A 2-layer Pixtral tower of 8-pixel patches (images at most 64 pixels a
side), a 2-layer Mistral language model, SmolLM2's tokenizer plus [IMG] / [IMG_BREAK] /
[IMG_END], PixtralImageProcessorPil's preprocessor_config.json and PixtralProcessor's
processor_config.json as the hub checkpoints have it (transformers' PixtralProcessor itself
needs torchvision, which is not installed, so it is written here rather than by save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
PATCH, LONGEST_EDGE = 8, 64
FAMILIES = ("pixtral", "mistral3")
HF_CLASSES = {"pixtral": "LlavaForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}
ONE = "[INST][IMG]What is in the picture?[/INST]"  # the tests' prompts: one image, two
TWO = "[INST][IMG]and [IMG]Which is red?[/INST]"
# Pixtral's chat template, reduced: a message's images ([IMG] each) before its text
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST]' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '[IMG]' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] }}{% endfor %}"
    "{% endif %}{{ '[/INST]' }}{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)


# Mistral-Small-3.1's tower widths (1024, 16 heads of 64, 14-pixel patches) but 3 layers and a
# narrower MLP, a 2-layer language model of 16 heads of 128 dims, images at most 448 pixels a
# side (up to 16 x 16 merged tokens): the -m gpu test's
SMALL = {"vision": dict(hidden_size=1024, intermediate_size=1024, num_attention_heads=16, patch_size=14),
         "text": dict(hidden_size=2048, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=128, max_position_embeddings=2048),
         "longest_edge": 448, "std": 0.05}


def save_tiny_pixtral(tokenizer_dir: Path, out: Path, family: str = "pixtral", shape: dict | None = None) -> Path:
    """The model directory, as transformers writes it (model, processor, tokenizer, template);
    `shape` (SMALL) overrides the tiny sizes."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]", *IMAGE_TOKENS]})
    shape = shape or {}
    longest = shape.get("longest_edge", LONGEST_EDGE)
    vision = transformers.PixtralVisionConfig(**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                     num_attention_heads=2, image_size=longest, patch_size=PATCH,
                                                     rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
                                              | shape.get("vision", {}))
    text = transformers.MistralConfig(**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, max_position_embeddings=512, sliding_window=None,
                                             rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
                                             eos_token_id=tok.eos_token_id) | shape.get("text", {}))
    patch = vision.patch_size
    image_token = tok.convert_tokens_to_ids("[IMG]")
    merge = 2 if family == "mistral3" else 1
    if family == "mistral3":
        config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=image_token,
                                             spatial_merge_size=merge, vision_feature_layer=-1,
                                             tie_word_embeddings=False)
        model_class = transformers.Mistral3ForConditionalGeneration
    else:
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                                          vision_feature_layer=-1, vision_feature_select_strategy="full",
                                          projector_hidden_act="gelu")
        model_class = transformers.LlavaForConditionalGeneration
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # transformers' init leaves the tiny model's logits nearly flat: spread them
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") or "ln_pre" in name else 0.0, shape.get("std", 0.2))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": longest},
                                                   patch_size={"height": patch, "width": patch})
    images.save_pretrained(str(out))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    layout = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
              "patch_size": patch, "spatial_merge_size": merge, "processor_class": "PixtralProcessor"}
    (out / "processor_config.json").write_text(json.dumps(layout, indent=2))
    return out


def row_layout(rows: int, cols: int) -> list[str]:
    """PixtralProcessor.replace_image_token's expansion of one image of rows x cols tokens,
    written out as its source has it."""
    run = [t for _ in range(rows) for t in ["[IMG]"] * cols + ["[IMG_BREAK]"]]
    run[-1] = "[IMG_END]"
    return run


def hf_inputs(model_dir: Path, text: str, images: list) -> dict:
    """transformers' model inputs for a prompt with one [IMG] where each image goes, as
    PixtralProcessor makes them from processor_config.json: its image processor at patches of
    patch_size x spatial_merge_size pixels, each [IMG] expanded by `row_layout`, the tokens."""
    import transformers

    layout = json.loads((model_dir / "processor_config.json").read_text())
    unit = layout["patch_size"] * layout["spatial_merge_size"]
    enc = transformers.AutoImageProcessor.from_pretrained(str(model_dir), backend="pil")(
        images=images, patch_size={"height": unit, "width": unit}, return_tensors="pt")
    parts = text.split("[IMG]")
    text = parts[0] + "".join("".join(row_layout(h // unit, w // unit)) + part
                              for (h, w), part in zip(enc["image_sizes"].tolist(), parts[1:]))
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    return {**tok(text, return_tensors="pt"), **enc}


def load_hf(model_dir: Path, family: str):
    """transformers' model of a tiny checkpoint, float32, for the references."""
    import transformers

    return getattr(transformers, HF_CLASSES[family]).from_pretrained(str(model_dir), dtype=torch.float32).eval()


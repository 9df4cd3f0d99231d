"""A tiny random Gemma 3 saved by transformers (Gemma3ForConditionalGeneration: a 2-layer SigLIP
tower of 64-pixel images in 8-pixel patches, pooled 2 x 2 into 16 image tokens, the projector,
a 3-layer Gemma 3 language model whose sliding layers' window of 8 tokens is shorter than an
image), with SmolLM2's tokenizer plus <start_of_image> / <end_of_image> / <image_soft_token>
(the tokenizer's boi, eoi and image tokens), the Gemma3Processor on Gemma3ImageProcessorPil and a
reduced chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TOKENS_PER_IMAGE = 16  # (64 / 8)^2 patches, average-pooled 2 x 2
ONE = "What is in the picture? <start_of_image>"  # the tests' prompts: one image, two
TWO = "<start_of_image> and <start_of_image> Which is red?"
# Gemma 3's template, reduced: a message's parts in order, each image a <start_of_image>
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'model: ' }}{% endif %}"
)

# Gemma 3 4B's tower (1152 wide, 16 heads of 72, 896-pixel images in 14-pixel patches pooled 4 x 4
# into 256 tokens) and attention heads (8 of 256 dims, 4 KV heads) but 2 layers each, narrower
# MLPs, and a sliding window of 128 (shorter than an image) on the first layer: the -m gpu test's
SMALL = {"vision": dict(hidden_size=1152, intermediate_size=1024, num_attention_heads=16, image_size=896,
                        patch_size=14),
         "text": dict(hidden_size=2560, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, sliding_window=128,
                      layer_types=["sliding_attention", "full_attention"], max_position_embeddings=2048),
         "tokens": 256, "std": 0.02}


def save_tiny_gemma3(tokenizer_dir: Path, out: Path, shape: dict | None = None) -> Path:
    """The model directory, as transformers writes it (model, processor, tokenizer, template);
    `shape` overrides the tiny sizes ("vision", "text": config keys; "tokens": mm_tokens_per_image)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=IMAGE_TOKENS)
    shape = shape or {}
    vision = transformers.SiglipVisionConfig(**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=2, image_size=64, patch_size=8,
                                                    vision_use_head=False) | shape.get("vision", {}))
    text = transformers.Gemma3TextConfig(**dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id) | shape.get("text", {}))
    tokens = shape.get("tokens", TOKENS_PER_IMAGE)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                                       image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                                       eoi_token_index=tok.eoi_token_id)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # transformers' init leaves the tiny model's logits nearly flat: spread them
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1 if name.endswith("norm.weight") else shape.get("std", 0.05))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    images = transformers.Gemma3ImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=tokens,
                                 chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    return out


def with_processor_settings(model_dir: Path, out: Path, part: str | None, change: dict) -> Path:
    """A copy of the model directory whose processor_config.json (as transformers 5 writes it:
    the image processor's settings inside, under "image_processor") has `change` in `part`
    (None: at its top)."""
    other = shutil.copytree(model_dir, out)
    settings = json.loads((other / "processor_config.json").read_text())
    (settings[part] if part else settings).update(change)
    (other / "processor_config.json").write_text(json.dumps(settings))
    return other


def hf_inputs(model_dir: Path, text: str, images: list, **kwargs) -> dict:
    """transformers' model inputs (token_type_ids too: the bidirectional image mask's);
    `kwargs` go to the processor (do_pan_and_scan)."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(str(model_dir), backend="pil")
    return dict(processor(text=[text], images=images, return_tensors="pt", **kwargs))


def load_hf(model_dir: Path):
    """transformers' model of a tiny checkpoint, float32, for the references."""
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()

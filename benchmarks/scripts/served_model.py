"""Model directories for `ember serve` and `vllm serve` on the GPU, weights drawn with
--load-format dummy, a real tokenizer and chat template so the servers answer through their
real tokenizer and template paths. The device has no hub and no GGUF reader, so this runs
here, on the default model's GGUF (SmolLM2's tokenizer; transformers converts it, as HF repos
hold it), and the directory is carried (h200.sh serve, serve-race, race-vl):

    python3 benchmarks/scripts/served_model.py .serve-model            # text: the Llama-3.1-8B shape
    python3 benchmarks/scripts/served_model.py --vl .serve-vl          # Qwen2.5-VL-7B
    python3 benchmarks/scripts/served_model.py --vl --tiny DIR         # the same files, tiny sizes (CPU)

Text: the vocabulary is SmolLM2's 49,152 (the 8B's other shapes stay), so every id the model
can emit is one the tokenizer decodes.

--vl: Qwen/Qwen2.5-VL-7B-Instruct's config.json and preprocessor_config.json as the hub holds
them (benchmarks/configs/qwen2.5-vl-7b; transformers' Qwen2_5_VLConfig defaults are the 72B's
text sizes, so they are not the source), Qwen2.5-VL's chat template, and a tokenizer that
keeps the config's ids: SmolLM2's BPE vocabulary padded to 151,643 entries (ids 49,152 and up
are filler pieces no merge makes, each decoding to its own text), Qwen2's 22 special tokens
at their real ids 151,643-151,664 (<|endoftext|>, <|im_start|>, <|im_end|>, ...,
<|vision_start|> 151,652, <|image_pad|> 151,655, ...; SmolLM2's own special tokens plain
pieces, the three of Qwen's names renamed), then plain added tokens up to the config's vocab_size 152,064: every
id the model can emit decodes to non-empty text, so a streamed token is a streamed chunk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import transformers

from ember.loader.default_model import fetch_default_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG = CONFIGS / "llama-3.1-8b" / "config.json"
VL_CONFIGS = CONFIGS / "qwen2.5-vl-7b"  # config.json, preprocessor_config.json
# Qwen2's special tokens in id order from 151,643 (Qwen2.5-VL-7B-Instruct's tokenizer_config.json)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                 "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN_FIRST_SPECIAL = 151643
# Qwen2.5-VL-7B-Instruct's chat template (chat_template.json): a system turn when none is given,
# each image <|vision_start|><|image_pad|><|vision_end|> where its part stands
VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# --tiny: the 7B's files at sizes a CPU serves in seconds (M-RoPE sections of a 16-dim head; two
# tower blocks, the second of full attention)
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_window_layers=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                   fullatt_block_indexes=[1])


def _smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    gguf = fetch_default_model()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def write_served_model(out: Path) -> None:
    tok = _smollm2_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config = json.loads(CONFIG.read_text())
    config.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def qwen_vl_tokenizer_json(smollm2: dict, vocab_size: int) -> dict:
    """SmolLM2's tokenizer.json made to hold Qwen2's ids: the BPE vocabulary padded to
    QWEN_FIRST_SPECIAL, QWEN_SPECIALS after it, plain added tokens up to `vocab_size`."""
    model = smollm2["model"]
    vocab: dict[str, int] = model["vocab"]
    renamed = {t: f"<|smollm2_{t.strip('<|>')}|>" for t in QWEN_SPECIALS if t in vocab}
    for old, new in renamed.items():
        vocab[new] = vocab.pop(old)
    added = []  # SmolLM2's 17 special tokens stay plain pieces of the vocabulary
    filler = {f"<f{i}>": i for i in range(len(vocab), QWEN_FIRST_SPECIAL)}
    if filler.keys() & vocab.keys():
        raise ValueError("a filler piece is already in SmolLM2's vocabulary")
    vocab.update(filler)
    assert len(vocab) == QWEN_FIRST_SPECIAL and sorted(vocab.values()) == list(range(QWEN_FIRST_SPECIAL))
    plain = [f"<|extra_{i}|>" for i in range(QWEN_FIRST_SPECIAL + len(QWEN_SPECIALS), vocab_size)]
    for i, content in enumerate(QWEN_SPECIALS + plain):
        added.append({"id": QWEN_FIRST_SPECIAL + i, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": content in QWEN_SPECIALS})
    model["unk_token"] = None
    return smollm2 | {"added_tokens": added, "model": model}


def write_served_vl_model(out: Path, tiny: bool = False) -> None:
    """The Qwen2.5-VL-7B directory (module docstring); `tiny`: the same tokenizer, template and
    processor with TINY_TEXT / TINY_VISION sizes."""
    config = json.loads((VL_CONFIGS / "config.json").read_text())
    if tiny:
        config |= TINY_TEXT
        config["vision_config"] |= TINY_VISION | {"out_hidden_size": TINY_TEXT["hidden_size"]}
    with tempfile.TemporaryDirectory() as tmp:
        _smollm2_tokenizer().save_pretrained(tmp)
        smollm2 = json.loads((Path(tmp) / "tokenizer.json").read_text())
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(qwen_vl_tokenizer_json(smollm2, config["vocab_size"])))
        backend = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(tmp) / "tokenizer.json"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", chat_template=VL_CHAT_TEMPLATE)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                     "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"])
    names = ["bos_token_id", "eos_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id",
             "image_token_id", "video_token_id"]
    if ids != [config[n] for n in names] or len(tok) != config["vocab_size"]:
        raise ValueError(f"the tokenizer's ids {dict(zip(names, ids))} (of {len(tok)}) are not the config's")
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(VL_CONFIGS / "preprocessor_config.json", out / "preprocessor_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vl", action="store_true", help="Qwen2.5-VL-7B (see the module docstring)")
    ap.add_argument("--tiny", action="store_true", help="with --vl: tiny sizes for the CPU")
    args = ap.parse_args()
    if args.tiny and not args.vl:
        ap.error("--tiny goes with --vl")
    if args.vl:
        write_served_vl_model(args.out, args.tiny)
    else:
        write_served_model(args.out)


if __name__ == "__main__":
    main()

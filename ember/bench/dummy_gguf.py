"""A GGUF file of random blocks at a Llama-family model's shapes, for benchmarks of GGUF on a
GPU where no real file of that size is at hand: written by llama.cpp's gguf-py writer, in
llama.cpp's Q4_K_M type mix (or one type throughout), so ember loads it through its real GGUF
path. The values are random bytes but for the scales, which are set so a weight's values
spread about as --load-format dummy's do (standard deviation ~0.02): the decode arithmetic and
bytes are a real file's, the text is noise. RoPE scaling keys are left out (it costs the same).

    python -m ember.bench.dummy_gguf benchmarks/configs/llama-3.1-8b/config.json /tmp/llama-8b-q4_k_m.gguf

The vocabulary is byte-level BPE of the 256 byte symbols and filler tokens (end of text the
last id), with one merge: enough for ember's tokenizer to load.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

# the float16 scale fields of a block (byte offset), the value they take, and (Q4_1, Q5_1, K-quants
# with minimums) the minimum's: set so the values' spread is ~0.02 and their mean ~0
_SCALES: dict[str, tuple[int, float, int | None, float]] = {
    "Q4_0": (0, 4e-3, None, 0.0), "Q4_1": (0, 4e-3, 2, -0.03), "Q5_0": (0, 2e-3, None, 0.0),
    "Q5_1": (0, 2e-3, 2, -0.03), "Q8_0": (0, 2.7e-4, None, 0.0), "Q4_K": (0, 1e-4, 2, 7e-4),
    "Q5_K": (0, 5e-5, 2, 7e-4), "Q6_K": (208, 1.5e-5, None, 0.0),
}
RECIPES = ("Q4_K_M", *_SCALES)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers a _M mix gives more bits (attn_v, ffn_down)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, layers: int, recipe: str) -> str:
    """The type a weight takes: one type throughout, or llama.cpp's Q4_K_M mix (output in Q6_K;
    attn_v and ffn_down in Q6_K in the layers use_more_bits picks; the rest Q4_K)."""
    if recipe != "Q4_K_M":
        return recipe
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
        return "Q6_K"
    return "Q4_K"


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """Random blocks of `qtype` for a weight [rows, cols], the scales set (see _SCALES): uint8 [rows, row bytes]."""
    import gguf

    values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    d_at, d, m_at, m = _SCALES[qtype]
    spread = rng.uniform(0.5, 1.5, raw.shape[:2]).astype(np.float32)
    raw[..., d_at:d_at + 2] = (spread * d).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if m_at is not None:
        raw[..., m_at:m_at + 2] = np.full(raw.shape[:2], m, np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _weights(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, int]]]:
    """(GGUF name, [rows, cols]) of every 2-D weight of a Llama-family model."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    out = [("token_embd.weight", (cfg["vocab_size"], hidden))]
    for i in range(layers):
        out += [(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden)), (f"blk.{i}.attn_k.weight", (kv * head_dim, hidden)),
                (f"blk.{i}.attn_v.weight", (kv * head_dim, hidden)), (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim)),
                (f"blk.{i}.ffn_gate.weight", (inter, hidden)), (f"blk.{i}.ffn_up.weight", (inter, hidden)),
                (f"blk.{i}.ffn_down.weight", (hidden, inter))]
    if not cfg.get("tie_word_embeddings", False):
        out.append(("output.weight", (cfg["vocab_size"], hidden)))
    return out


def _vocabulary(writer: gguf.GGUFWriter, size: int) -> None:
    """Byte-level BPE: GPT-2's 256 byte symbols, "ĠĠ" (the one merge), filler tokens, end of text last."""
    symbols = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)] \
        + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
    symbols += [chr(256 + i) for i in range(256 - len(symbols))]  # GPT-2's stand-ins for the other bytes
    tokens = symbols + ["ĠĠ"]
    tokens += [f"<filler_{i}>" for i in range(size - len(tokens) - 1)] + ["<|end_of_text|>"]
    if len(tokens) != size:
        raise ValueError(f"a vocabulary of {size} tokens is too small for the 257 byte-level ones")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (size - 1) + [3])  # the end of text a control token
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(size - 1)
    writer.add_eos_token_id(size - 1)
    writer.add_add_bos_token(False)


def write_dummy_gguf(cfg: dict[str, Any], path: str | Path, recipe: str = "Q4_K_M", seed: int = 0) -> Path:
    """A Llama-family model config (config.json's keys) as a GGUF file of random blocks at `path`."""
    import gguf

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: one of {', '.join(RECIPES)}")
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"dummy {recipe}")
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    writer.add_key_length(cfg.get("head_dim") or hidden // heads)
    writer.add_value_length(cfg.get("head_dim") or hidden // heads)
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    _vocabulary(writer, cfg["vocab_size"])
    rng = np.random.default_rng(seed)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, (rows, cols) in _weights(cfg):
        qtype = tensor_type(name, layers, recipe)
        writer.add_tensor(name, random_blocks(rng, qtype, rows, cols), raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path, help="a Llama-family config.json")
    ap.add_argument("out", type=Path, help="the .gguf file to write")
    ap.add_argument("--recipe", default="Q4_K_M", choices=RECIPES)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    path = write_dummy_gguf(json.loads(ns.config.read_text()), ns.out, ns.recipe, ns.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {ns.recipe})")


if __name__ == "__main__":
    main()

"""Tiny random HF models converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (f32),
then loaded by ember from the GGUF file: the same tokens as from the HF directory, as HF
transformers, and as llama.cpp itself where its llama-server is built.

Four models: Llama with a SentencePiece tokenizer.model (trained here), Llama with
SmolLM2's byte-level BPE tokenizer, Mistral and Qwen2 (q/k/v bias, tied embeddings), both
with the SentencePiece tokenizer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.gguf import open_gguf
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import load_tokenizer
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.slow

BASE = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS = {
    "llama_spm": BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                         "rope_theta": 10000.0, "tie_word_embeddings": False},
    "mistral_spm": BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 512,
                           "rope_theta": 1e6, "tie_word_embeddings": False, "sliding_window": None},
    "llama_bpe": BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                         "rope_theta": 100000.0, "tie_word_embeddings": True},
    # SentencePiece, not SmolLM2's BPE: transformers 5 reads any model_type "qwen2" tokenizer as
    # Qwen2Tokenizer, which re-splits SmolLM2's vocabulary with Qwen's regex, and the converter
    # then cannot recognise it (it identifies BPE pre-tokenizers by hashing a tokenization).
    "qwen2_spm": BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
                         "rope_theta": 1e6, "tie_word_embeddings": True, "use_sliding_window": False},
}

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\n\nafter blank lines\r\n",
    "In 2024, 1,000,000 people paid $9.99.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    "I'm sure you'll see they've done it",
    "emoji 👋🏽 and family 👨‍👩‍👧‍👦",
    "你好，世界！日本語のテキスト",
    "e\u0301 n\u0303 (combining marks) and Å",
    "",
    " ",
    "\n",
]
SPM_SPECIAL_TEXTS = ["<s>a prompt</s>", "text</s>more<unk>text", "x <s>y", "<s><s>"]
BPE_SPECIAL_TEXTS = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more"]
PROMPTS = ["The quick brown fox", "def load(path):\n", "Numbers like 12 and 345"]


@dataclass
class Converted:
    name: str
    hf_dir: Path
    gguf: Path
    hf_tokenizer: object  # transformers' tokenizer from the HF directory
    tokenizer: Tokenizer  # ember's, from the GGUF file


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory, gguf_convert, spm_tokenizer_dir, bpe_tokenizer_dir) -> Converted:
    name = request.param
    config = VARIANTS[name]  # vocab_size: the tokenizer's (spm_tokenizer_dir trains 512 pieces)
    root = tmp_path_factory.mktemp(name)
    (root / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf_config(config)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=11)}, str(root / "model.safetensors"))
    tokenizer_dir = spm_tokenizer_dir if name.endswith("_spm") else bpe_tokenizer_dir
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, root / f.name)
    path = gguf_convert(root, "f32")
    hf_class = transformers.LlamaTokenizer if name.endswith("_spm") else transformers.AutoTokenizer
    return Converted(name, root, path, hf_class.from_pretrained(str(root)), load_tokenizer(path))


def test_the_converter_wrote_what_we_test(converted: Converted) -> None:
    f = open_gguf(converted.gguf)
    arch = {"qwen2_spm": "qwen2"}.get(converted.name, "llama")  # llama.cpp writes Mistral as llama
    assert f.architecture == arch
    assert f.metadata["tokenizer.ggml.model"] == ("llama" if converted.name.endswith("_spm") else "gpt2")
    if converted.name.endswith("_bpe"):
        assert f.metadata["tokenizer.ggml.pre"] == "smollm"  # recognised by its hash of a test text
    assert {f.tensor_info(n).qtype_name for n in f.tensor_names} == {"F32"}
    assert ("blk.0.attn_q.bias" in f.tensor_names) == (converted.name == "qwen2_spm")
    assert ("output.weight" in f.tensor_names) == (not VARIANTS[converted.name]["tie_word_embeddings"])


def test_tokenizer_ids_match_hf(converted: Converted) -> None:
    hf, tok = converted.hf_tokenizer, converted.tokenizer
    spm_vocab = converted.name.endswith("_spm")
    specials = SPM_SPECIAL_TEXTS if spm_vocab else BPE_SPECIAL_TEXTS
    for text in TEXTS + specials:
        if spm_vocab and text[:1].isspace():
            continue  # transformers differs there: next test
        assert tok.encode(text) == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids), text
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert tok.vocab_size == len(hf)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


def test_sentencepiece_vocabulary_matches_sentencepiece(converted: Converted, spm_tokenizer_dir: Path) -> None:
    """On plain text SentencePiece itself is the reference, and llama.cpp follows it: one "▁"
    in front of the text even where it starts with a space. transformers 5's LlamaTokenizer
    (a Metaspace pre-tokenizer) adds none there, at the start or after a special token."""
    if not converted.name.endswith("_spm"):
        pytest.skip("a SentencePiece vocabulary")
    sp = spm.SentencePieceProcessor(model_file=str(spm_tokenizer_dir / "tokenizer.model"))
    tok = converted.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == [1, *sp.encode(text)], text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    pieces = converted.hf_tokenizer.convert_ids_to_tokens
    assert tok.convert_ids_to_tokens(tok.encode(" one", add_special_tokens=False)) == ["▁▁", "o", "ne"]
    assert pieces(converted.hf_tokenizer.encode(" one", add_special_tokens=False)) == ["▁one"]
    # after a special token llama.cpp starts the text afresh: "▁" + " a"
    assert tok.convert_ids_to_tokens(tok.encode("a</s> a", add_special_tokens=False)) == ["▁a", "</s>", "▁", "▁a"]
    assert pieces(converted.hf_tokenizer.encode("a</s> a", add_special_tokens=False)) == ["▁a", "</s>", "▁a"]


def test_tokenizer_matches_llama_cpp(converted: Converted, llama_tokenize) -> None:
    """llama.cpp's own tokenizer on the same file: leading spaces and text after special
    tokens included, where transformers differs."""
    specials = SPM_SPECIAL_TEXTS + ["a</s> a", "text </s> more <unk> text"] if converted.name.endswith("_spm") \
        else BPE_SPECIAL_TEXTS
    for text in TEXTS + specials:
        assert converted.tokenizer.encode(text) == llama_tokenize(converted.gguf, text), text
        assert converted.tokenizer.encode(text, add_special_tokens=False) == llama_tokenize(
            converted.gguf, text, add_special=False), text


@pytest.fixture(scope="module")
def engines(converted: Converted):
    kw = dict(num_kv_blocks=16, block_size=8, max_model_len=256, dtype="float32")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(converted.hf_dir), dtype=torch.float32).eval()
    return LLM(str(converted.gguf), **kw), LLM(str(converted.hf_dir), **kw), hf_model


def test_greedy_matches_hf_dir_and_transformers(converted: Converted, engines) -> None:
    from_gguf, from_dir, hf_model = engines
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours, theirs = from_gguf.generate(PROMPTS, params), from_dir.generate(PROMPTS, params)
    for prompt, a, b in zip(PROMPTS, ours, theirs):
        ids = converted.hf_tokenizer.encode(prompt)
        assert a.prompt_token_ids == b.prompt_token_ids == ids
        assert len(a.outputs[0].token_ids) == 32
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert a.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_greedy_matches_llama_cpp(converted: Converted, engines, llama_greedy) -> None:
    """llama.cpp's own greedy tokens on the same file, from the same prompt ids; both stop at
    one of the same end-of-generation tokens (included) or after 32 tokens. (llama.cpp's
    ignore_eos would bias those tokens away, not only go on past them.)"""
    from_gguf = engines[0]
    ours = from_gguf.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    theirs = llama_greedy(converted.gguf, [list(o.prompt_token_ids) for o in ours], 32, ctx=256)
    assert theirs.end_of_generation == converted.tokenizer.eos_token_ids
    assert [list(o.outputs[0].token_ids) for o in ours] == theirs.tokens
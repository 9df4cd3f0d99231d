"""ember.loader.gguf_tokenizer on small hand-made vocabularies: SentencePiece merges by score,
byte fallback, the space prefix and BOS/EOS defaults (exact ids); every BPE pre-tokenizer
name llama.cpp knows (each builds, round-trips text, and the common ones split as
llama.cpp's regexes say); llama.cpp's own tokenizer where its binary has been built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from tokenizers import pre_tokenizers

from ember.loader.gguf_tokenizer import BPE_PRE_TOKENIZERS, bpe_pre_tokenizer, bpe_split, tokenizer_from_metadata
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import load_tokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# A SentencePiece vocabulary: (piece, score, type). Merges come from the scores of the
# merged pieces: "▁a" (-1) before "ab" (-2) before "▁ab" (-3) before "▁▁" (-4).
SPM_VOCAB = [
    ("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL),
    ("<0x0A>", 0.0, BYTE), ("<0xC3>", 0.0, BYTE), ("<0xA9>", 0.0, BYTE),
    ("▁", -10.0, NORMAL), ("a", -10.0, NORMAL), ("b", -10.0, NORMAL),
    ("▁a", -1.0, NORMAL), ("ab", -2.0, NORMAL), ("▁ab", -3.0, NORMAL), ("<think>", 0.0, USER_DEFINED),
    ("▁▁", -4.0, NORMAL),
]


def spm_metadata(**keys: Any) -> dict[str, Any]:
    pieces, scores, types = zip(*SPM_VOCAB)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": list(pieces),
            "tokenizer.ggml.scores": list(scores), "tokenizer.ggml.token_type": list(types)} | {
        f"tokenizer.ggml.{k}": v for k, v in keys.items()}


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    """As llama.cpp's converter writes it; no add_bos_token/BOS keys: llama.cpp's defaults."""
    return tokenizer_from_metadata(spm_metadata(eos_token_id=2))


@pytest.mark.parametrize("text, pieces", [
    ("ab", ["<s>", "▁ab"]),  # ▁ a b -> ▁a b -> ▁ab
    ("ba", ["<s>", "▁", "b", "a"]),  # no merge applies
    (" ab", ["<s>", "▁", "▁ab"]),  # "▁" put in front even of a space, as SentencePiece does
    ("é\n", ["<s>", "▁", "<0xC3>", "<0xA9>", "<0x0A>"]),  # bytes not in the vocabulary
    ("x", ["<s>", "▁", "<unk>"]),  # no <0x78> token either
    ("a<think>b", ["<s>", "▁a", "<think>", "▁", "b"]),  # matched whole; the text after it starts afresh
    ("ab</s>ab", ["<s>", "▁ab", "</s>", "▁ab"]),
    ("", ["<s>"]),
])
def test_sentencepiece_pieces(spm: Tokenizer, text: str, pieces: list[str]) -> None:
    assert spm.convert_ids_to_tokens(spm.encode(text)) == pieces


def test_sentencepiece_ids_and_decoding(spm: Tokenizer) -> None:
    assert spm.encode("ab") == [1, 11]
    assert spm.encode("ab", add_special_tokens=False) == [11]
    assert (spm.bos_token_id, spm.eos_token_id, spm.vocab_size) == (1, 2, len(SPM_VOCAB))
    assert spm.all_special_ids == [0, 1, 2]  # unknown and control
    for text in ["ab", " ab", "ba ab", "é\n"]:
        assert spm.decode(spm.encode(text), skip_special_tokens=True) == text
    assert spm.decode(spm.encode("a<think>b")) == "<s> a<think> b"  # the "▁" put in after a token shows
    assert spm.decode([1, 6, 11]) == "<s>  ab"
    assert spm.decode([6, 11]) == " ab"  # the added "▁" is taken off again


def test_sentencepiece_keys() -> None:
    no_prefix = tokenizer_from_metadata(spm_metadata(add_space_prefix=False, add_bos_token=False))
    assert no_prefix.convert_ids_to_tokens(no_prefix.encode("ab ab")) == ["ab", "▁ab"]
    assert no_prefix.decode(no_prefix.encode("ab ab")) == "ab ab"
    eos = tokenizer_from_metadata(spm_metadata(bos_token_id=1, eos_token_id=2, add_eos_token=True))
    assert eos.encode("ab") == [1, 11, 2]
    with pytest.raises(ValueError, match="14 tokens but 13 scores"):
        tokenizer_from_metadata(spm_metadata() | {"tokenizer.ggml.scores": [0.0] * 13})
    with pytest.raises(ValueError, match="eos_token_id = 99 is outside the vocabulary"):
        tokenizer_from_metadata(spm_metadata(eos_token_id=99))


# -- end of generation: llama.cpp's special_eog_ids ------------------------------------------


def chat_metadata(added: list[str], **keys: Any) -> dict[str, Any]:
    """SPM_VOCAB with a chat format's control tokens after it (ids 14, 15, ...)."""
    md = spm_metadata(**keys)
    for key, values in (("tokens", added), ("scores", [0.0] * len(added)), ("token_type", [CONTROL] * len(added))):
        md[f"tokenizer.ggml.{key}"] = md[f"tokenizer.ggml.{key}"] + values
    return md


@pytest.mark.parametrize("added, keys, ids", [
    # Gemma: <eos> the EOS, a turn ends with <end_of_turn>; </s> (2) is one of llama.cpp's texts too
    (["<eos>", "<start_of_turn>", "<end_of_turn>"], {"eos_token_id": 14}, {2, 14, 16}),
    # Phi-3: <|endoftext|> the EOS, <|end|> ends a turn
    (["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>"], {"eos_token_id": 14}, {2, 14, 16}),
    # Llama 3: <|end_of_text|> the EOS (a base model's), <|eot_id|> and <|eom_id|>
    (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"], {"eos_token_id": 15}, {2, 15, 16, 17}),
    # ChatML (Qwen): <|im_end|>, and the FIM pad, repo and file-separator tokens
    (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_pad|>", "<|repo_name|>",
      "<|file_sep|>"], {"eos_token_id": 14}, {2, 14, 16, 18, 19, 20}),
    # a token the file names by key ends generation, whatever its text; a FIM key replaces
    # the search by text for its kind
    (["<turn>", "<done>", "<|fim_pad|>", "<my_pad>"], {"eos_token_id": 2, "eot_token_id": 15, "fim_pad_token_id": 17},
     {2, 15, 17}),
    # gpt-oss: <|end|> ends a message, not the turn, where <|return|> and <|call|> are there
    (["<|return|>", "<|call|>", "<|end|>", "<|endoftext|>"], {"eos_token_id": 14}, {2, 14, 15, 17}),
    # Gemma 4: </s> is a normal token beside <|tool_response>
    (["<eos>", "<|tool_response>", "<turn|>"], {"eos_token_id": 14}, {14, 15, 16}),
])
def test_end_of_generation_ids_are_llama_cpps(added: list[str], keys: dict[str, int], ids: set[int]) -> None:
    tok = tokenizer_from_metadata(chat_metadata(added, **keys))
    assert tok.eos_token_ids == frozenset(ids)
    assert tok.eos_token_id == keys["eos_token_id"]


def test_end_of_generation_keys_from_a_file(tmp_path: Path) -> None:
    """The keys as gguf-py writes them into a vocabulary-only file."""
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    md = chat_metadata(["<a>", "<b>", "<c>"])
    w.add_tokenizer_model("llama")
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_scores(md["tokenizer.ggml.scores"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_eos_token_id(2)
    w.add_eot_token_id(14)
    w.add_eom_token_id(15)
    w.add_uint32("tokenizer.ggml.fim_sep_token_id", 16)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    assert load_tokenizer(tmp_path / "vocab.gguf").eos_token_ids == frozenset({2, 14, 15, 16})


def test_end_of_generation_key_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"tokenizer.ggml.eot_token_id = 40 is outside the vocabulary \(15 tokens\)"):
        tokenizer_from_metadata(chat_metadata(["<|eot_id|>"], eot_token_id=40))


def test_sentencepiece_from_a_file(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    pieces, scores, types = zip(*SPM_VOCAB)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(pieces))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    tok = load_tokenizer(tmp_path / "spm.gguf")
    assert tok.encode(" ab") == [1, 6, 11]


# -- byte-level BPE: the pre-tokenizer table ---------------------------------------------------

BYTE_ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())


def bpe_metadata(pre: str, extra: list[str] = (), **keys: Any) -> dict[str, Any]:
    """The 256 byte symbols (ids 0-255), `extra` tokens from 256, then "ĠĠ" (the one merge),
    <|begin|> (BOS) and <|end|> (EOS), both control tokens."""
    tokens = [*BYTE_ALPHABET, *extra, "ĠĠ", "<|begin|>", "<|end|>"]
    n = len(tokens)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * (n - 2) + [CONTROL, CONTROL],
            "tokenizer.ggml.merges": ["Ġ Ġ"], "tokenizer.ggml.bos_token_id": n - 2,
            "tokenizer.ggml.eos_token_id": n - 1} | {f"tokenizer.ggml.{k}": v for k, v in keys.items()}


ROUND_TRIP = ("Hello WORLD, I'm 12345 okay?!  你好 x\n\n\tcafé 👋🏽 ‘quotes’ 3.14 <sentinel:7> IMGIMGABZ "
              "e\u0301 Ὗ ΐ 1,000,000 don't<|end|>")


@pytest.mark.parametrize("pre", sorted(BPE_PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(pre: str) -> None:
    tok = tokenizer_from_metadata(bpe_metadata(pre))
    ids = tok.encode(ROUND_TRIP, add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id  # the control token is matched whole
    assert tok.decode(ids) == ROUND_TRIP


def pieces(pre: str, text: str) -> list[str]:
    """The text's pieces after the regexes (GPT-2's byte symbols mapped back to text)."""
    split = bpe_pre_tokenizer(bpe_split(pre))
    to_text = {c: b for b, c in zip(range(256), [chr(c) for c in _gpt2_byte_chars()])}
    return [bytes(to_text[c] for c in p).decode("utf-8") for p, _ in split.pre_tokenize_str(text)]


def _gpt2_byte_chars() -> list[int]:
    """GPT-2's byte -> printable character map, as a list indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(b)
        else:
            chars.append(256 + extra)
            extra += 1
    return chars


TEXT = "Hello WORLD, I'm 12345 okay?!  你好 x\n\n"
SPLITS = {
    # the punctuation run first, then GPT-2's regex, then digits: "'" and "m" apart
    "default": ["Hello", " WORLD", ",", " I", "'", "m", " ", "123", "45", " okay", "?!", " ", " 你好", " x", "\n\n"],
    "llama-bpe": ["Hello", " WORLD", ",", " I", "'m", " ", "123", "45", " okay", "?!", " ", " 你好", " x", "\n\n"],
    "qwen2": ["Hello", " WORLD", ",", " I", "'m", " ", "1", "2", "3", "4", "5", " okay", "?!", " ", " 你好", " x", "\n\n"],
    "smollm": ["Hello", " WORLD", ",", " I", "'m", " ", "1", "2", "3", "4", "5", " okay", "?!", " ", " 你好", " x",
               "\n\n"],
    "gpt-2": ["Hello", " WORLD", ",", " I", "'m", " 12345", " okay", "?!", " ", " 你好", " x", "\n\n"],
    "deepseek-llm": ["Hello", " WORLD", ",", " I", "'", "m", " ", "12345", " okay", "?!", "  ", "你好", " x", "\n", "\n"],
    "deepseek-coder": ["Hello", " WORLD", ",", " I", "'", "m", " ", "1", "2", "3", "4", "5", " okay", "?!", " ", " ",
                       "你好", " x", "\n", "\n"],
    "deepseek-v3": ["Hello", " WORLD", ",", " I", "'m", " ", "123", "45", " okay", "?!", "  ", "你好", " x", "\n\n"],
    "gpt-4o": ["Hello", " WORLD", ",", " I'm", " ", "123", "45", " okay", "?!", " ", " 你好", " x", "\n\n"],
    "superbpe": ["Hello WORLD, I'm ", "12", "345", " okay?!  你好 x\n\n"],  # digit groups of three from the right
    "kimi-k2": ["Hello", " WORLD", ",", " I'm", " ", "123", "45", " okay", "?!", " ", " ", "你好", " x", "\n\n"],
    "bloom": ["Hello", " WORLD", ",", " I'm", " 12345", " okay", "?! ", " 你好", " x", "\n\n"],
    "chameleon": ["Hello", " WORLD", ",", " I", "'", "m", " ", "1", "2", "3", "4", "5", " okay", "?", "!", "  ", "你好",
                  " x", "\n", "\n"],
}


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_splits(pre: str) -> None:
    assert pieces(pre, TEXT) == SPLITS[pre]


def test_cased_words() -> None:
    """GPT-4o and Tekken cut words at a capital, non-ASCII letters included (llama.cpp's own
    rewrite of these regexes treats é as a capital: it keeps tokenizer.json's here)."""
    assert pieces("gpt-4o", "HelloWorld camelCase ÉcoleNormale élan") == [
        "Hello", "World", " camel", "Case", " École", "Normale", " élan"]
    assert pieces("tekken", "HelloWorld 42") == ["Hello", "World", " ", "4", "2"]


def test_llama3_looks_whole_words_up() -> None:
    """llama-bpe ignores merges for a piece that is itself a token (llama.cpp's ignore_merges);
    qwen2 builds it from merges only, so without merges for it the letters stay apart.
    llama-bpe also adds BOS where the file does not say."""
    extra = ["hello", "Ġhello"]
    llama3 = tokenizer_from_metadata(bpe_metadata("llama-bpe", extra))
    qwen2 = tokenizer_from_metadata(bpe_metadata("qwen2", extra))
    assert llama3.convert_ids_to_tokens(llama3.encode("hello hello")) == ["<|begin|>", "hello", "Ġhello"]
    assert qwen2.convert_ids_to_tokens(qwen2.encode("hello hello")) == [
        "h", "e", "l", "l", "o", "Ġ", "h", "e", "l", "l", "o"]
    assert llama3.encode("hello") == [259, 256]  # add_bos_token absent: llama.cpp adds BOS for llama-bpe
    explicit = tokenizer_from_metadata(bpe_metadata("llama-bpe", extra, add_bos_token=False))
    assert explicit.encode("hello") == [256]


def test_chatglm_has_no_bos() -> None:
    tok = tokenizer_from_metadata(bpe_metadata("chatglm-bpe", add_bos_token=True))
    assert tok.bos_token_id is None
    assert tok.encode("ab") == tok.encode("ab", add_special_tokens=False) == [64, 65]


def test_missing_pre_is_llama_cpp_default(caplog: pytest.LogCaptureFixture) -> None:
    meta = bpe_metadata("default")
    del meta["tokenizer.ggml.pre"]
    tok = tokenizer_from_metadata(meta, source="old.gguf")
    assert "old.gguf has no tokenizer.ggml.pre" in caplog.text
    assert tok.decode(tok.encode("I'm 12345")) == "I'm 12345"


@pytest.mark.parametrize("pre, message", [
    ("nope", r"GGUF: tokenizer.ggml.pre = 'nope' is not a pre-tokenizer llama.cpp knows .*Convert the model again"),
    ("gemma4", r"'gemma4' is SentencePiece-style BPE .* HF directory"),
    ("jina-v2-code", r"'jina-v2-code' is an embedding model's vocabulary"),
])
def test_pre_tokenizers_ember_refuses(pre: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer_from_metadata(bpe_metadata(pre))


def test_other_vocabulary_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model = 't5' is not supported; supported: 'llama'"):
        tokenizer_from_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
        tokenizer_from_metadata(bpe_metadata("qwen2") | {"tokenizer.ggml.merges": []})
    with pytest.raises(ValueError, match="merges holds 'ĠĠ', which is not 'left right'"):
        tokenizer_from_metadata(bpe_metadata("qwen2") | {"tokenizer.ggml.merges": ["ĠĠ"]})
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens is missing"):
        tokenizer_from_metadata({"tokenizer.ggml.model": "llama"})


# -- against llama.cpp's own tokenizer ----------------------------------------------------------

CROSS_TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "  two leading spaces", "trailing spaces   ",
    "multiple   spaces\tand\ttabs", "line one\nline two\n\n\nafter blank lines\r\n", "In 2024, 1,000,000 people paid $9.99.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n", "I'm sure you'll see they've done it, I'M SURE",
    "emoji 👋🏽 and family 👨‍👩‍👧‍👦", "你好，世界！日本語のテキスト 한국어", "e\u0301 n\u0303 (combining marks) and Å",
    "HelloWorld camelCase ÉcoleNormale élan", TEXT, "<sentinel:7> IMGIMGABZ 1234567", "Ὗ ΐ café naïve", " ", "\n",
    "a\u00a0b\u2009c",
]


@pytest.fixture(scope="module")
def small_real_bpe() -> dict[str, Any]:
    """A byte-level BPE vocabulary that shows how text was split: SmolLM2's first 3,000 merges,
    plus merges across the places the regexes differ on (digit runs, "'m", "?!", blank lines,
    runs of spaces, CJK)."""
    from ember.loader.default_model import fetch_default_model
    from ember.loader.gguf import open_gguf

    merges = open_gguf(fetch_default_model()).metadata["tokenizer.ggml.merges"][:3000]
    merges += ["1 2", "12 3", "4 5", "' m", "? !", "Ċ Ċ", "ĠĠ Ġ", "ä½ ł", "å¥ ½", "Ġ 1"]
    tokens = dict.fromkeys(BYTE_ALPHABET)  # an ordered set
    for m in merges:
        left, right = m.split(" ")
        tokens |= dict.fromkeys([left, right, left + right])
    return {"tokens": list(tokens), "merges": merges}


def _write_vocab_only_gguf(path: Path, pre: str, tokens: list[str], merges: list[str]) -> Path:
    """A GGUF llama.cpp loads for its vocabulary alone (the hyperparameters it reads first)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_context_length, 64), (w.add_embedding_length, 64), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 4), (w.add_head_count_kv, 4),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, 16)]:
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([*tokens, "<|begin|>", "<|end|>"])
    w.add_token_types([NORMAL] * len(tokens) + [CONTROL, CONTROL])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens))
    w.add_eos_token_id(len(tokens) + 1)
    w.add_add_bos_token(False)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("pre", sorted(BPE_PRE_TOKENIZERS))
def test_pre_tokenizer_matches_llama_cpp(pre: str, llama_tokenize, small_real_bpe: dict[str, Any],
                                         tmp_path: Path) -> None:
    path = _write_vocab_only_gguf(tmp_path / f"{pre}.gguf", pre, small_real_bpe["tokens"], small_real_bpe["merges"])
    tok = load_tokenizer(path)
    joined = "<|end|>".join(CROSS_TEXTS)  # a control token: each text is tokenized on its own
    assert tok.encode(joined) == llama_tokenize(path, joined)

"""The tokenizer of a GGUF file, built from llama.cpp's `tokenizer.ggml.*` metadata.

`tokenizer.ggml.model` names the vocabulary kind:

- "llama": SentencePiece (Llama 2, Mistral, Gemma, Phi-3). Tokens, scores and token types;
  built with transformers' recipe for Llama's fast tokenizer (the legacy one): BPE whose
  merges are ranked by the score of the merged piece, byte fallback to the `<0xNN>`
  tokens, spaces written as "▁", and one "▁" put in front of every stretch of text between
  special tokens where `tokenizer.ggml.add_space_prefix` says so. That is llama.cpp's rule,
  and SentencePiece's on plain text; transformers 5's LlamaTokenizer differs where a
  stretch starts with a space (it adds no "▁" there).
- "gpt2": byte-level BPE (Llama 3, Qwen, SmolLM, DeepSeek, ...). Tokens and merges; the
  text is first cut into pieces by the regexes llama.cpp applies for the file's
  `tokenizer.ggml.pre` (each regex in turn, on every piece the one before left), then
  mapped to GPT-2's byte alphabet.

Control and user-defined tokens are matched whole in the text (only control ones, and
SentencePiece's unknown token, count as special); BOS/EOS are added where
`tokenizer.ggml.add_bos_token`/`add_eos_token` say, with llama.cpp's defaults where a file
has no such key.

    tok = tokenizer_from_gguf("model.gguf")
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers

from ember.loader.tokenizer import Tokenizer, bos_eos_processor

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class BpeSplit:
    """How llama.cpp prepares text for byte-level BPE, for one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]  # applied in turn; each cuts every piece the ones before left
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry becomes that token
    add_bos: bool = False  # llama.cpp's default where the file has no add_bos_token key
    has_bos: bool = True  # False: the vocabulary has no BOS token (ChatGLM)


# The regexes are llama.cpp's (src/llama-vocab.cpp). Where llama.cpp rewrote a model's
# tokenizer.json regex for its own regex engine and says so, the original is used, since
# that is the split the model was trained with: Tekken and GPT-4o (llama.cpp approximates
# "upper/lower case letter" with "letter that is not a-z / A-Z"), Kimi-K2, AFMoE and
# Tiny Aya's digit groups (custom C++ in llama.cpp; AFMoE's rule written here as a regex).
# tests/loader/test_gguf_tokenizer.py checks every name against llama.cpp's own tokenizer.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CASED_WORDS = (  # a word: capitals then lower-case letters, or a run of capitals
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_GPT4O = (_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = _CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII characters are written as escapes: an editor's Unicode normalization would
# silently change some of them (U+1F7D becomes U+03CE, turning a range around).
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_LATIN_LIKE_LETTERS = (  # DeepSeek LLM's letter class, from its tokenizer.json
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_NOT_PUNCT_WORDS = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # Bloom, Poro, GPT3-Finnish, Viking
_KIMI_K2 = (  # llama.cpp's custom C++ for Kimi-K2, from the comment above it
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_TRIPLES = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"  # 1234567 -> 1 234 567 (AFMoE)

_DEFAULT = BpeSplit((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_LLAMA3_LIKE = BpeSplit((_LLAMA3,), ignore_merges=True, add_bos=True)
_DIGITS_THEN_GPT2 = BpeSplit((r"\p{N}", _GPT2))
_GPT2_SPLIT = BpeSplit((_GPT2,))
_QWEN2_SPLIT = BpeSplit((_QWEN2,))
_DEEPSEEK3 = BpeSplit((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_WORDS))
_GPT4O_SPLIT = BpeSplit((_GPT4O,))


def _names(names: str, split: BpeSplit) -> dict[str, BpeSplit]:
    return dict.fromkeys(names.split(), split)


# Every `tokenizer.ggml.pre` value llama.cpp (llama-cpp-python 0.3.36) accepts for a
# byte-level BPE vocabulary, grouped as llama.cpp groups them.
BPE_PRE_TOKENIZERS: dict[str, BpeSplit] = {
    **_names("default", _DEFAULT),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", _LLAMA3_LIKE),
    **_names("dbrx smaug-bpe", BpeSplit((_LLAMA3,))),
    **_names("jais-2", BpeSplit((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
        r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",))),
    **_names("deepseek-llm", BpeSplit((
        r"[\r\n]", r"\s?[" + _LATIN_LIKE_LETTERS + "]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$",
        _CJK_HANGUL, r"\p{N}+"))),
    **_names("deepseek-coder", BpeSplit((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _DEEPSEEK3),
    **_names("spark2_5", BpeSplit((
        r"\p{N}{1,3}", _CJK_KANA,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}"))),
    **_names("youtu", BpeSplit((
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f"
        "\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
        _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
        + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
    **_names("falcon", BpeSplit((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", _DIGITS_THEN_GPT2),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 "
             "mpt olmo jais trillion granite-docling", _GPT2_SPLIT),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", _QWEN2_SPLIT),
    **_names("qwen35", BpeSplit((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",))),
    **_names("poro-chat bloom gpt3-finnish", BpeSplit((_NOT_PUNCT_WORDS,))),
    **_names("viking", BpeSplit((_NOT_PUNCT_WORDS, r"\p{N}"))),
    **_names("chatglm-bpe", BpeSplit((_LLAMA3,), has_bos=False)),
    **_names("glm4 glm5", BpeSplit((_LLAMA3,), ignore_merges=True, has_bos=False)),
    **_names("tekken", BpeSplit((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_names("chameleon", BpeSplit((
        r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]", _GPT2), add_bos=True)),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O_SPLIT),
    **_names("granite-embed-multi-97m", BpeSplit((
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS + "?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS + "?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True)),
    **_names("tiny_aya cohere2moe", BpeSplit((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O))),
    **_names("minicpm5", BpeSplit((
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        ignore_merges=True)),
    **_names("kimi-k2", BpeSplit((_KIMI_K2,))),
    **_names("superbpe", BpeSplit((r"\p{N}+", r"(?=(\d{3})+(?!\d))"))),
    **_names("bailingmoe bailingmoe2 llada-moe", BpeSplit((
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
    **_names("seed-coder", BpeSplit((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    **_names("ufakzeka", BpeSplit((
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    **_names("afmoe", BpeSplit((
        _DIGIT_TRIPLES,
        # CJK, kana, Thai, Lao, Khmer, Myanmar, Hangul. "\u8c48-" as in llama.cpp's source (most
        # likely U+F900 turned into U+8C48 by Unicode normalization: a wider range)
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
        "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
        "\u1100-\u11ff]+",
        _DEEPSEEK3_WORDS))),
    **_names("laguna", BpeSplit((r"[^\n]+|[\n]+", _QWEN2))),
    **_names("exaone-moe", BpeSplit((
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",))),
}

# Names llama.cpp knows that ember refuses, with the reason.
_UNSUPPORTED_PRE = {
    **dict.fromkeys(
        ["jina-v1-en", "jina-v2-code", "roberta-bpe", "whitespace"],
        "an embedding model's vocabulary (llama.cpp appends a separator token or splits on "
        "whitespace only); ember runs generative models",
    ),
    **dict.fromkeys(
        ["gemma4", "granite-embed-multi-311m", "sarvam-moe"],
        "SentencePiece-style BPE on raw UTF-8 (spaces as '▁', <0xNN> byte tokens), which ember "
        "does not build yet",
    ),
}


def bpe_split(pre: str, source: str = "this file") -> BpeSplit:
    """The text splitting llama.cpp applies for `tokenizer.ggml.pre` = `pre`."""
    if pre in BPE_PRE_TOKENIZERS:
        return BPE_PRE_TOKENIZERS[pre]
    if pre in _UNSUPPORTED_PRE:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre = {pre!r} is {_UNSUPPORTED_PRE[pre]}. Load the model's HF "
            "directory (tokenizer.json) instead."
        )
    raise ValueError(
        f"{source}: tokenizer.ggml.pre = {pre!r} is not a pre-tokenizer llama.cpp knows (as of "
        "llama-cpp-python 0.3.36), so ember cannot tell how to split text before BPE. Convert the "
        "model again with a current convert_hf_to_gguf.py (it writes a name llama.cpp knows, such as "
        "'llama-bpe', 'qwen2' or 'smollm'), or load its HF directory instead."
    )


def bpe_pre_tokenizer(split: BpeSplit) -> pre_tokenizers.PreTokenizer:
    """The regexes in turn (each match its own piece, and so is the text between matches),
    then GPT-2's byte-to-unicode mapping."""
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in split.regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# -- loading --------------------------------------------------------------------------------


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata."""
    from ember.loader.gguf import open_gguf

    path = Path(path)
    meta = {k: v for k, v in open_gguf(path).metadata.items() if k.startswith("tokenizer.")}
    return tokenizer_from_metadata(meta, source=path.name)


def tokenizer_from_metadata(meta: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
    """The tokenizer described by `tokenizer.*` GGUF metadata (plain Python values)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if kind in ("llama", "gpt2") and not tokens:
        raise ValueError(f"{source}: tokenizer.ggml.tokens is missing or empty; the file has no vocabulary")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"{source}: {len(tokens)} tokens but {len(types)} token types; the file is corrupt, convert it again"
        )
    if kind == "llama":
        backend = _sentencepiece_backend(meta, tokens, types, source)
        add_bos_default, has_bos, bos_default, eos_default = True, True, 1, 2
    elif kind == "gpt2":
        split = bpe_split(meta.get("tokenizer.ggml.pre") or _missing_pre(source), source)
        backend = _byte_level_backend(meta, tokens, split, source)
        add_bos_default, has_bos, bos_default, eos_default = split.add_bos, split.has_bos, None, None
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model = {kind!r} is not supported; supported: 'llama' "
            "(SentencePiece) and 'gpt2' (byte-level BPE). Load the model's HF directory instead."
        )

    # Control (and unknown) tokens are special: matched in text, dropped by skip_special_tokens.
    # User-defined ones are matched in text too but are ordinary text otherwise.
    special = {_CONTROL, _UNKNOWN} if kind == "llama" else {_CONTROL}
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    )

    bos = meta.get("tokenizer.ggml.bos_token_id", bos_default) if has_bos else None
    eos = meta.get("tokenizer.ggml.eos_token_id", eos_default)
    _check_ids({"tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.eos_token_id": eos}, len(tokens), source)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = bos_eos_processor(
            (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
        )
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=end_of_generation_ids(meta, tokens, eos, source),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        vocab_size=len(tokens),
    )


# The tokens llama.cpp ends generation at wherever a vocabulary holds them (src/llama-vocab.cpp,
# special_eog_ids), known by their text: the end-of-turn and end-of-text markers of the chat
# formats it knows. Non-ASCII characters as escapes (DeepSeek's fullwidth bars and "▁").
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
# FIM tokens llama.cpp ends generation at too: the key's token, or where the file lacks the key
# the token with one of these texts (llama.cpp takes one of them where a vocabulary has several;
# ember takes each)
_FIM_EOG = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
_EOT_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def end_of_generation_ids(meta: Mapping[str, Any], tokens: list[str], eos: int | None,
                          source: str = "GGUF") -> frozenset[int]:
    """Every id llama.cpp ends generation at for this vocabulary: EOS; the end-of-turn and
    end-of-message ids of `tokenizer.ggml.eot_token_id` / `eom_token_id`; the FIM pad, repo
    and file-separator tokens; and each token whose text is one of _EOG_TEXTS (Gemma's
    <end_of_turn>, Phi-3's <|end|>, Llama 3's <|eot_id|>, ChatML's <|im_end|>, ...), though
    the file's EOS is another one."""
    keyed = {k: meta[k] for k in (*_EOT_KEYS, *_FIM_EOG) if k in meta}
    _check_ids(keyed, len(tokens), source)
    by_text = set(_EOG_TEXTS)
    for key, texts in _FIM_EOG.items():
        if key not in meta:
            by_text.update(texts)
    ids = {i for i, t in enumerate(tokens) if t in by_text} | set(keyed.values()) | ({eos} - {None})
    text = {i: tokens[i] for i in ids}.get
    present = {text(i) for i in ids}
    # llama.cpp's exceptions: gpt-oss and Solar Open end a message with <|end|> but continue
    # the turn; Gemma 4 and PLaMo have a <|tool_response>/<|plamo:eos|> and a normal </s>
    if "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present):
        ids = {i for i in ids if text(i) != "<|end|>"}
    if "</s>" in present and present & {"<|tool_response>", "<|plamo:eos|>"}:
        ids = {i for i in ids if text(i) != "</s>"}
    return frozenset(ids)


def _check_ids(ids: Mapping[str, int | None], vocab_size: int, source: str) -> None:
    for key, token_id in ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{source}: {key} = {token_id} is outside the vocabulary ({vocab_size} tokens); the file is "
                "corrupt, convert it again"
            )


def _missing_pre(source: str) -> str:
    logger.warning(
        "%s has no tokenizer.ggml.pre: splitting text as llama.cpp does then ('default'), which "
        "may not be how the model was trained; convert the model again with a current converter",
        source,
    )
    return "default"


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str], split: BpeSplit,
                        source: str) -> tokenizers.Tokenizer:
    raw_merges = meta.get("tokenizer.ggml.merges")
    if not raw_merges:
        raise ValueError(f"{source}: a 'gpt2' vocabulary needs tokenizer.ggml.merges, and the file has none")
    merges = []
    for m in raw_merges:
        cut = m.find(" ", 1)  # as llama.cpp: the first half is never empty
        if cut < 0:
            raise ValueError(f"{source}: tokenizer.ggml.merges holds {m!r}, which is not 'left right'")
        merges.append((m[:cut], m[cut + 1:]))
    model = tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=split.ignore_merges
    )
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = bpe_pre_tokenizer(split)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                           source: str) -> tokenizers.Tokenizer:
    scores: list[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ValueError(
            f"{source}: {len(tokens)} tokens but {len(scores)} scores; the file is corrupt, convert it again"
        )
    # llama.cpp (and SentencePiece) merge the adjacent pair whose joined piece scores highest;
    # as BPE merges: every split of a normal piece into two normal pieces, ranked by that score.
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _NORMAL}
    ranked = [
        (-scores[i], i, k, piece)
        for piece, i in normal.items()
        for k in range(1, len(piece))
        if piece[:k] in normal and piece[k:] in normal
    ]
    ranked.sort()
    merges = [(piece[:k], piece[k:]) for _, _, k, piece in ranked]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    model = tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        unk_token=tokens[unk_id] if 0 <= unk_id < len(tokens) else None,
        fuse_unk=True,
        byte_fallback=_BYTE in types,
    )
    backend = tokenizers.Tokenizer(model)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Prepend (unlike the Metaspace pre-tokenizer) adds "▁" even where the text starts with a
    # space, as SentencePiece does: " Hi" -> "▁▁Hi". Added tokens are cut out of the text
    # first, so every stretch between them gets its own "▁", as in llama.cpp.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    return backend

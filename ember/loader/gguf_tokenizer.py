"""The tokenizer of a GGUF file, built from llama.cpp's `tokenizer.ggml.*` metadata.

`tokenizer.ggml.model` names the vocabulary kind:

- "llama": SentencePiece (Llama 2, Mistral, Gemma, Phi-3). Tokens, scores and token types;
  built as HF's fast Llama tokenizer does it: BPE whose merges are ranked by the score of
  the merged piece, byte fallback to the `<0xNN>` tokens, spaces written as "▁" and one
  "▁" put in front of every stretch of text between special tokens where
  `tokenizer.ggml.add_space_prefix` says so (llama.cpp's rule, which is also
  SentencePiece's on plain text).
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

from ember.loader.tokenizer import Tokenizer, _bos_eos_processor

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
# "upper/lower case letter" with "letter that is not a-z / A-Z"), Kimi-K2 and AFMoE (custom
# C++ in llama.cpp; AFMoE's digit rule written here as a regex).
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
_CJK_KANA = "[一-龥\u3040-ゟ゠-ヿ]+"
_CJK_HANGUL = "[一-龥\u0800-一가-\ud7ff]+"
_LATIN_LIKE_LETTERS = (  # DeepSeek LLM's letter class, from its tokenizer.json
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗ"
    "ὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇ"
    "Ꞌ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_NOT_PUNCT_WORDS = r" ?[^(\s|.,!?…。，、।۔،)]+"  # Bloom, Poro, GPT3-Finnish, Viking
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
        r"[\r\n]", r"\s?[" + _LATIN_LIKE_LETTERS + "]+", "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+", r"\s+$",
        _CJK_HANGUL, r"\p{N}+"))),
    **_names("deepseek-coder", BpeSplit((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", _DEEPSEEK3),
    **_names("spark2_5", BpeSplit((
        r"\p{N}{1,3}", _CJK_KANA,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}"))),
    **_names("youtu", BpeSplit((
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _CJK_KANA,
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
        "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
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
    for key, token_id in (("bos", bos), ("eos", eos)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(
                f"{source}: tokenizer.ggml.{key}_token_id = {token_id} is outside the vocabulary "
                f"({len(tokens)} tokens); the file is corrupt, convert it again"
            )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = _bos_eos_processor(
            (tokens[bos], bos) if add_bos else None, (tokens[eos], eos) if add_eos else None
        )
    end_of_turn = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=end_of_turn,
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        vocab_size=len(tokens),
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

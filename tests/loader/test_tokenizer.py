"""ember's tokenizer against HF transformers' tokenizer built from the same GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.loader.default_model import fetch_default_model
from ember.loader.tokenizer import Tokenizer
from ember.loader.tokenizer_files import load_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\n\nafter blank lines\r\n",
    "12345",
    "3.14",
    "In 2024, 1,000,000 people paid $9.99.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n",
    'if (a && b) { console.log("hi"); }',
    "I'm sure you'll see they've done it",
    "emoji 👋🏽 and family 👨‍👩‍👧‍👦 and flag 🏳️‍🌈",
    "你好，世界！日本語のテキスト",
    "e\u0301 n\u0303 a\u0308 (combining marks) and Å",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "",
    " ",
]
UNICODE_TEXTS = [t for t in TEXTS if not t.isascii()]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another, with an émoji 🎨?"},
]
CHATS = {"single_user": CONVERSATION[3:], "system_user_assistant_user": CONVERSATION}


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: Path, hf_tokenizer):
    """transformers' AutoTokenizer built from the default GGUF: the session's `hf_tokenizer`
    (tests/conftest.py), ~5 CPU-s to build, shared with the engine tests' chat checks."""
    assert gguf_path == fetch_default_model()
    return hf_tokenizer


# -- ids -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_hf(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_hf(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_unicode_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_exact_ids(tok: Tokenizer) -> None:
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.convert_ids_to_tokens([19556, 905]) == ["Hello", "Ġworld"]
    assert tok.encode("The quick brown fox") == [504, 2365, 6354, 16438]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # every digit on its own
    assert tok.encode("3.14") == [35, 30, 33, 36]
    assert tok.encode("  leading") == [216, 2899]
    assert tok.encode("👋") == [10813, 235, 229]  # one emoji, three byte-level tokens
    assert tok.encode("<|im_start|>user\nhi<|im_end|>\n") == [1, 4093, 198, 6004, 2, 198]


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    # llama.cpp's end-of-generation tokens: <|im_end|> (EOS), <|endoftext|> and <reponame> (which
    # llama.cpp takes for a FIM repository-name token)
    assert tok.eos_token_ids == frozenset({0, 2, 4})
    assert tok.pad_token_id == 2
    assert tok.all_special_ids == list(range(17))  # the 17 CONTROL tokens
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2 says add_bos_token = False
    assert tok.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([49152])


# -- chat template -----------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_matches_hf(tok: Tokenizer, hf, chat: str, add_generation_prompt: bool) -> None:
    messages = CHATS[chat]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_chat_template_exact(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>"
                                            "\n{% endfor %}"], ids=["model's", "trimming"])
@pytest.mark.parametrize("content", ["The capital of France is", "  spaced out  "])
def test_continue_final_message_matches_hf(tok: Tokenizer, hf, template: str | None, content: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                   chat_template=template)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                    continue_final_message=True, chat_template=template)
    assert ours == theirs and ours.rstrip().endswith(content.strip())
    with pytest.raises(ValueError, match="pass add_generation_prompt=False"):
        tok.apply_chat_template(messages, continue_final_message=True)


def test_template_helpers_match_hf(tok: Tokenizer, hf) -> None:
    template = (
        "{{ bos_token }}{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
        "|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ custom }}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "<b>é 🎨 \"q\"</b>"}, {"role": "assistant", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ours = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template=template)
    got = ours.apply_chat_template(messages, tools=tools, custom="kw")
    assert got == hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False, custom="kw")
    assert '"<b>é 🎨 \\"q\\"</b>"' in got  # no HTML escaping, no \u escapes


def test_raise_exception_in_template(tok: Tokenizer) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    ours = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template=template)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be user"):
        ours.apply_chat_template([{"role": "system", "content": "x"}])


# -- errors and the HF-directory path ------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist.*gguf.*tokenizer.json"):
        load_tokenizer(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def _write_hf_dir(tok: Tokenizer, root: Path, config: dict, generation: dict | None = None) -> Path:
    root.mkdir()
    tok.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (root / "generation_config.json").write_text(json.dumps(generation))
    return root


def test_hf_dir_matches_gguf(tok: Tokenizer, tmp_path: Path) -> None:
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "add_bos_token": False, "chat_template": tok.chat_template}
    loaded = load_tokenizer(_write_hf_dir(tok, tmp_path / "hf", config, {"eos_token_id": [2, 0]}))
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.chat_template == tok.chat_template
    for messages in CHATS.values():
        assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.eos_token_ids == frozenset({0, 2})  # generation_config adds <|endoftext|>
    assert loaded.all_special_ids == tok.all_special_ids
    assert loaded.vocab_size == tok.vocab_size


def test_hf_dir_template_sources_and_bos(tok: Tokenizer, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages[0].content }}"}]
    root = _write_hf_dir(tok, tmp_path / "list", {"bos_token": {"content": "<|im_start|>"},
                                                  "add_bos_token": True, "chat_template": named})
    loaded = load_tokenizer(root)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    assert loaded.encode("Hello world") == [1, 19556, 905]  # add_bos_token True: BOS added once
    assert loaded.encode("Hello world", add_special_tokens=False) == [19556, 905]

    (root / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(root).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


def test_missing_chat_template(tok: Tokenizer, tmp_path: Path) -> None:
    loaded = load_tokenizer(_write_hf_dir(tok, tmp_path / "plain", {"eos_token": "<|endoftext|>"}))
    assert loaded.chat_template is None
    assert loaded.eos_token_ids == frozenset({0})
    with pytest.raises(ValueError, match="no chat template.*prompt"):
        loaded.apply_chat_template([{"role": "user", "content": "hi"}])


# -- chat template sources and overrides ---------------------------------------------------


GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }};{% endgeneration %}"
    "{% else %}{{ m.role[0] | upper }}:{{ m.content }};{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)


def test_generation_tag_renders_its_body_as_transformers_does(tok: Tokenizer, hf) -> None:
    ours = Tokenizer(tok.backend, bos_token_id=1, eos_token_id=2, chat_template=GENERATION_TEMPLATE)
    got = ours.apply_chat_template(CONVERSATION)
    assert got == "S:You are terse.;U:Name a colour.;A:Blue.;U:Another, with an émoji 🎨?;A:"
    assert got == hf.apply_chat_template(CONVERSATION, chat_template=GENERATION_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)


def test_template_file_precedence(tok: Tokenizer, tmp_path: Path) -> None:
    """As transformers: chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    root = _write_hf_dir(tok, tmp_path / "hf", {"chat_template": "config"})
    assert load_tokenizer(root).chat_template == "config"
    (root / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ messages | length }}"}))
    assert load_tokenizer(root).chat_template == "json {{ messages | length }}"
    (root / "chat_template.jinja").write_text("jinja")
    assert load_tokenizer(root).chat_template == "jinja"
    assert load_tokenizer(root, chat_template="given").chat_template == "given"


def test_chat_template_override_from_a_file_or_text(tok: Tokenizer, tmp_path: Path) -> None:
    from test_model_files import write_hf_dir

    from ember import EngineConfig
    from ember.engine.input_processor import load_engine_tokenizer

    model = write_hf_dir(tmp_path / "model")
    tok.backend.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "the model's"}))
    file = tmp_path / "template.jinja"
    file.write_text("F{{ messages[0].content }}")
    for given, expected in [(None, "the model's"), (str(file), "F{{ messages[0].content }}"),
                            ("T{{ messages[0].content }}", "T{{ messages[0].content }}")]:
        config = EngineConfig(model=str(model), chat_template=given).resolve()
        assert config.chat_template == (None if given is None else expected)
        assert load_engine_tokenizer(config).chat_template == expected
    with pytest.raises(ValueError) as info:
        EngineConfig(model=str(model), chat_template=str(tmp_path / "missing.jinja")).resolve()
    assert str(info.value) == (f"chat template {str(tmp_path / 'missing.jinja')!r} is neither a file nor a Jinja "
                               "template: pass the path of an existing file, or the template's text")


def test_tokenizer_override(tok: Tokenizer, tmp_path: Path) -> None:
    """A model without a tokenizer takes one from a directory given as its tokenizer."""
    from test_model_files import write_hf_dir

    from ember import EngineConfig
    from ember.engine.input_processor import load_engine_tokenizer

    model = write_hf_dir(tmp_path / "model")
    other = _write_hf_dir(tok, tmp_path / "tok", {"chat_template": "other"})
    assert load_engine_tokenizer(EngineConfig(model=str(model)).resolve()) is None
    config = EngineConfig(model=str(model), tokenizer=str(other), chat_template="{{ 'over' }}").resolve()
    loaded = load_engine_tokenizer(config)
    assert loaded.encode("Hello world") == tok.encode("Hello world")
    assert loaded.chat_template == "{{ 'over' }}"
    with pytest.raises(ValueError, match=r"^tokenizer '/no/such/tok' not found: pass a directory with tokenizer.json"):
        EngineConfig(model=str(model), tokenizer="/no/such/tok").resolve()


# -- small hand-written GGUF files -------------------------------------------------------------


def _write_gguf(path: Path, model: str, add_bos: bool = True, pre: str = "default") -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["<s>", "</s>", "<eot>", "<think>", "a", "b", "ab", "Ġ", "Ġab"])
    w.add_token_types([3, 3, 3, 4, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "Ġ ab"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_eot_token_id(2)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_bos_and_added_tokens(tmp_path: Path) -> None:
    tiny = load_tokenizer(_write_gguf(tmp_path / "tiny.gguf", "gpt2"))
    assert tiny.encode("ab ab") == [0, 6, 8]
    assert tiny.encode("ab ab", add_special_tokens=False) == [6, 8]
    assert tiny.encode("<think>ab</s>", add_special_tokens=False) == [3, 6, 1]
    assert tiny.decode([0, 3, 6, 2, 1], skip_special_tokens=True) == "<think>ab"  # user-defined kept
    assert tiny.eos_token_ids == frozenset({1, 2})
    assert tiny.all_special_ids == [0, 1, 2]
    assert tiny.chat_template is None
    no_bos = load_tokenizer(_write_gguf(tmp_path / "no_bos.gguf", "gpt2", add_bos=False))
    assert no_bos.encode("ab") == [6]


def test_unsupported_gguf_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'bert' is not supported; supported: 'llama' .* and 'gpt2'"):
        load_tokenizer(_write_gguf(tmp_path / "bert.gguf", "bert"))


def test_unknown_bpe_pre_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"pre = 'my-new-model' is not a pre-tokenizer llama.cpp knows.*Convert the model again"):
        load_tokenizer(_write_gguf(tmp_path / "new.gguf", "gpt2", pre="my-new-model"))
    with pytest.raises(ValueError, match=r"pre = 'roberta-bpe' is an embedding model's vocabulary.*HF directory"):
        load_tokenizer(_write_gguf(tmp_path / "roberta.gguf", "gpt2", pre="roberta-bpe"))

"""A repo with a SentencePiece tokenizer.model and no tokenizer.json: transformers converts
it (ember writes no tokenizer of its own), and ember's tokenizer gives the ids, text and
special tokens transformers' own tokenizer gives for the same files. The tokenizer.model
files are trained here by the sentencepiece trainer on a small text."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from ember.loader.tokenizer_files import load_tokenizer

spm = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf")

pytestmark = pytest.mark.slow  # transformers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world, hello there!", "def square(x): return x * x",
    "Numbers 12345 and 3.14 and 1,000,000.", "emoji 👋 and 你好世界", "line one\nline two\n\nafter a blank line",
    "I'm sure you'll see they've done it", "  leading spaces and trailing   ",
]
TEXTS = CORPUS + ["Hello unseen wordzzz", "tabs\tand\ttabs", "ünïcödé", "<s> written out </s>", "", " "]
KINDS = {
    # Llama's: BPE with byte fallback, LlamaTokenizer's converter
    "llama-bpe": ({"model_type": "bpe", "byte_fallback": True, "vocab_size": 400},
                  {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "legacy": False}),
    # a unigram model and no tokenizer class: transformers' generic SentencePiece conversion
    "unigram": ({"model_type": "unigram", "vocab_size": 64}, {"add_bos_token": False}),
}


def train(path: Path, kind: str) -> Path:
    spec, config = KINDS[kind]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 20), model_writer=model,
                                   character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2, **spec)
    path.mkdir(parents=True)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "chat_template": "{% for m in messages %}<s>{{ m.content }}</s>{% endfor %}", **config}))
    return path


@pytest.fixture(scope="module", params=sorted(KINDS))
def repo(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, train(tmp_path_factory.mktemp(request.param) / "tok", request.param)


def test_ids_and_text_match_transformers(repo: tuple[str, Path]) -> None:
    kind, repo = repo
    ours = load_tokenizer(repo)
    theirs = transformers.AutoTokenizer.from_pretrained(str(repo))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == \
            theirs.decode(theirs.encode(text), skip_special_tokens=True), text
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert ours.vocab_size == len(theirs) == KINDS[kind][0]["vocab_size"]
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"


def test_llama_kind_adds_bos(tmp_path: Path) -> None:
    tok = load_tokenizer(train(tmp_path / "tok", "llama-bpe"))
    assert tok.encode("Hello world")[0] == 1 and tok.encode("Hello world", add_special_tokens=False)[0] != 1


def test_a_model_dir_with_tokenizer_model_only(tmp_path: Path) -> None:
    from test_model_files import write_hf_dir

    from ember import EngineConfig
    from ember.engine.input_processor import load_engine_tokenizer

    model = write_hf_dir(tmp_path / "model")
    train(tmp_path / "tok", "unigram")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (model / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    loaded = load_engine_tokenizer(EngineConfig(model=str(model)).resolve())
    assert loaded.encode("Hello world") == load_tokenizer(tmp_path / "tok").encode("Hello world")


@pytest.mark.parametrize("blocked, named", [("sentencepiece", "sentencepiece"), ("google.protobuf", "protobuf"),
                                            ("transformers", "transformers")])
def test_missing_converter_packages_are_named(tmp_path: Path, monkeypatch, blocked: str, named: str) -> None:
    path = train(tmp_path / "tok", "unigram")
    monkeypatch.setitem(sys.modules, blocked, None)  # as if it were not installed
    with pytest.raises(ValueError) as info:
        load_tokenizer(path)
    assert str(info.value) == (f"{str(path)!r} has a SentencePiece tokenizer.model and no tokenizer.json; converting "
                               f"it needs {named}: pip install {named} (or add a tokenizer.json)")

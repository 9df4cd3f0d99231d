"""Which files make a tokenizer: a `.gguf` file (gguf_tokenizer.py) or an HF model directory
(tokenizer.json, or a SentencePiece tokenizer.model converted by transformers), and the chat
template a flag names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from ember.loader.gguf_tokenizer import tokenizer_from_gguf
from ember.loader.tokenizer import Tokenizer, bos_eos_processor


def load_tokenizer(path: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a `.gguf` file or of an HF model directory (tokenizer.json, or a
    SentencePiece tokenizer.model); `chat_template` (the template text) replaces the model's."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(
            f"tokenizer path {str(path)!r} does not exist: pass a .gguf file or an HF model "
            "directory that holds tokenizer.json"
        )
    if path.is_dir():
        tok = _from_hf_dir(path)
    elif path.suffix == ".gguf":
        tok = tokenizer_from_gguf(path)
    else:
        raise ValueError(
            f"cannot load a tokenizer from {str(path)!r}: pass a .gguf file or an HF model directory "
            "that holds tokenizer.json"
        )
    if chat_template is not None:
        tok._chat_template = chat_template
    return tok


def has_hf_tokenizer(path: Path) -> bool:
    """Whether an HF directory holds a tokenizer ember can load."""
    return (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()


_JINJA_MARKS = ("{{", "{%", "{#")


def load_chat_template(value: str) -> str:
    """A chat template given as a file's path, or as the Jinja text itself."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a template's text can be too long a name for the file system
        pass
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    raise ValueError(f"chat template {value!r:.200} is neither a file nor a Jinja template: pass the path of an "
                     "existing file, or the template's text")


def _from_hf_dir(path: Path) -> Tokenizer:
    tokenizer_json = path / "tokenizer.json"
    if tokenizer_json.is_file():
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    elif (path / "tokenizer.model").is_file():
        backend = _convert_sentencepiece(path)
    else:
        raise ValueError(
            f"{str(path)!r} has no tokenizer.json: ember reads HF fast tokenizers "
            "(tokenizer.json + tokenizer_config.json) or a SentencePiece tokenizer.model, or pass a .gguf file"
        )
    config = _read_json(path / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
            token = token.get("content")
        return backend.token_to_id(token) if isinstance(token, str) else None

    bos, eos = token_id("bos_token"), token_id("eos_token")
    # The tokenizer.json post-processor normally adds BOS itself; add it only where the config
    # asks for it and the post-processor does not.
    if config.get("add_bos_token") and bos is not None:
        if backend.encode("", add_special_tokens=True).ids[:1] != [bos]:
            ours = bos_eos_processor((backend.id_to_token(bos), bos), None)
            old = backend.post_processor
            backend.post_processor = processors.Sequence([old, ours]) if old else ours

    generation = _read_json(path / "generation_config.json")
    gen_eos = generation.get("eos_token_id")
    extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
    if eos is None and extra_eos:
        eos = extra_eos[0]

    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        extra_eos_token_ids=extra_eos,
        pad_token_id=token_id("pad_token"),
        chat_template=_hf_chat_template(path, config),
    )


def _convert_sentencepiece(path: Path) -> tokenizers.Tokenizer:
    """A fast tokenizer from a SentencePiece tokenizer.model, converted by transformers (its
    convert_slow_tokenizer machinery, with the converter the tokenizer class calls for), so
    it gives the ids transformers' own tokenizer gives."""
    missing = [pip for module, pip in (("transformers", "transformers"), ("sentencepiece", "sentencepiece"),
                                       ("google.protobuf", "protobuf")) if not _importable(module)]
    if missing:
        raise ValueError(f"{str(path)!r} has a SentencePiece tokenizer.model and no tokenizer.json; converting it "
                         f"needs {', '.join(missing)}: pip install {' '.join(missing)} (or add a tokenizer.json)")
    from transformers import AutoTokenizer

    try:
        converted = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a file it cannot convert
        raise ValueError(f"transformers could not convert {path / 'tokenizer.model'} ({type(e).__name__}: "
                         f"{str(e)[:300]}): add a tokenizer.json to {str(path)!r}") from None
    backend = getattr(converted, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise ValueError(f"transformers gave no fast tokenizer for {path / 'tokenizer.model'}: add a "
                         f"tokenizer.json to {str(path)!r}")
    return backend


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package (google) is missing, or the module is blocked
        return False


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The template transformers would take: chat_template.jinja, else chat_template.json,
    else tokenizer_config.json's (the "default" one of a named list)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

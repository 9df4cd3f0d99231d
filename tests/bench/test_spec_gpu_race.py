"""Issue #38's GPU race scripts, run here so they cannot rot: spec_gpu_race.py's ember side on the
default model (ngram gives the tokens of no speculation) and smol_stage.py's parts (they make the
GGUF again, byte for byte, with SmolLM2's config beside them)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_race_scripts_ember_side_gives_the_same_tokens_with_ngram(gguf_path):
    race = load("spec_gpu_race")
    items = json.loads(race.PROMPTS.read_text())[:2]
    none = race.run_arm("ember", str(gguf_path), None, items, max_tokens=16, repeats=1)
    ngram = race.run_arm("ember", str(gguf_path), race.spec_config(4, (2, 4)), items, max_tokens=16, repeats=1)
    assert [len(o) for o in none["outputs"]] == [16, 16]
    assert ngram["outputs"] == none["outputs"]
    assert none["drafts"] == 0 and ngram["drafts"] > 0 and 0 < ngram["accepted_tokens"] <= ngram["draft_tokens"]
    row = race.summary("ember", none, ngram, 4)
    assert row["same_tokens"] and row["same_prompts"] and row["prompts"] == 2
    assert row["ngram"]["output_tokens"] == row["none"]["output_tokens"] == 32
    assert row["ngram"]["mean_accepted_length"] == round(1 + ngram["accepted_tokens"] / ngram["drafts"], 3)


def test_the_stage_scripts_parts_make_the_gguf_again(gguf_path, tmp_path):
    stage = load("smol_stage")
    folders = stage.split(gguf_path, tmp_path)
    assert [f.name for f in folders] == [".smol-s0", ".smol-s1"]
    assert all(p.stat().st_size <= stage.PART_MAX for f in folders for p in f.glob("smol-part*"))
    copied = tmp_path / "st"  # what the copy calls leave in /root/st
    copied.mkdir()
    for f in folders:
        for p in f.iterdir():
            (copied / p.name).symlink_to(p)
    joined = stage.join(copied, tmp_path / "joined.gguf")
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == digest
    hf = folders[-1] / "smol-hf"
    assert (hf / "gguf.sha256").read_text().strip() == digest
    config = json.loads((hf / "config.json").read_text())
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                   "tie_word_embeddings", "bos_token_id", "eos_token_id")} == {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    assert (hf / "tokenizer.json").is_file() and (hf / "chat_template.jinja").is_file()
    (copied / "smol-part1").unlink()
    (copied / "smol-part1").write_bytes(b"not the part")
    with pytest.raises(ValueError, match="sha256 differs"):
        stage.join(copied, tmp_path / "bad.gguf")
    (copied / "smol-part0").unlink()
    with pytest.raises(ValueError, match="not smol-part0"):
        stage.join(copied, tmp_path / "bad.gguf")

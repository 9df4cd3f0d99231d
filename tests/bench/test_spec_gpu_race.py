"""Issue #38's GPU race scripts, run here so they cannot rot: spec_gpu_race.py's ember side on the
default model (ngram gives the tokens of no speculation) and on a tiny HF target with the drafters
ember/bench/spec_drafts.py writes from it (eagle3 and draft_model give the tokens of no speculation,
one request at a time and batched), and smol_stage.py's parts (they make the GGUF again, byte for
byte, with SmolLM2's config beside them)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "benchmarks" / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_race_scripts_ember_side_gives_the_same_tokens_with_ngram(gguf_path):
    race = load("spec_gpu_race")
    items = json.loads(race.PROMPTS.read_text())[:2]
    none, = race.run_arm("ember", str(gguf_path), None, items, max_tokens=16, repeats=1)
    ngram, = race.run_arm("ember", str(gguf_path), race.spec_config(4, (2, 4)), items, max_tokens=16, repeats=1)
    assert [len(o) for o in none["outputs"]] == [16, 16]
    assert ngram["outputs"] == none["outputs"]
    assert none["drafts"] == 0 and ngram["drafts"] > 0 and 0 < ngram["accepted_tokens"] <= ngram["draft_tokens"]
    row = race.summary("ember", none, ngram, 4)
    assert row["same_tokens"] and row["same_prompts"] and row["prompts"] == 2 and row["batch"] == 1
    assert row["ngram"]["outputs_sha256"] == row["none"]["outputs_sha256"]
    assert sum(row["ngram"]["accepted_per_position"]) == row["ngram"]["accepted_tokens"] == ngram["accepted_tokens"]
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


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, bpe_tokenizer_dir):
    """A random 8-layer Llama of SmolLM2's vocabulary (hidden 64, float32, tied embeddings, seed 0)
    with SmolLM2's tokenizer and chat template beside it: the race's HF target at a CPU's size. Its
    weights are drawn wider than transformers' default (std 0.08, not 0.02), so its layers matter:
    its first 6 guess some of its tokens and miss others (at 0.02 they guess all 8 tokens)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
        vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        initializer_range=0.08))
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    for p in bpe_tokenizer_dir.iterdir():
        shutil.copy(p, path / p.name)
    return path


def test_the_drafts_are_the_targets_first_layers_and_a_random_head(tiny_target, tmp_path):
    from safetensors.torch import load_file

    from ember.bench.spec_drafts import write_drafts

    drafts = write_drafts(tiny_target, tmp_path / "drafts", layers=2)
    assert drafts == {"draft_model": tmp_path / "drafts" / "draft_model", "eagle3": tmp_path / "drafts" / "eagle3"}
    target_config = json.loads((tiny_target / "config.json").read_text())
    config = json.loads((drafts["draft_model"] / "config.json").read_text())
    assert config == target_config | {"num_hidden_layers": 2}
    target, draft = load_file(tiny_target / "model.safetensors"), load_file(drafts["draft_model"] / "model.safetensors")
    kept = {n for n in target if not n.startswith("model.layers.") or n.split(".")[2] in ("0", "1")}
    assert sorted(draft) == sorted(kept) and len(kept) == 2 + 2 * 9  # embed, norm; 9 tensors a layer; lm_head tied
    assert all(torch.equal(draft[n], target[n]) for n in kept)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_target / name).exists():
            assert (drafts["draft_model"] / name).read_bytes() == (tiny_target / name).read_bytes()
    head = json.loads((drafts["eagle3"] / "config.json").read_text())
    assert {k: head[k] for k in ("architectures", "hidden_size", "vocab_size", "draft_vocab_size",
                                 "num_attention_heads", "num_key_value_heads", "intermediate_size", "eagle_config")} \
        == {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "vocab_size": 49152,
            "draft_vocab_size": 32000, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}
    weights = load_file(drafts["eagle3"] / "model.safetensors")
    assert weights["fc.weight"].shape == (64, 3 * 64) and weights["lm_head.weight"].shape == (32000, 64)
    assert weights["fc.weight"].dtype == torch.bfloat16 and "embed_tokens.weight" not in weights
    stamp = (drafts["eagle3"] / "model.safetensors").stat().st_mtime_ns
    assert write_drafts(tiny_target, tmp_path / "drafts", layers=3) == drafts  # there already: kept as it is
    assert (drafts["eagle3"] / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((drafts["draft_model"] / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="keeps 1 to 8 of the target's 8 layers; got 9"):
        write_drafts(tiny_target, tmp_path / "other", layers=9)
    whole = write_drafts(tiny_target, tmp_path / "whole", layers=8)["draft_model"]  # the target as its own draft
    assert json.loads((whole / "config.json").read_text()) == target_config
    assert not (tmp_path / "other" / "draft_model").exists()


def test_the_race_scripts_model_arms_keep_the_targets_tokens_at_batch_1_and_3(tiny_target, tmp_path):
    from ember.bench.spec_drafts import write_drafts

    race = load("spec_gpu_race")
    items = json.loads(race.PROMPTS.read_text())[:2]
    drafts = write_drafts(tiny_target, tmp_path, layers=6)
    target = str(tiny_target)
    none = race.run_arm("ember", target, None, items, max_tokens=8, repeats=1, batches=(1, 3))
    assert [a["batch"] for a in none] == [1, 3] and [len(a["outputs"]) for a in none] == [2, 3]
    assert all(len(o) == 8 for a in none for o in a["outputs"])
    assert none[1]["outputs"][2] == none[1]["outputs"][0]  # the batch's third prompt is the first again
    assert none[0]["drafts"] == 0 and none[0]["accepted_per_position"] == []
    for method in ("draft_model", "eagle3"):
        spec = race.spec_config(4, (2, 4), method, drafts[method])
        assert spec == {"method": method, "model": str(drafts[method]), "num_speculative_tokens": 4}
        arms = race.run_arm("ember", target, spec, items, max_tokens=8, repeats=1, batches=(1, 3))
        for base, arm in zip(none, arms):
            assert arm["method"] == method and arm["outputs"] == base["outputs"], (method, arm["batch"])
            assert arm["drafts"] > 0 and 0 <= arm["accepted_tokens"] <= arm["draft_tokens"] <= 4 * arm["drafts"]
            per = arm["accepted_per_position"]
            assert sum(per) == arm["accepted_tokens"] and all(a >= b for a, b in zip(per, per[1:]))
            row = race.summary("ember", base, arm, 4)
            assert row["same_tokens"] and row["same_prompts"] and row["batch"] == arm["batch"]
            assert row[method]["outputs_sha256"] == row["none"]["outputs_sha256"]
            assert row[method]["accepted_tokens"] == arm["accepted_tokens"]
            assert row[method]["acceptance_per_position"] == [round(n / arm["drafts"], 3) for n in per]
        if method == "draft_model":  # the target's first layers guess some of its tokens, not all
            assert all(0 < a["accepted_tokens"] < a["draft_tokens"] for a in arms)


def test_the_race_script_writes_the_drafts_then_prints_a_result_line_a_method_and_batch(tiny_target, tmp_path):
    drafts = tmp_path / "drafts"
    done = subprocess.run([sys.executable, str(SCRIPTS / "spec_gpu_race.py"), "--engine", "ember", "--model",
                           str(tiny_target), "--methods", "draft_model", "eagle3", "--batch", "1", "3", "--max-tokens",
                           "8", "--prompts", "2", "--repeats", "1", "--drafts-dir", str(drafts), "--draft-layers", "6"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert [(r["method"], r["batch"], r["prompts"]) for r in rows] == [
        ("draft_model", 1, 2), ("draft_model", 3, 3), ("eagle3", 1, 2), ("eagle3", 3, 3)]
    assert json.loads((drafts / "draft_model" / "config.json").read_text())["num_hidden_layers"] == 6
    for r in rows:
        arm = r[r["method"]]
        assert r["same_tokens"] and r["same_prompts"] and arm["outputs_sha256"] == r["none"]["outputs_sha256"]
        assert r["none"]["output_tokens"] == arm["output_tokens"] == 8 * r["prompts"]
        assert sum(arm["accepted_per_position"]) == arm["accepted_tokens"] <= arm["draft_tokens"]
        assert r["speedup"] == round(arm["tok_per_s"] / r["none"]["tok_per_s"], 3)
    assert all(0 < r["draft_model"]["accepted_tokens"] < r["draft_model"]["draft_tokens"] for r in rows[:2])
